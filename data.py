"""Data for continual learning: datasets as image tensors in memory, split into tasks; and the files a run writes."""
import dataclasses, functools, gzip, hashlib, importlib, io, json, os, pickle, subprocess, sys, tempfile
from collections import namedtuple
from pathlib import Path

import numpy as np
import torch

MNIST_SUBSET = Path(__file__).resolve().parent / "data" / "mnist_5k.csv.gz"  # the default: real MNIST, 500 a digit
MNIST_SUBSET_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
IDX_STEMS = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # `apt-get install dataset-fashion-mnist`, offline
Task = namedtuple("Task", "classes x_train y_train x_test y_test")  # class ids in task order; x [n, C, H, W] normalised

class DataError(Exception):
    """A dataset is missing, corrupt or too small; the CLI prints it as one line."""

def need(ok, message):  # refuse bad input in one line before training, never by a traceback in the middle of a run
    if not ok:
        raise DataError(message)

def load_mnist_subset(path=MNIST_SUBSET):
    """The shipped CSV, one image per line (784 pixels 0-255, then the label): uint8 [N, 1, 28, 28], int64 [N]."""
    digest = hashlib.sha256(raw := path.read_bytes()).hexdigest() if (path := Path(path)).is_file() else None
    need(digest == MNIST_SUBSET_SHA256, f"{path} is missing or not the shipped MNIST subset: `git checkout -- data`")
    table = torch.from_numpy(np.loadtxt(gzip.decompress(raw).decode().split(), delimiter=",", dtype=np.int64))
    return table[:, :784].to(torch.uint8).view(-1, 1, 28, 28), table[:, 784].clone()

def read_idx(path):
    """An IDX file (MNIST's: 0, 0, 0x08 for bytes, ndim; ndim big-endian int32 sizes; values), gzipped or not."""
    raw = gzip.decompress(raw) if (raw := Path(path).read_bytes()).startswith(b"\x1f\x8b") else raw
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(raw[3] if len(raw) > 3 else 0)]
    need(raw[:3] == b"\0\0\x08" and len(raw) == 4 + 4 * len(shape) + torch.Size(shape).numel(),
         f"{path} is not an unsigned-byte IDX file, or is truncated (header: {shape})")
    return torch.frombuffer(bytearray(raw[4 + 4 * len(shape):]), dtype=torch.uint8).view(shape)

def fetch(name, root, how):  # torchvision's download; offline (DNS, refused, timeout), one line on how to get the files
    try:
        getattr(importlib.import_module("torchvision.datasets"), name)(root, download=True)  # imported here: slow
    except Exception as err:
        raise DataError(f"{name} is not under {root} and its download failed ({type(err).__name__}); {how}") from None

def load_fashion_mnist(root):
    """Fashion-MNIST (Xiao et al. 2017), 10 classes of clothing as IDX files: torchvision's, Debian's, or downloaded."""
    files = lambda d: [next((p for p in (Path(d, s), Path(d, s + ".gz")) if p.is_file()), None) for s in IDX_STEMS]
    raw = Path(root, "FashionMNIST", "raw")  # where torchvision keeps and downloads them
    if None in (found := files(raw)) and None in (found := files(DEBIAN_FASHION_MNIST)):
        fetch("FashionMNIST", root, f"nor in {DEBIAN_FASHION_MNIST}: `apt-get install dataset-fashion-mnist`")
        found = files(raw)
    return tuple(t.long() if t.dim() == 1 else t[:, None] for t in map(read_idx, found))  # images get one channel

class ArraysOnly(pickle.Unpickler):
    """A pickle may name any function to call as it loads: for CIFAR10's batches, this finds numpy's arrays only."""
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"), *((f"numpy.{core}.{mod}", f) for core
               in ("core", "_core") for mod, f in (("multiarray", "_reconstruct"), ("numeric", "_frombuffer")))}

    def find_class(self, module, name):  # refuses before looking the name up
        need((module, name) in self.ALLOWED, f"it asks to call {module}.{name}, refused: nothing was run")
        return super().find_class(module, name)

