"""Shared helpers and fixtures of test_recl.py: tiny tasks, a run's Config as the command line
would make it, and the machinery that runs the slow subprocess tests in the background."""
import dataclasses
import gzip
import os
import subprocess
import sys
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cli
import config
import data
import models
import recl

HERE = Path(__file__).resolve().parent
QUIET = lambda *a: None

# The tests of the command line and of run_all.sh spend their time in the processes they
# start, most of it importing torch, and what those do depends on nothing the other tests
# do. So those marked @in_background(prepare) start theirs with the first test, one at a
# time, while the rest run here on one thread: a core each (two threads here beside a
# process there would wait on each other). Each gets what its processes gave as the
# fixture `started` and checks it as before; selected alone (-k), a test starts only its own.
torch.set_num_threads(1)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # for a process that computes, started from here
BACKGROUND = {}  # test name -> prepare


def in_background(prepare):
    """Mark a test whose processes run in the background: prepare(folder) readies the test's
    own empty folder before the first test runs (so no test's monkeypatch is active), and
    returns what to run in the background; the test's `started` is (what that returned, folder)."""
    def mark(test):
        arguments = test.__code__.co_varnames[:test.__code__.co_argcount]
        assert "started" in arguments, f"{test.__name__} must take `started`"
        BACKGROUND[test.__name__] = prepare
        return test
    return mark


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    selected = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    pool, started = ThreadPoolExecutor(max_workers=1), {}
    for name, prepare in BACKGROUND.items():
        if name in selected:
            folder = tmp_path_factory.mktemp(name[5:35])
            try:
                started[name] = folder, pool.submit(prepare(folder))
            except Exception as err:  # the test that owns it fails, not the module
                started[name] = folder, Future()
                started[name][1].set_exception(err)
    yield started
    pool.shutdown(cancel_futures=True)


@pytest.fixture
def started(request, background):
    folder, outcome = background[request.node.originalname]
    return outcome.result(timeout=600), folder  # a hung process fails its test, not the suite


def run_config(variant="recl", **overrides):
    """A run's Config as config.resolve makes it, with `overrides` standing for flags given on
    the command line (lr 0.05 and 20 epochs unless given; float32 on the CPU, so that every
    CPU gives the same numbers). rec_objective="inversion" makes it the inversion variant."""
    args = cli.make_parser().parse_args([])
    args.device, args.lr, args.epochs, args.hp = "cpu", 0.05, 20, {}
    if overrides.get("rec_objective") == "inversion":
        variant = "inversion"
    if variant != "base":
        args.rec_precision = "float32"
    for k, v in overrides.items():
        setattr(args, k, v)
    return config.resolve(args, args.seed, variant)


def resolved(*flags, variant="recl", seed=0):
    """The Config of one run of a command line, checked as cli.main checks it."""
    args = cli.make_parser().parse_args(list(flags))
    cli.check(args, probe_out=False)
    return config.resolve(args, seed, variant)


def displaced(model, size=0.1):
    """`model` as if trained: every weight moved by N(0, size^2), a displacement to reconstruct from."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(size * torch.randn_like(p))
    return model


def small_batch_norm_net():
    """Two convolutions, each followed by batch norm, then a head: a stand-in for ResNet18."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, bias=False),
                         nn.BatchNorm2d(4, momentum=None), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


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
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert F.cross_entropy(model(x), y).item() < 1e-3
    return model, x


def loss_terms(model, cfg, labels, x, lam, fixed=None):
    """The terms Step 1 minimises for this run's config (its departures or the control)."""
    net = models.with_smooth_relu(model, cfg.alpha).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    fixed = torch.zeros(len(labels), dtype=torch.bool) if fixed is None else fixed
    L_full, _ = recl.full_loss(model, net, params, labels, x.detach(), lam.detach(), fixed, cfg, recl.extensions(cfg))
    return L_full(x, lam)


def step1(model, labels, input_shape, cfg, log=QUIET):
    """recl.reconstruct with the run's departures (or the control): candidates, lambdas, report."""
    return recl.reconstruct(model, labels, input_shape, cfg, log, recl.extensions(cfg))


