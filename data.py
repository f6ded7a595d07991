"""Data for continual learning: load images, split them into tasks.

Everything lives in memory as tensors. A task is a `Task` (its classes plus
train and test tensors); loaders are plain DataLoaders over TensorDatasets.

The offline default is SplitMNIST built from `data/mnist_5k.csv.gz`, 5,000 real
MNIST images (500 per digit) shipped with the project.
"""
import gzip
import hashlib
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, TensorDataset

MNIST_SUBSET = Path(__file__).resolve().parent / "data" / "mnist_5k.csv.gz"
MNIST_SUBSET_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"


class DataError(Exception):
    """A dataset is missing, corrupt or too small; the CLI prints it as one line."""


class Task(NamedTuple):
    classes: list          # original class ids, in task order
    x_train: torch.Tensor  # [n, C, H, W], normalised
    y_train: torch.Tensor  # labels as the model sees them (see `split_into_tasks`)
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_mnist_subset(path=MNIST_SUBSET):
    """The shipped CSV: one image per line, 784 pixels (0-255) then the label.

    Returns uint8 images [N, 1, 28, 28] and int64 labels [N].
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"MNIST subset not found at {path}; it ships with the project "
                        f"(data/mnist_5k.csv.gz), restore it with `git checkout -- data`")
    raw = path.read_bytes()
    if path == MNIST_SUBSET and hashlib.sha256(raw).hexdigest() != MNIST_SUBSET_SHA256:
        raise DataError(f"{path} is corrupt (sha256 mismatch); restore it with `git checkout -- data`")
    try:
        rows = gzip.decompress(raw).decode().split()
        values = torch.tensor([int(v) for row in rows for v in row.split(",")])
        table = values.view(len(rows), 785)
    except (OSError, EOFError, ValueError, RuntimeError) as err:
        raise DataError(f"{path} is not a gzip CSV of 785 integers per line ({err})") from None
    images, labels = table[:, :784], table[:, 784]
    if images.min() < 0 or images.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{path} has pixel values outside 0-255 or labels outside 0-9")
    return images.to(torch.uint8).view(-1, 1, 28, 28), labels


def take_per_class(labels, classes, n, generator):
    """Random indices of `n` images per class, and of all the others of those classes."""
    chosen, rest = [], []
    for c in classes:
        idx = (labels == c).nonzero().squeeze(1)
        if len(idx) <= n:
            raise DataError(f"class {c} has {len(idx)} images; {n} per class for training "
                            f"leaves none to test on")
        idx = idx[torch.randperm(len(idx), generator=generator)]
        chosen.append(idx[:n])
        rest.append(idx[n:])
    return torch.cat(chosen), torch.cat(rest)


def split_into_tasks(x_train, y_train, x_test, y_test, class_order, classes_per_task, scenario):
    """Cut the class order into tasks and relabel.

    CIL: a class's label is its position in the class order (task 1 owns 0..k-1,
    task 2 owns k..2k-1, ...), so the head grows by k outputs per task.
    DIL: every task is relabelled to 0..k-1 and one head of k outputs is shared.
    """
    tasks = []
    for start in range(0, len(class_order), classes_per_task):
        classes = class_order[start:start + classes_per_task]

        def select(x, y):
            mask = torch.isin(y, torch.tensor(classes))
            position = {c: (start if scenario == "cil" else 0) + j for j, c in enumerate(classes)}
            return x[mask], torch.tensor([position[int(c)] for c in y[mask]])

        tasks.append(Task(classes, *select(x_train, y_train), *select(x_test, y_test)))
    return tasks


def split_mnist(seed, n_per_class=100, scenario="cil", classes_per_task=2, path=MNIST_SUBSET):
    """SplitMNIST from the shipped subset, as in the paper (Sec. 5, App. D).

    Per seed: shuffle the class order, take `n_per_class` training images per
    class, test on the held-out images of the same classes. Pixels are scaled to
    [0, 1] and the training mean image is subtracted, so values lie in [-1, 1],
    the range the reconstruction prior (Eq. 5) assumes.
    """
    images, labels = load_mnist_subset(path)
    generator = torch.Generator().manual_seed(seed)
    class_order = torch.randperm(10, generator=generator).tolist()
    train_idx, test_idx = take_per_class(labels, class_order, n_per_class, generator)
    x = images.float() / 255
    mean_image = x[train_idx].mean(0)
    x = x - mean_image
    tasks = split_into_tasks(x[train_idx], labels[train_idx], x[test_idx], labels[test_idx],
                             class_order, classes_per_task, scenario)
    return tasks, class_order, mean_image


def loader(x, y, batch_size, shuffle=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=generator)
