"""Data for continual learning: images as tensors in memory, split into tasks. The offline default is SplitMNIST from
`data/mnist_5k.csv.gz`, real MNIST images shipped with the project; others come from their usual on-disk formats under
a data root (downloaded there when online), or from a `.pt` file (`load_tensor_file`)."""
import gzip
import hashlib
import pickle
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, TensorDataset

MNIST_SUBSET = Path(__file__).resolve().parent / "data" / "mnist_5k.csv.gz"
MNIST_SUBSET_PER_CLASS = 500  # images per digit in the shipped subset
MNIST_SUBSET_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
_PARSED = {}  # sha256 of a CSV file -> its images and labels: parsed once per process


class DataError(Exception):
    """A dataset is missing, corrupt or too small; the CLI prints it as one line."""


class Task(NamedTuple):
    classes: list          # original class ids, in task order
    x_train: torch.Tensor  # [n, C, H, W], normalised
    y_train: torch.Tensor  # labels as the model sees them (see `split_into_tasks`)
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_mnist_subset(path=MNIST_SUBSET):
    """The shipped CSV, one image per line (784 pixels 0-255, then the label), as uint8 images
    [N, 1, 28, 28] and int64 labels [N]."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"MNIST subset not found at {path}; it ships with the project "
                        f"(data/mnist_5k.csv.gz), restore it with `git checkout -- data`")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if path == MNIST_SUBSET and digest != MNIST_SUBSET_SHA256:
        raise DataError(f"{path} is corrupt (sha256 mismatch); restore it with `git checkout -- data`")
    if digest not in _PARSED:  # a run_all.sh worker (several runs in one process) parses it once
        try:
            rows = gzip.decompress(raw).decode().split()
            values = torch.tensor([int(v) for row in rows for v in row.split(",")])
            table = values.view(len(rows), 785)
        except (OSError, EOFError, ValueError, RuntimeError) as err:
            raise DataError(f"{path} is not a gzip CSV of 785 integers per line ({err})") from None
        images, labels = table[:, :784], table[:, 784]
        if images.min() < 0 or images.max() > 255 or labels.min() < 0 or labels.max() > 9:
            raise DataError(f"{path} has pixel values outside 0-255 or labels outside 0-9")
        _PARSED[digest] = images.to(torch.uint8).view(-1, 1, 28, 28), labels
    return _PARSED[digest][0].clone(), _PARSED[digest][1].clone()


def per_class(labels, c, n, generator):
    """`n` random indices of class c (None: all of them, shuffled)."""
    idx = (labels == c).nonzero().squeeze(1)
    if n is not None and len(idx) < n:
        raise DataError(f"class {c} has only {len(idx)} training images, fewer than --n-per-class {n}")
    return idx[torch.randperm(len(idx), generator=generator)[:n]]


def take_per_class(labels, classes, n, generator):
    """From one pool: `n` random indices per class for training, the rest for testing."""
    chosen, rest = [], []
    for c in classes:
        idx = per_class(labels, c, None, generator)
        if len(idx) <= n:
            raise DataError(f"class {c} has {len(idx)} images; {n} per class for training leaves none to test on")
        chosen.append(idx[:n]), rest.append(idx[n:])
    return torch.cat(chosen), torch.cat(rest)


def split_into_tasks(x_train, y_train, x_test, y_test, class_order, classes_per_task, scenario):
    """Cut the class order into tasks and relabel. CIL: a class's label is its position in the
    class order (task 1 owns 0..k-1, task 2 k..2k-1, ...), so the head grows by k outputs per task.
    DIL: every task is relabelled to 0..k-1 and one head of k outputs is shared."""
    tasks = []
    for start in range(0, len(class_order), classes_per_task):
        classes = class_order[start:start + classes_per_task]
        def select(x, y):
            mask = torch.isin(y, torch.tensor(classes))
            position = {c: (start if scenario == "cil" else 0) + j for j, c in enumerate(classes)}
            return x[mask], torch.tensor([position[int(c)] for c in y[mask]])
        tasks.append(Task(classes, *select(x_train, y_train), *select(x_test, y_test)))
    return tasks


# --- other datasets: real on-disk formats, downloaded when the machine is online ---

IDX_STEMS = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # `apt-get install dataset-fashion-mnist`

def read_idx(path):
    """An IDX file (MNIST's format), gzipped or not, as a uint8 tensor."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file")
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(raw[3])]  # raw[3]: the dimensions
    body = raw[4 + 4 * len(shape):]
    if len(body) != torch.Size(shape).numel():
        raise DataError(f"{path} is truncated: header says {shape}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(shape)


def find_file(folder, stem):
    return next((p for p in (Path(folder) / stem, Path(folder) / (stem + ".gz")) if p.is_file()), None)


def fetch(name, root, download, explain=None):
    """Run a torchvision download, or explain in one line how to get the files by hand; a
    download that fails leaves no empty folders behind."""
    root = Path(root)
    before = set(root.rglob("*")) if root.exists() else set()
    above = [p for p in (root, *root.parents) if not p.exists()]  # root and the folders above it it would make
    try:
        download()
    except Exception as err:  # offline machines fail in many ways (DNS, refused, timeout)
        made = [p for p in (root.rglob("*") if root.exists() else []) if p.is_dir() and p not in before]
        for folder in sorted(made, key=lambda p: -len(p.parts)) + above:  # the deepest first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise DataError((explain or f"{name} is not under {root} and could not be downloaded ({{}}); on a machine with "
                         f"internet run this project once with --data-root {root}, then copy the folder here")
                        .format(type(err).__name__)) from None