def load_cifar10(root):
    """CIFAR10 (Krizhevsky 2009) as torchvision keeps it: five training batches and a test batch, read by ArraysOnly."""
    if not (folder := Path(root) / "cifar-10-batches-py").is_dir():
        fetch("CIFAR10", root, f"on a machine with internet run once with --data-root {root}, copy the folder here")

    def batch(name):  # 10000 rows of 3x32x32 bytes, channel-major, and a list of labels
        try:
            b = ArraysOnly(io.BytesIO((folder / name).read_bytes()), encoding="bytes").load()
            return torch.as_tensor(b[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32), torch.tensor(b[b"labels"])
        except Exception as err:  # missing, garbage, or refused by ArraysOnly: all in one line
            raise DataError(f"{folder / name} is missing or not a CIFAR10 batch ({err})") from None
    return (*map(torch.cat, zip(*(batch(f"data_batch_{i}") for i in range(1, 6)))), *batch("test_batch"))

def load_tensor_file(path):
    """A user's dataset, torch.save({"x_train": ..., "y_train": ..., "x_test": ..., "y_test": ...}, path)."""
    try:
        content = torch.load(path, weights_only=True)  # weights_only: tensors and containers, never code
    except Exception as err:  # missing, a folder, another format, or a pickle that would run code
        raise DataError(f"{path} is not a file saved with torch.save ({type(err).__name__})") from None
    keys = ("x_train", "y_train", "x_test", "y_test")
    need(isinstance(content, dict) and all(isinstance(content.get(k), torch.Tensor) for k in keys),
         f"{path} must hold a dict of the tensors {', '.join(keys)}")
    x_train, y_train, x_test, y_test = (content[k] for k in keys)
    for s, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):  # each check once those above pass
        need(x.layout == y.layout == torch.strided, f"{path}: x_{s} and y_{s} must be dense (save them .to_dense())")
        need(x.dim() in (2, 4) and len(x) > 0 and x[0].numel() > 0, f"{path}: x_{s} must be [N, C, H, W] or [N, D]")
        need(x.shape[1:] == x_train.shape[1:], f"{path}: x_{s} must be shaped as x_train")
        need(y.shape == (len(x),) and not (y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool),
             f"{path}: y_{s} must hold one integer label a row of x_{s}")
        need(x.dtype == torch.uint8 or x.dtype.is_floating_point and 0 <= x.min() <= x.max() <= 1,
             f"{path}: x_{s} must be uint8, or float in [0, 1] (no NaN)")
        need(torch.equal(k := y_train.unique(), torch.arange(len(k))) and 0 <= y.min() and y.max() < len(k),
             f"{path}: the labels must be 0..K-1, each in y_train, and y_{s}'s among them")
    return tuple(t.long() if t.dim() == 1 else t.detach() if t.dim() == 4 else t.detach()[:, None, None] for t in
                 (x_train, y_train, x_test, y_test))  # x [N, D] as [N, 1, 1, D]; detached, as grads break training
LOADERS = {"mnist": lambda root: (*load_mnist_subset(), None, None), "fashion-mnist": load_fashion_mnist,
           "cifar10": load_cifar10}  # each: raw images [N, C, H, W] (uint8 or float in [0, 1]), labels; train, test
DATASETS = list(LOADERS)