def initial_candidates(m, input_shape, sigma_x, seed):
    """The paper's start (recl.random_start) for m candidates: x ~ N(0, sigma_x^2 I), lambda ~ U(0, 1)."""
    cfg = types.SimpleNamespace(sigma_x=sigma_x, seed=seed)
    x, lam, fixed = recl.random_start(torch.zeros(m, dtype=torch.long), input_shape, cfg)
    assert not fixed.any()
    return x, lam


def train(model, x, y, cfg, hooks=None, n_replayed=0, n_old_classes=0):
    """Step 2 (recl.train_task) with the run's departures on their points."""
    return recl.train_task(model, x, y, hooks or {}, {}, cfg, n_replayed, n_old_classes, recl.extensions(cfg))


def with_loss(loss):
    """Extensions whose L_full is `loss(x, lam)` -> terms, every other point the paper's."""
    return recl.Extensions(loss=lambda *args: loss)


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
    """For each reference image, the cosine similarity of its nearest candidate."""
    a = F.normalize(candidates.flatten(1), dim=1)
    b = F.normalize(reference.flatten(1), dim=1)
    return (b @ a.T).amax(1)


def fake_record(method, variant, seed, acc, bwt, scenario="cil", **settings):
    """A run record as cli.main writes one, with the numbers given."""
    cfg = config.Config(method=method, variant=variant, scenario=scenario, seed=seed, **settings)
    return {"method": method, "variant": variant, "recl": variant != "base", "scenario": scenario,
            "dataset": "mnist", "seed": seed, "ACC": acc, "BWT": bwt, "seconds": 10.0, "diverged": None,
            "acc_matrix": [[acc]], "reconstructions": [], "recon_quality": [], "failed_reconstructions": 0,
            "phase_seconds": {"reconstruct": 0.0}, "config": dataclasses.asdict(cfg), "digest": config.digest(cfg)}


def OFFLINE(root=None, **kwargs):
    """A download without a network, as torchvision's fails: it makes its folders first."""
    if root is not None:
        (Path(root) / "raw").mkdir(parents=True)
    raise OSError("no network")


GOOD_PT = {"x_train": torch.rand(4, 3), "y_train": torch.arange(4), "x_test": torch.rand(4, 3), "y_test": torch.arange(4)}
from_pt = lambda path: data.make_tasks(str(path), 0, n_per_class=1)  # a .pt's tasks, one image per class


def write_idx(folder, n_train, n_test, g):
    """MNIST's four IDX files (random images, labels 0-9 in turn) in `folder`."""
    folder.mkdir(parents=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind, tensor in (("images-idx3", torch.randint(0, 256, (n, 28, 28), generator=g)),
                             ("labels-idx1", torch.arange(n) % 10)):
            header = bytes([0, 0, 8, tensor.dim()]) + b"".join(k.to_bytes(4, "big") for k in tensor.shape)
            (folder / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + tensor.to(torch.uint8).numpy().tobytes()))


def knowing_python(folder, then=f'exec {sys.executable} "$@"'):
    """A stand-in for python that names the methods and datasets as run_all.sh asks (`python -c ...`)
    without importing torch, and does `then` with anything else."""
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "knowing-python"
    fake.write_text(f'#!/bin/bash\nif [ "$1" = -c ]; then echo "{",".join(config.METHODS)} {",".join(data.DATASETS)}"; '
                    f'exit 0; fi\n{then}\n')
    fake.chmod(0o755)
    return str(fake)