def read_idx_dataset(folder):  # the four IDX_STEMS files in `folder`: 1-channel images and labels
    x_train, y_train, x_test, y_test = (read_idx(find_file(folder, s)) for s in IDX_STEMS)
    return x_train[:, None], y_train.long(), x_test[:, None], y_test.long()


def load_fashion_mnist(root):
    """Fashion-MNIST (Xiao et al. 2017), clothing in 10 classes in MNIST's IDX format, from
    torchvision's folder under `root` or the Debian/Ubuntu package's (offline)."""
    for folder in (Path(root) / "FashionMNIST" / "raw", DEBIAN_FASHION_MNIST):
        if all(find_file(folder, s) for s in IDX_STEMS):
            return read_idx_dataset(folder)
    import torchvision
    fetch("fashion-mnist", root, lambda: torchvision.datasets.FashionMNIST(root, download=True),
          f"fashion-mnist is not under {root}/FashionMNIST/raw or {DEBIAN_FASHION_MNIST} and could not be "
          f"downloaded ({{}}); install it offline with `apt-get install dataset-fashion-mnist`, or run this "
          f"project once with --data-root {root} on a machine with internet")
    return read_idx_dataset(Path(root) / "FashionMNIST" / "raw")


# CIFAR10's python batches are pickles, and a pickle may name any function to call while it loads. A crafted file
# under --data-root must not run code, so the batches are read by an unpickler that knows only the names a batch
# holds: numpy's array, its dtype and their rebuilders (old and new numpy spellings), and the codec Python 2 strings
# come back through.
PICKLE_ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
                  ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                  ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}


class RefusedPickle(Exception):
    pass


class ArraysOnly(pickle.Unpickler):
    """An unpickler for files that hold only arrays, lists, strings and bytes."""
    def find_class(self, module, name):
        if (module, name) not in PICKLE_ALLOWED:
            raise RefusedPickle(f"it asks to call {module}.{name}, which a CIFAR10 batch never does; "
                                f"refused, nothing was run")
        return super().find_class(module, name)


