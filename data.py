"""Data for continual learning: images as tensors in memory, split into tasks; and the files a run writes. The
offline default is SplitMNIST from `data/mnist_5k.csv.gz`, real MNIST images shipped with the project; others come
from their usual on-disk formats under a data root, or from a `.pt` file (`load_tensor_file`)."""
import functools
import gzip
import hashlib
import json
import os
import pickle
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import torch

MNIST_SUBSET = Path(__file__).resolve().parent / "data" / "mnist_5k.csv.gz"
MNIST_SUBSET_PER_CLASS = 500  # images per digit in the shipped subset
MNIST_SUBSET_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
_PARSED = {}  # sha256 of a CSV -> its images and labels: a run_all.sh worker (many runs, one process) parses it once
IDX_STEMS = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # `apt-get install dataset-fashion-mnist`, offline
# A task: its original class ids in task order, x [n, C, H, W] normalised, y as the model sees them (split_into_tasks)
Task = namedtuple("Task", "classes x_train y_train x_test y_test")

class DataError(Exception):
    """A dataset is missing, corrupt or too small; the CLI prints it as one line."""

def need(ok, message):  # refuse bad input in one line before training, never by a traceback in the middle of a run
    if not ok:
        raise DataError(message)

def load_mnist_subset(path=MNIST_SUBSET):
    """The shipped CSV, one image per line (784 pixels 0-255, then the label): uint8 [N, 1, 28, 28], int64 [N]."""
    need((path := Path(path)).is_file(), f"MNIST subset not found at {path}; restore it with `git checkout -- data`")
    digest = hashlib.sha256(raw := path.read_bytes()).hexdigest()
    need(path != MNIST_SUBSET or digest == MNIST_SUBSET_SHA256,
         f"{path} is corrupt (sha256 mismatch); restore it with `git checkout -- data`")
    if digest not in _PARSED:
        try:  # `or [""]`: an empty file fails int("") and is refused here too
            rows = gzip.decompress(raw).decode().split() or [""]
            table = torch.tensor([int(v) for row in rows for v in row.split(",")]).view(len(rows), 785)
        except (OSError, EOFError, ValueError, RuntimeError) as err:
            raise DataError(f"{path} is not a gzip CSV of 785 integers per line ({err})") from None
        need(table.min() >= 0 and table[:, :784].max() <= 255 and table[:, 784].max() <= 9,
             f"{path} has pixel values outside 0-255 or labels outside 0-9")
        _PARSED[digest] = table[:, :784].to(torch.uint8).view(-1, 1, 28, 28), table[:, 784]
    return _PARSED[digest][0].clone(), _PARSED[digest][1].clone()  # clones: a caller cannot spoil the cache

def split_into_tasks(x_train, y_train, x_test, y_test, class_order, classes_per_task, scenario):
    """Cut the class order into tasks of k classes and relabel (Sec. 5). CIL: a class's label is its place in the class
    order (task 2 owns k..2k-1), so the head grows by k outputs a task; DIL: each task is 0..k-1, one head of k."""
    tasks = []
    for start in range(0, len(class_order), classes_per_task):
        classes = class_order[start:start + classes_per_task]
        position = {c: (start if scenario == "cil" else 0) + j for j, c in enumerate(classes)}
        def select(x, y):
            mask = torch.isin(y, torch.tensor(classes))
            return x[mask], torch.tensor([position[int(c)] for c in y[mask]])
        tasks.append(Task(classes, *select(x_train, y_train), *select(x_test, y_test)))
    return tasks

