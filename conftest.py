"""Shared helpers of test_recl.py: a run's Config as the command line makes it, tiny tasks, a small trained network,
and processes started from here."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import data
import models
import recl

HERE = Path(__file__).resolve().parent
QUIET = lambda *a: None
torch.set_num_threads(1)

def resolved(*flags, variant="recl", seed=0):
    """The Config of one run of a command line on the CPU, checked as recl.main checks it."""
    args = recl.make_parser().parse_args(["--device", "cpu", *flags])
    recl.check(args, probe_out=False)
    return recl.resolve(args, seed, variant)

def config(variant="recl", *flags, **changes):
    """resolved(*flags) for `variant`, then `changes` as they are: nothing that depends on them is looked up again."""
    return dataclasses.replace(resolved(*flags, variant=variant), **changes)

def synthetic_tasks(scenario="cil", n_tasks=3, per_class=6, shape=(1, 4, 4), seed=0):
    """Well-separated Gaussian blobs, two classes per task, in the layout data.py makes."""
    g, n_classes = torch.Generator().manual_seed(seed), 2 * n_tasks
    y, centres = torch.arange(n_classes).repeat_interleave(per_class), torch.randn(n_classes, *shape, generator=g)
    x_train, x_test = (0.5 * centres[y] + 0.05 * torch.randn(len(y), *shape, generator=g) for _ in range(2))
    return data.split_into_tasks(x_train, y, x_test, y, list(range(n_classes)), 2, scenario)

@pytest.fixture(scope="session")
def trained():
    """A small homogeneous MLP trained to a loss below 1e-3 on 8 real MNIST digits (3s and 7s, labels 0 and 1): the
    model, its weights before training (cloned apart from models.remember_start), the images and their labels."""
    torch.manual_seed(0)
    images, labels = data.load_mnist_subset()
    idx = torch.cat([(labels == c).nonzero()[:4, 0] for c in (3, 7)])
    x = images[idx].float() / 255
    x, y = x - x.mean(0), (labels[idx] == 7).long()
    model = models.remember_start(models.MLP(784, 2, hidden=100))
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2000):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert F.cross_entropy(model(x), y).item() < 1e-3
    return model.eval(), initial, x, y

def command(*words, env=None, timeout=300, input=None):
    """A process's exit code, stdout and stderr, run from the project's folder on one thread."""
    done = subprocess.run([str(w) for w in words], capture_output=True, text=True, cwd=HERE, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, input=input)
    return done.returncode, done.stdout, done.stderr

def run_all(*flags, **knobs):
    return command("bash", HERE / "run_all.sh", *flags, env={"PYTHON": sys.executable, **knobs})

def aggregate_tool():
    from tools import aggregate
    return aggregate