def run_all_dry(tmp_path, *args, python=None, **knobs):
    """run_all.sh with DRY_RUN=1 in `tmp_path`: its result and the run lines it printed. Unless
    another `python` is given, the lists of methods and datasets come from knowing_python."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": python or knowing_python(tmp_path), "DRY_RUN": "1", "SCENARIOS": "cil",
           **knobs}
    result = subprocess.run(["bash", str(HERE / "run_all.sh"), *args], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    return result, [line for line in result.stdout.splitlines() if "recl.py" in line or "experiments.py" in line]


# The work of four run_all.sh tests: your own data and bad flags (run here), and in the background a list run
# through xargs, and DRY_RUN's plans and checks.

OWN = dict(x_train=torch.rand(60, 12), y_train=torch.arange(60) % 6, x_test=torch.rand(18, 12), y_test=torch.arange(18) % 6)


def run_all_own_data_and_bad_flags(folder):
    torch.save(OWN, folder / "x.pt")
    (folder / "else where").mkdir()  # a folder with a space, like many a user's
    torch.save(OWN, folder / "else where" / "x.pt")
    run = lambda *args, **knobs: run_all_dry(folder / "else where", *args, METHODS="finetune", SEEDS="1", **knobs)
    return lambda: [run("--classes-per-task", "3", "--n-per-class", "5", DATASETS="x.pt", VARIANTS="base", RESULTS="out"),
                    run("--ce-scope=local", VARIANTS="base recl"), run(DATASETS="missing.pt"), run("--bogus", "3"),
                    run(SWEEP="m -1 abc"), run(RESULTS=str(folder / "x.pt"))]


def run_all_then_the_same_list_through_xargs(folder):
    env = dict(PATH=os.environ["PATH"], PYTHON=knowing_python(folder), OMP_NUM_THREADS="1", METHODS="finetune", SCENARIOS="cil",
               SEEDS="1", VARIANTS="base recl")
    run_all = lambda out, **knobs: subprocess.run(["bash", str(HERE / "run_all.sh"), "--epochs", "1", "--n-per-class",
                                                   "5", "--n-rec", "2"], capture_output=True, text=True, cwd=HERE,
                                                  env={**env, "RESULTS": str(folder / out), **knobs})
    def both():
        whole, listed = run_all("run_all", DEVICES="0"), run_all("xargs", DRY_RUN="1")
        (folder / "runs.txt").write_text(listed.stdout)
        recipe = next(line for line in (HERE / "docs/running.md").read_text().splitlines()
                      if "xargs -P" in line and "< runs.txt" in line)
        return whole, listed, subprocess.run(recipe.split("#")[0].replace("runs.txt", str(folder / "runs.txt")),
                                             shell=True, cwd=HERE, capture_output=True, text=True,
                                             env={**os.environ, **env})  # as docs/running.md says
    return both


finished_run_flags = lambda folder: ["--dataset", "mnist", "--scenario", "cil", "--method", "finetune", "--out",
                                     str(folder), "--epochs", "3", "--seed", "0"]


def run_all_dry_runs(folder):
    """run_all.sh's plans (DRY_RUN=1) beside a finished run and a finished run of a sweep, and for the shipped table."""
    done = config.result_path(folder, resolved(*finished_run_flags(folder), variant="base"))
    cli.write_json_atomically(done, fake_record("finetune", "base", 0, 1, 1))
    finished = resolved("--method", "finetune", "--m", "25")
    cli.write_json_atomically(config.result_path(folder / "m-25", finished), fake_record("finetune", "recl", 0, 1, 1))
    dry = lambda *args, **knobs: run_all_dry(folder, *args, RESULTS=str(folder), **knobs)
    return lambda: dict(
        beside=dry("--epochs", "3", SEEDS="2", METHODS="finetune gpm", DATASETS="mnist cifar10", DATA_ROOT=str(folder)),
        shipped=run_all_dry(HERE, "--rec-precision", "float32", SCENARIOS="cil dil", python=knowing_python(folder),
                            RESULTS=str(HERE / "docs/runs/table")),
        quick=dry("--epochs", "9", "--n-rec", "7", QUICK="1", SEEDS="3", METHODS="finetune"),
        quick_sweep=dry(QUICK="1", SWEEP="epochs 1 2", METHODS="finetune"), joint=dry(METHODS="finetune joint", SEEDS="2"),
        sweep=dry("--n-rec", "100", SWEEP="m 10 25", METHODS="finetune", SEEDS="1", VARIANTS="base recl"),
        tune=run_all_dry(folder, TUNE="1", METHODS="ewc gpm", SEEDS="5", DATASETS="mnist cifar10",
                         DATA_ROOT=str(folder)),  # the default folder
        failing=(subprocess.run(["bash", str(HERE / "run_all.sh"), "--hp", "ewc_lambda=5", "--epochs", "1", "--n-per-class",
                                 "5"], capture_output=True, text=True, cwd=HERE, env={
            "PATH": "/usr/bin:/bin", "PYTHON": knowing_python(folder), "SCENARIOS": "cil", "METHODS": "finetune ewc",
            "VARIANTS": "base", "SEEDS": "1", "RESULTS": str(folder / "real"), "OMP_NUM_THREADS": "1"}), None))