def read_idx(path):
    """An IDX file (MNIST's: 0, 0, 0x08 for bytes, ndim; ndim big-endian int32 sizes; values), gzipped or not."""
    raw = gzip.decompress(raw) if (raw := Path(path).read_bytes()).startswith(b"\x1f\x8b") else raw
    need(len(raw) >= 4 and raw[:3] == b"\0\0\x08", f"{path} is not an unsigned-byte IDX file")
    shape, body = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(raw[3])], raw[4 + 4 * raw[3]:]
    need(len(body) == torch.Size(shape).numel(), f"{path} is truncated: header says {shape}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(shape)

def fetch(name, root, download, explain=None):
    """Run a torchvision download, or say in one line how to get the files; a failure leaves no empty folder behind."""
    before, above = set((root := Path(root)).rglob("*")), [p for p in (root, *root.parents) if not p.exists()]
    try:
        download()
    except Exception as err:  # offline machines fail in many ways (DNS, refused, timeout)
        for new in sorted(set(root.rglob("*")) - before, key=lambda p: -len(p.parts)) + above:  # the deepest first
            if new.is_dir() and not any(new.iterdir()):
                new.rmdir()
        why = explain or (f"{name} is not under {root} and could not be downloaded ({{}}); on a machine with internet "
                          f"run this project once with --data-root {root}, then copy the folder here")
        raise DataError(why.format(type(err).__name__)) from None

def load_fashion_mnist(root):
    """Fashion-MNIST (Xiao et al. 2017), 10 classes of clothing as IDX files: torchvision's, Debian's, or downloaded."""
    raw = Path(root) / "FashionMNIST" / "raw"
    files = lambda d: [next((p for p in (Path(d, s), Path(d, s + ".gz")) if p.is_file()), None) for s in IDX_STEMS]
    if (found := next((f for f in (files(raw), files(DEBIAN_FASHION_MNIST)) if None not in f), None)) is None:
        import torchvision
        fetch("fashion-mnist", root, lambda: torchvision.datasets.FashionMNIST(root, download=True),
              f"fashion-mnist is not under {raw} or {DEBIAN_FASHION_MNIST} and could not be downloaded ({{}}); install "
              f"it with `apt-get install dataset-fashion-mnist`, or run once online with --data-root {root}")
    x_train, y_train, x_test, y_test = map(read_idx, found or files(raw))
    return x_train[:, None], y_train.long(), x_test[:, None], y_test.long()  # one channel

class ArraysOnly(pickle.Unpickler):
    """CIFAR10's batches are pickles, and a pickle may name any function to call as it loads: a crafted file under
    --data-root must not run code. This unpickler knows only what a batch holds (numpy's array, its dtype, their
    rebuilders in old and new numpy spellings, the codec Python 2 strings come back through) and refuses all else."""
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
               ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}
    def find_class(self, module, name):  # refused before the name is even looked up
        need((module, name) in self.ALLOWED, f"it asks to call {module}.{name}, refused: nothing was run")
        return super().find_class(module, name)

def load_cifar10(root):
    if not (folder := Path(root) / "cifar-10-batches-py").is_dir():
        import torchvision
        fetch("CIFAR10", root, lambda: torchvision.datasets.CIFAR10(root, download=True))
    def batch(name):  # 10000 rows of 3x32x32 bytes, channel-major, and a list of labels
        try:
            with open(folder / name, "rb") as f:
                b = ArraysOnly(f, encoding="bytes").load()
            return torch.as_tensor(b[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32), torch.tensor(b[b"labels"])
        except Exception as err:  # missing, garbage, or refused by ArraysOnly: all in one line
            raise DataError(f"{folder / name} is missing or not a CIFAR10 batch ({err})") from None
    train = [batch(f"data_batch_{i}") for i in range(1, 6)]
    return torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), *batch("test_batch")

def load_tensor_file(path):
    """A user's dataset: torch.save({"x_train", "y_train", "x_test", "y_test"}, path), x [N, C, H, W] or [N, D]
    (vectors become [N, 1, 1, D]), dense, uint8 (0-255) or float (0-1); y integer labels 0..K-1."""
    try:
        content = torch.load(path, weights_only=True)  # weights_only: tensors and containers, never code
    except Exception as err:
        raise DataError(f"{path} is a folder, not a file saved with torch.save" if Path(path).is_dir() else
                        f"dataset file {path} not found" if isinstance(err, FileNotFoundError) else
                        f"{path} is not a torch.save file of tensors ({type(err).__name__})") from None
    keys = ("x_train", "y_train", "x_test", "y_test")
    need(isinstance(content, dict) and all(k in content for k in keys), f"{path} must hold a dict with keys "
         f"{list(keys)}; it has {sorted(content) if isinstance(content, dict) else type(content).__name__}")
    check = lambda ok, words: need(ok, f"{path}: {words}")  # each check runs once those above it have passed
    for k, t in zip(keys, map(content.get, keys)):
        check(isinstance(t, torch.Tensor), f"{k} is a {type(t).__name__}, not a tensor")
        check(t.layout == torch.strided, f"{k} is a {t.layout} tensor; save it dense (.to_dense())")
    x_train, y_train, x_test, y_test = (content[k].detach() for k in keys)  # requires_grad would break training
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        check(x.dim() in (2, 4), f"x_{split} must be [N, C, H, W] or [N, D], got shape {list(x.shape)}")
        check(y.dim() == 1 and len(y) == len(x), f"y_{split} must be a 1-D tensor with one label per row of x_{split}")
        check(len(x) and x[0].numel(), f"x_{split} holds no images, or images of no pixels: shape {list(x.shape)}")
        check(not (y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool),
              f"y_{split} must hold integer labels, got {y.dtype}")
        check(y.min() >= 0, f"y_{split} has negative labels")
        check(split == "test" or torch.equal(y.unique(), torch.arange(len(y.unique()))),
              f"y_train must use the labels 0..K-1, each at least once; got {y.unique().tolist()}")
        unseen = [c for c in y.unique().tolist() if c >= len(y_train.unique())]  # for y_train: none, once it passed
        check(not unseen, f"y_test has labels that y_train lacks: {unseen}")
        check(torch.isfinite(x.float()).all(), f"x_{split} has NaN or infinite pixels")
        check(x.dtype == torch.uint8 or (x.dtype.is_floating_point and 0 <= x.min() and x.max() <= 1),
              f"x_{split} must be uint8 (0-255) or float in [0, 1]")
    check(x_train.shape[1:] == x_test.shape[1:],
          f"train images {list(x_train.shape[1:])} and test images {list(x_test.shape[1:])} differ in shape")
    as_images = lambda x: x if x.dim() == 4 else x[:, None, None, :]
    return as_images(x_train), y_train.long(), as_images(x_test), y_test.long()