def make_tasks(dataset, seed, n_per_class=100, scenario="cil", classes_per_task=2, data_root="data"):
    """Tasks (Sec. 5, App. C): a seeded class order, then per class a seeded permutation whose first `n_per_class`
    (None: all) train. Pixels: [0, 1] less the training mean: [-1, 1], as Eq. 5's prior assumes. 4th: unused classes."""
    x_train, y_train, x_test, y_test = LOADERS[dataset](data_root) if dataset in LOADERS else load_tensor_file(dataset)
    generator, classes, one_pool = torch.Generator().manual_seed(seed), torch.unique(y_train), x_test is None
    need((n_tasks := len(classes) // classes_per_task) >= 2, f"{dataset} has {len(classes)} class(es): too few for "
         f"two tasks of {classes_per_task}")
    need(not one_pool or n_per_class is not None, f"{dataset} has no test split, so it cannot train on all images")
    class_order = classes[torch.randperm(len(classes), generator=generator)][:n_tasks * classes_per_task].tolist()
    picks = [(r := (y_train == c).nonzero()[:, 0])[torch.randperm(len(r), generator=generator)] for c in class_order]
    n, c = min(zip(map(len, picks), class_order))  # the smallest class
    need(n_per_class is None or n >= n_per_class + one_pool, f"class {c} has only {n} training images, fewer than "
         f"--n-per-class {n_per_class}" + " and one to test on" * one_pool)
    if one_pool:  # no test split: the images not drawn for training are the test set
        x_test, y_test = (t[torch.cat([p[n_per_class:] for p in picks])] for t in (x_train, y_train))
    keep = torch.cat([p[:n_per_class] for p in picks])
    scaled = lambda x: x.float() / 255 if x.dtype == torch.uint8 else x.float()
    mean_image = (x_train := scaled(x_train[keep])).mean(0)
    return (split_into_tasks(x_train - mean_image, y_train[keep], scaled(x_test) - mean_image, y_test, class_order,
            classes_per_task, scenario), class_order, mean_image, sorted(set(classes.tolist()) - set(class_order)))

def split_into_tasks(x_train, y_train, x_test, y_test, class_order, classes_per_task, scenario):
    """Cut the class order into tasks of k classes and relabel (Sec. 5). CIL: a class's label is its place in the class
    order (task 2 owns k..2k-1), so the head grows by k outputs a task; DIL: each task is 0..k-1, one head of k."""
    tasks = []
    for start in range(0, len(class_order), classes_per_task):
        classes = class_order[start:start + classes_per_task]
        label = {c: (start if scenario == "cil" else 0) + j for j, c in enumerate(classes)}
        pick = lambda x, y: (x[m := torch.isin(y, torch.tensor(classes))], torch.tensor([label[int(c)] for c in y[m]]))
        tasks.append(Task(classes, *pick(x_train, y_train), *pick(x_test, y_test)))
    return tasks

def validation_split(tasks, fraction=0.2, seed=0):
    """For tuning (tools/tune.py): each task tests on a held-out `fraction` of its training images, not its test set."""
    generator, split = torch.Generator().manual_seed(seed), []
    for classes, x, y, _, _ in tasks:  # one permutation per task from one generator
        order = torch.randperm(len(x), generator=generator).to(x.device)
        need((n_val := max(1, round(fraction * len(x)))) < len(x), f"{len(x)} images cannot spare {n_val} to validate")
        split.append(Task(classes, x[order[n_val:]], y[order[n_val:]], x[order[:n_val]], y[order[:n_val]]))
    return split

@functools.lru_cache(maxsize=2)  # the variants of a seed, and run_all's list, load the data once
def load_tasks(dataset, seed, n_per_class, scenario, classes_per_task, data_root, validation):
    """make_tasks, with `validation` each task's held-out fifth as its test set; every class of every task checked to
    have images of both."""
    tasks, *rest = make_tasks(dataset, seed, n_per_class, scenario, classes_per_task, data_root)
    tasks = validation_split(tasks, 0.2, seed) if validation else tasks
    for t, task in enumerate(tasks):
        for label, c in enumerate(task.classes):
            own = label if scenario == "dil" else label + t * len(task.classes)
            for name, y in (("training", task.y_train), ("validation" if validation else "test", task.y_test)):
                need((y == own).any(), f"{dataset}: class {c} of task {t + 1} has no {name} images" + (
                    " left: --validation holds out a fifth; give a larger --n-per-class" if validation else ""))
    return tasks, *rest

def tasks_of(cfg):
    """A run's tasks (of its validation split with cfg.validation), class order, mean image, classes left out."""
    return load_tasks(cfg.dataset, cfg.seed, cfg.n_per_class, cfg.scenario, cfg.classes_per_task, cfg.data_root,
                      cfg.validation)

def loader(x, y, batch_size, shuffle=True, seed=0):  # a seeded generator of its own: a seed repeats the batch order
    dataset, generator = torch.utils.data.TensorDataset(x, y), torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)

# --- The files a run writes ---
def check_writable(folder):
    """The results folder, or the nearest one above it that exists, takes a file (nothing is made here)."""
    folder = Path(folder)
    need(folder.is_dir() or not folder.exists(), f"--out {folder} is a file; it must name a folder")
    there = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    try:
        tempfile.TemporaryFile(dir=there).close()  # a file with no name, gone once closed
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
    (path := Path(path)).parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(tmp, path)

@functools.cache  # a dataset file is hashed once per process
def file_sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

def digest(cfg):
    """Eight hex digits that change with any setting of the run but its seed; a .pt counts by its contents."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("seed", "device", "data_root", "set_by")}
    if cfg.dataset.endswith(".pt") and Path(cfg.dataset).is_file():
        settings["dataset"] = f"sha256:{file_sha256(cfg.dataset)}"
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]

def variant_name(method, variant, budget=None):
    """finetune, finetune+recl, finetune+inversion, ...; the method alone at +ReCL's budget: finetune@recl-budget."""
    return method + ("@recl-budget" if budget == "recl" else "") if variant == "base" else f"{method}+{variant}"

def run_name(cfg):
    """DATASET-SCENARIO-ARM[-TUNING][-validation]."""
    dataset = Path(cfg.dataset).stem if cfg.dataset.endswith(".pt") else cfg.dataset
    return (f"{dataset}-{cfg.scenario}-{variant_name(cfg.method, cfg.variant, cfg.budget)}"
            + ("" if cfg.tuning in (None, "naive") else f"-{cfg.tuning}") + "-validation" * cfg.validation)

def result_path(out, cfg):
    """out/RUN-DIGEST-seedS.json: one file per config and seed."""
    return Path(out) / f"{run_name(cfg)}-{digest(cfg)}-seed{cfg.seed}.json"
