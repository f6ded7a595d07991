"""Shared helpers of test_recl.py: a run's Config as the command line makes it, tiny tasks,
and the small reconstruction problems the tests take apart."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import config
import data
import models
import recl

HERE = Path(__file__).resolve().parent
QUIET = lambda *a: None
torch.set_num_threads(1)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # for a process started from here


def run_config(variant="recl", *flags, **overrides):
    """A run's Config as config.resolve makes it from `flags`, then `overrides` as if given on the
    command line (lr 0.05, 20 epochs and the CPU unless given)."""
    args = config.make_parser().parse_args(list(flags))
    args.device, args.lr, args.epochs, args.hp = "cpu", 0.05, 20, dict(args.hp)
    if overrides.get("rec_objective") == "inversion":
        variant = "inversion"
    for k, v in overrides.items():
        setattr(args, k, v)
    return config.resolve(args, args.seed, variant)


def resolved(*flags, variant="recl", seed=0):
    """The Config of one run of a command line, checked as recl.main checks it."""
    args = config.make_parser().parse_args(list(flags))
    config.check(args, probe_out=False)
    return config.resolve(args, seed, variant)


def step1(model, labels, input_shape, cfg, log=QUIET, last=None):
    """recl.step1 after one old task of `input_shape` images, m candidates per class of `labels`."""
    n_classes = int(labels.max()) + 1
    task = data.Task(list(range(n_classes)), torch.zeros(1, *input_shape), None, None, None)
    cfg = dataclasses.replace(cfg, m=len(labels) // n_classes, scenario="cil")
    x, y, lam, report = recl.step1(model, [task], cfg, last, log)
    assert torch.equal(y, labels)
    return x, lam, report


def train(model, x, y, cfg, hooks=None, n_replayed=0, n_old_classes=0):
    """Step 2 (recl.step2, recl.train_task) on rows x whose last `n_replayed` are reconstructions."""
    own = len(x) - n_replayed
    task = data.Task(None, x[:own], y[:own], None, None)
    batches, loss_of, _ = recl.step2(task, x[own:], y[own:], cfg, n_old_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    return recl.train_task(model, batches, loss_of, optimizer, cfg.epochs, hooks or {}, {})


def displaced(model, size=0.1):
    """`model` as if trained: every weight moved by N(0, size^2)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(size * torch.randn_like(p))
    return model


class BatchNormNet(nn.Module):
    """Two convolutions, each followed by batch norm, then a head: a stand-in for ResNet18."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, bias=False),
                                  nn.BatchNorm2d(4, momentum=None), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.body(x))


def small_batch_norm_net():
    torch.manual_seed(0)
    return BatchNormNet()


def synthetic_tasks(scenario, n_tasks=3, per_class=6, shape=(1, 4, 4), seed=0):
    """Well-separated Gaussian blobs, two classes per task, in the layout data.py makes."""
    g = torch.Generator().manual_seed(seed)
    n_classes = 2 * n_tasks
    centres = torch.randn(n_classes, *shape, generator=g)

    def sample(n):
        y = torch.arange(n_classes).repeat_interleave(n)
        return 0.5 * centres[y] + 0.05 * torch.randn(len(y), *shape, generator=g), y
    (xtr, ytr), (xte, yte) = sample(per_class), sample(per_class)
    return data.split_into_tasks(xtr, ytr, xte, yte, list(range(n_classes)), 2, scenario)


def nearest_cosine(candidates, reference):
    """For each reference image, its cosine similarity to the nearest candidate."""
    a = torch.nn.functional.normalize(candidates.flatten(1), dim=1)
    b = torch.nn.functional.normalize(reference.flatten(1), dim=1)
    return (b @ a.T).max(1).values


def fake_record(method, variant, seed, acc, bwt, scenario="cil", **settings):
    cfg = {**dataclasses.asdict(config.Config(method=method, variant=variant, scenario=scenario)),
           "budget": None if variant == "base" else "recl", **settings}  # as resolve gives the method alone
    return {"method": method, "variant": variant, "recl": variant != "base", "scenario": scenario, "dataset": "mnist",
            "seed": seed, "acc_matrix": [[acc]], "ACC": acc, "BWT": bwt, "config": cfg, "digest": "d" * 8,
            "reconstructions": [], "recon_quality": [], "failed_reconstructions": 0, "seconds": 1.0,
            "phase_seconds": {"reconstruct": 0.0}, "diverged": None}


def command(*words, env=None, cwd=HERE, timeout=300, input=None):
    """A process's exit code, stdout and stderr."""
    done = subprocess.run([str(w) for w in words], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**ONE_THREAD, **(env or {})}, input=input)
    return done.returncode, done.stdout, done.stderr


def run_all(*flags, **knobs):
    return command("bash", HERE / "run_all.sh", *flags, env={"PYTHON": sys.executable, **knobs})


@pytest.fixture(scope="module")
def trained_on_eight_digits():
    """A small homogeneous MLP trained to convergence on 8 real MNIST digits (3s and 7s)."""
    torch.manual_seed(0)
    images, labels = data.load_mnist_subset()
    idx = torch.cat([(labels == c).nonzero()[:4, 0] for c in (3, 7)])
    x = images[idx].float() / 255
    x, y = x - x.mean(0), (labels[idx] == 7).long()
    model = models.remember_start(models.MLP(784, 2, hidden=100))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2000):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.nn.functional.cross_entropy(model(x), y).item() < 1e-3
    return model, x