# Raw images [N, C, H, W] (uint8, or float in [0, 1]) and labels, train then test; mnist has no test split (None).
LOADERS = {"mnist": lambda root: (*load_mnist_subset(), None, None), "fashion-mnist": load_fashion_mnist,
           "cifar10": load_cifar10}
DATASETS = list(LOADERS)
def load(dataset, data_root="data"):  # a name in DATASETS, else the path of a .pt file
    return LOADERS[dataset](data_root) if dataset in LOADERS else load_tensor_file(dataset)

def make_tasks(dataset, seed, n_per_class=100, scenario="cil", classes_per_task=2, data_root="data"):
    """Split a dataset into tasks (the paper's Sec. 5, App. C). One generator draws the class order, then a permutation
    per class: its first `n_per_class` train (None: all). Pixels are scaled to [0, 1] less the training mean image, so
    in [-1, 1] as the prior of Eq. 5 assumes. Classes that fill no whole task are left out (4th value)."""
    x_train, y_train, x_test, y_test = load(dataset, data_root)
    generator, classes = torch.Generator().manual_seed(seed), torch.unique(y_train)
    n_tasks = len(classes) // classes_per_task
    need(n_tasks >= 2, f"{dataset} has {len(classes)} class(es): too few for two tasks of {classes_per_task}")
    class_order = classes[torch.randperm(len(classes), generator=generator)][:n_tasks * classes_per_task].tolist()
    one_pool = x_test is None
    need(not one_pool or n_per_class is not None, f"{dataset} has no test split, so it cannot train on all images")
    picks = []
    for c in class_order:
        idx = (y_train == c).nonzero().squeeze(1)
        need(n_per_class is None or len(idx) >= n_per_class + one_pool, f"class {c} has {len(idx)} images; "
             f"{n_per_class} per class for training leaves none to test on" if one_pool else
             f"class {c} has only {len(idx)} training images, fewer than --n-per-class {n_per_class}")
        picks.append(idx[torch.randperm(len(idx), generator=generator)])
    if one_pool:  # no test split: the images not drawn for training are the test set
        x_test, y_test = (t[torch.cat([p[n_per_class:] for p in picks])] for t in (x_train, y_train))
    keep = torch.cat([p[:n_per_class] for p in picks])
    scaled = lambda x: x.float() / 255 if x.dtype == torch.uint8 else x.float()
    x_train, y_train, x_test = scaled(x_train[keep]), y_train[keep], scaled(x_test)
    mean_image = x_train.mean(0)
    return (split_into_tasks(x_train - mean_image, y_train, x_test - mean_image, y_test, class_order, classes_per_task,
                             scenario), class_order, mean_image, sorted(set(classes.tolist()) - set(class_order)))

def validation_split(tasks, fraction=0.2, seed=0):
    """For tuning (tools/tune.py): each task tested on a held-out `fraction` of its own training images, never on
    the test images, so nothing chosen with it has seen them. One generator draws one permutation per task."""
    generator, split = torch.Generator().manual_seed(seed), []
    for task in tasks:
        order = torch.randperm(len(task.x_train), generator=generator).to(task.x_train.device)
        n_val = max(1, round(fraction * len(order)))
        need(n_val < len(order), f"a task with {len(order)} training images cannot spare {n_val} for validation")
        val, train = order[:n_val], order[n_val:]
        split.append(Task(task.classes, task.x_train[train], task.y_train[train], task.x_train[val], task.y_train[val]))
    return split

def loader(x, y, batch_size, shuffle=True, seed=0):  # a seeded generator of its own: a seed repeats the batch order
    dataset, generator = torch.utils.data.TensorDataset(x, y), torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)


# --- The files a run writes ---

def check_writable(folder):
    """The results folder, or the nearest one above it that exists, takes a file (nothing is made here)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise DataError(f"--out {folder} is a file; it must name a folder")
    there = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    try:
        probe = there / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise DataError(f"--out {folder}: cannot write results there ({err.strerror or err})") from None


@functools.cache  # once per process: the code it loaded, whatever is committed while it runs
def provenance():
    """What made a result, beyond its config: code version, library, machine."""
    git = lambda *a: subprocess.run(["git", *a], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                                    timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD") or None
        dirty = bool(commit) and bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    return {"commit": commit, "uncommitted_changes": dirty, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "threads": torch.get_num_threads(), "python": sys.version.split()[0]}


def write_json_atomically(path, record):
    """Write to a temporary name, then rename: a killed run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(tmp, path)


@functools.cache  # a dataset file is hashed once per process
def file_sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