def load_cifar10(root):
    folder = Path(root) / "cifar-10-batches-py"
    if not folder.is_dir():
        import torchvision
        fetch("CIFAR10", root, lambda: torchvision.datasets.CIFAR10(root, download=True))
    def batches(names):
        xs, ys = [], []
        for name in names:
            try:
                with open(folder / name, "rb") as f:
                    batch = ArraysOnly(f, encoding="bytes").load()
                xs.append(torch.as_tensor(batch[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32))
                ys.append(torch.tensor(batch[b"labels"]))
            except RefusedPickle as err:
                raise DataError(f"{folder / name} is not a plain CIFAR10 batch: {err}") from None
            except (OSError, pickle.UnpicklingError, KeyError, EOFError, RuntimeError, TypeError,
                    ValueError, AttributeError) as err:
                raise DataError(f"{folder / name} is missing or not a CIFAR10 batch ({err})") from None
        return torch.cat(xs), torch.cat(ys)
    return (*batches([f"data_batch_{i}" for i in range(1, 6)]), *batches(["test_batch"]))


def load_tensor_file(path):
    """A user's dataset: torch.save({"x_train", "y_train", "x_test", "y_test"}, path), x [N, C, H, W]
    or [N, D], uint8 (0-255) or float (0-1); y integer labels 0..K-1."""
    if Path(path).is_dir():
        raise DataError(f"{path} is a folder, not a file saved with torch.save")
    try:
        content = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise DataError(f"dataset file {path} not found") from None
    except Exception as err:
        raise DataError(f"{path} is not a torch.save file of tensors ({type(err).__name__})") from None
    keys = ("x_train", "y_train", "x_test", "y_test")
    if not isinstance(content, dict) or not all(k in content for k in keys):
        have = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise DataError(f"{path} must hold a dict with keys {list(keys)}; it has {have}")
    parts = [content[k] for k in keys]
    for k, t in zip(keys, parts):
        if not isinstance(t, torch.Tensor):
            raise DataError(f"{path}: {k} is a {type(t).__name__}, not a tensor")
    for split, x, y in (("train", *parts[:2]), ("test", *parts[2:])):
        if x.dim() not in (2, 4):
            raise DataError(f"{path}: x_{split} must be [N, C, H, W] or [N, D], got shape {list(x.shape)}")
        if y.dim() != 1 or len(y) != len(x):
            raise DataError(f"{path}: y_{split} must be a 1-D tensor with one label per row of x_{split}")
        if not len(x) or not x[0].numel():
            raise DataError(f"{path}: x_{split} holds no images, or images of no pixels: shape {list(x.shape)}")
        if y.dtype.is_floating_point or y.dtype == torch.bool:
            raise DataError(f"{path}: y_{split} must hold integer labels, got {y.dtype}")
        if len(y) and y.min() < 0:
            raise DataError(f"{path}: y_{split} has negative labels")
        if split == "train" and not torch.equal(y.unique(), torch.arange(len(y.unique()))):
            raise DataError(f"{path}: y_train must use the labels 0..K-1, each at least once; "
                            f"got {y.unique().tolist()}")
        unseen = [c for c in y.unique().tolist() if c >= len(parts[1].unique())] if split == "test" else []
        if unseen:
            raise DataError(f"{path}: y_test has labels that y_train lacks: {unseen}")
        if not torch.isfinite(x.float()).all():
            raise DataError(f"{path}: x_{split} has NaN or infinite pixels")
        if x.dtype != torch.uint8 and not (x.dtype.is_floating_point and 0 <= x.min() and x.max() <= 1):
            raise DataError(f"{path}: x_{split} must be uint8 (0-255) or float in [0, 1]")
    if parts[0].shape[1:] != parts[2].shape[1:]:
        raise DataError(f"{path}: train images {list(parts[0].shape[1:])} and test images "
                        f"{list(parts[2].shape[1:])} differ in shape")
    as_images = lambda x: x if x.dim() == 4 else x[:, None, None, :]
    return as_images(parts[0]), parts[1].long(), as_images(parts[2]), parts[3].long()


LOADERS = {"fashion-mnist": load_fashion_mnist, "cifar10": load_cifar10}
DATASETS = ["mnist", *LOADERS]


def load(dataset, data_root="data"):
    """Raw images [N, C, H, W] (uint8 or float in [0, 1]) and labels; mnist has no test split."""
    if dataset == "mnist":
        return (*load_mnist_subset(), None, None)
    if dataset in LOADERS:
        return LOADERS[dataset](data_root)
    return load_tensor_file(dataset)


def make_tasks(dataset, seed, n_per_class=100, scenario="cil", classes_per_task=2, data_root="data"):
    """Split a dataset into tasks, as in the paper (Sec. 5, App. C). Per seed: shuffle the class order, take
    `n_per_class` training images per class (None: all), test on the test images of those classes (the shipped
    MNIST subset: its held-out images). Pixels are scaled to [0, 1], less the training mean image: values lie in
    [-1, 1], as the reconstruction prior (Eq. 5) assumes. Classes that fill no whole task are left out (4th value)."""
    x_train, y_train, x_test, y_test = load(dataset, data_root)
    generator = torch.Generator().manual_seed(seed)
    classes = torch.unique(y_train)
    n_tasks = len(classes) // classes_per_task
    if n_tasks < 2:
        raise DataError(f"{dataset} has {len(classes)} class{'es' * (len(classes) != 1)}: too few for two tasks of "
                        f"{classes_per_task}")
    class_order = classes[torch.randperm(len(classes), generator=generator)][:n_tasks * classes_per_task].tolist()
    if x_test is None:  # one pool: hold out what is not used for training
        if n_per_class is None:
            raise DataError(f"{dataset} has no test split, so it cannot train on all images per class")
        train_idx, test_idx = take_per_class(y_train, class_order, n_per_class, generator)
        x_train, y_train, x_test, y_test = x_train[train_idx], y_train[train_idx], x_train[test_idx], y_train[test_idx]
    else:
        keep = torch.cat([per_class(y_train, c, n_per_class, generator) for c in class_order])
        x_train, y_train = x_train[keep], y_train[keep]
    as_float = lambda x: x.float() / 255 if x.dtype == torch.uint8 else x.float()
    x_train, x_test = as_float(x_train), as_float(x_test)
    mean_image = x_train.mean(0)
    tasks = split_into_tasks(x_train - mean_image, y_train, x_test - mean_image, y_test,
                             class_order, classes_per_task, scenario)
    return tasks, class_order, mean_image, sorted(set(classes.tolist()) - set(class_order))


def validation_split(tasks, fraction=0.2, seed=0):
    """Tasks whose test set is a held-out `fraction` of their own training images, for tuning
    (tools/tune.py): the real test images are dropped, so nothing chosen here has seen them."""
    generator = torch.Generator().manual_seed(seed)
    split = []
    for task in tasks:
        order = torch.randperm(len(task.x_train), generator=generator).to(task.x_train.device)
        n_val = max(1, round(fraction * len(order)))
        if n_val >= len(order):
            raise DataError(f"a task with {len(order)} training images cannot spare {n_val} for validation")
        val, train = order[:n_val], order[n_val:]
        split.append(Task(task.classes, task.x_train[train], task.y_train[train], task.x_train[val], task.y_train[val]))
    return split


def loader(x, y, batch_size, shuffle=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=generator)
