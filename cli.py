"""recl.py's command line: its flags, their checks, and the one-line errors.

Every flag is a knob of recl.run_settings (recl.py part 5), which resolves the
ones left out; check_args rejects values that make no sense before any work
starts, so bad input ends in one line, not a traceback. Also here: how results
are written (atomically, so an interrupted run never leaves half a file),
what is recorded about the machine that made them, and which number format
`--rec-precision auto` picks on it.
"""
import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

import data
import models
import strategies

METHODS = list(strategies.STRATEGIES) + ["joint"]


def images_per_class(text):
    return None if text == "all" else int(text)


class UsageError(Exception):
    """Bad command-line input; printed as one line."""


class RunFailed(Exception):
    """A run finished without usable numbers (it diverged); printed as one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


class HelpWithDefaults(argparse.HelpFormatter):
    """Add "(default: ...)" to a flag's help unless the help already says what happens without it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def method_hyperparameter(text):
    key, sep, value = text.partition("=")
    try:
        return key, float(value) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


def make_parser():
    p = Parser(description="Train a continual-learning method with and without ReCL (reconstruction of old "
                           "data from the model) on a stream of tasks, and report ACC and BWT. "
                           "Default: SplitMNIST from the shipped MNIST subset.", formatter_class=HelpWithDefaults)
    p.add_argument("--scenario", choices=["cil", "dil"], default="cil",
                   help="class-incremental (a growing head) or domain-incremental (the same labels every task)")
    p.add_argument("--method", choices=METHODS, default="finetune", help="the continual-learning method")
    p.add_argument("--variant", choices=["both", "base", "recl"], default="both",
                   help="the method alone, with ReCL, or both on the same seeds")
    p.add_argument("--dataset", default="mnist", help=f"one of {', '.join(data.DATASETS)}, or a .pt file")
    p.add_argument("--data-root", default="data", help="where mnist-full, cifar10, tinyimagenet live")
    p.add_argument("--classes-per-task", type=int, default=None, help="default: 2; 20 for tinyimagenet")
    p.add_argument("--model", choices=models.MODELS, default="mlp",
                   help="the paper's homogeneous MLP or CNN, or a non-homogeneous AlexNet/ResNet18")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds, each its own class order and init")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=None,
                   help="epochs per task (default: the method's strategies.TUNED, the +ReCL variant's TUNED_RECL)")
    g.add_argument("--lr", type=float, default=None,
                   help="SGD learning rate (default: the method's strategies.TUNED, the +ReCL variant's TUNED_RECL)")
    g.add_argument("--batch-size", type=int, default=64, help="training batch size")
    g.add_argument("--n-per-class", type=images_per_class, default=100, help="training images per class, or 'all'")
    g.add_argument("--validation", action="store_true",
                   help="score on 20%% of each task's training images, held out, not on the test set")
    g = p.add_argument_group("reconstruction")
    g.add_argument("--m", type=int, default=None,
                   help="candidates per old class (default: --n-per-class, or 100 with all; in DIL per class and old task)")
    g.add_argument("--n-rec", type=int, default=100, help="reconstruction steps before each task")
    g.add_argument("--sigma-x", type=float, default=1e-3, help="std of the initial random candidates")
    g.add_argument("--rec-objective", choices=["stationarity", "inversion"], default="stationarity",
                   help="Eq. 3-6, or plain model inversion (the control)")
    g.add_argument("--ce-weight", type=float, default=None,
                   help="weight of inversion's cross-entropy added to Eq. 6 (default: 0.0003 in CIL, else 0)")
    g.add_argument("--lr-x", type=float, default=None,
                   help="step size for the candidates (default: 3 for the displacement target, 1 for the weights, "
                        "0.003 (CIL) and 0.3 (DIL) for inversion)")
    g.add_argument("--rec-target", choices=["weights", "displacement"], default=None,
                   help="fit theta (Eq. 3 as written) or theta - theta_0 (default: displacement)")
    g.add_argument("--freeze-old", action=argparse.BooleanOptionalAction, default=None,
                   help="classes reconstructed before keep their candidates, fixed (default: on)")
    g.add_argument("--filter", action=argparse.BooleanOptionalAction, default=None,
                   help="train only on candidates the model classifies as their label (default: on)")
    g.add_argument("--replay-noise", type=float, default=None,
                   help="std of the fresh noise on replayed reconstructions, in pixel stds of the task "
                        "(default: 2.5, 0 for GPM)")
    g.add_argument("--paper", action="store_true",
                   help="the paper as written: Eq. 3 on the weights, every class afresh, no filter, no replay "
                        "noise, no cross-entropy term, the method's own training budget; explicit flags win")
    g.add_argument("--rec-precision", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="number format of the reconstruction's products (auto: bfloat16 where the CPU has it)")
    g.add_argument("--lr-lambda", type=float, default=0.1, help="step size for the coefficients lambda_i")
    g.add_argument("--lambda-min", type=float, default=0.05, help="Eq. 4 pushes each lambda_i above this")
    g.add_argument("--alpha", type=float, default=100.0, help="sharpness of the smooth ReLU backward")
    g.add_argument("--tuning", choices=["naive", "unsup", "sup"], default="naive",
                   help="the run's values, or a search per task scored by the final L_full (unsup) or by "
                        "SSIM to a few stored real images (sup) (Sec. 4.3)")
    g.add_argument("--trials", type=int, default=10,
                   help="random-search trials (per task for --tuning; draws for experiments.py tune)")
    g.add_argument("--save-images", action="store_true",
                   help="per task, a PNG of real images over their nearest reconstructions, and a .pt of them")
    p.add_argument("--hp", type=method_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
                   help="a method hyperparameter, e.g. --hp ewc_lambda=1000 (default: strategies.TUNED)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when present")
    p.add_argument("--out", default="results", help="folder for one JSON file per run")
    p.add_argument("--quiet", action="store_true", help="print only one line per finished run")
    return p


def check_args(cfg):
    """Reject values that make no sense before any work starts."""
    positive = {"batch-size": cfg.batch_size, "n-rec": cfg.n_rec, "sigma-x": cfg.sigma_x,
                "lr-lambda": cfg.lr_lambda, "lambda-min": cfg.lambda_min,
                "alpha": cfg.alpha, "seeds": cfg.seeds, "trials": cfg.trials}
    optional = {"epochs": cfg.epochs, "lr": cfg.lr, "lr-x": cfg.lr_x, "m": cfg.m, "n-per-class": cfg.n_per_class,
                "classes-per-task": cfg.classes_per_task}
    for flag, value in optional.items():
        if value is not None:
            positive[flag] = value
    for flag, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{flag} must be a positive finite number, got {value}")
    known = strategies.HYPERPARAMETERS[cfg.method]
    for key, value in cfg.hp:
        if key not in known:
            raise UsageError(f"--hp {key}: {cfg.method} has {', '.join(known) or 'no hyperparameters'}")
        if value is None or not math.isfinite(value):
            raise UsageError(f"--hp {key} needs a finite number, like --hp {key}={known[key]}")
    cfg.hp = {key: type(known[key])(value) for key, value in cfg.hp}
    if cfg.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {cfg.seed}")
    for flag, value in (("replay-noise", cfg.replay_noise), ("ce-weight", cfg.ce_weight)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{flag} must be a finite number >= 0, got {value}")
    if cfg.ce_weight and cfg.rec_objective == "inversion":
        raise UsageError("--ce-weight adds inversion's cross-entropy to Eq. 6; with --rec-objective inversion "
                         "it would do nothing")
    if cfg.dataset not in data.DATASETS and not cfg.dataset.endswith(".pt"):
        raise UsageError(f"--dataset must be one of {', '.join(data.DATASETS)} or a .pt file, got {cfg.dataset!r}")
    most = data.MNIST_SUBSET_PER_CLASS - 1  # keep at least one test image
    if cfg.dataset == "mnist" and (cfg.n_per_class or most + 1) > most:
        raise UsageError(f"--n-per-class {cfg.n_per_class or 'all'} is more than mnist allows "
                         f"({most}; it holds {most + 1} images per class and needs some to test on)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available")


def provenance():
    """What made a result, beyond its config: code version, library, machine."""
    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(commit) and bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                     cwd=here, capture_output=True, text=True,
                                                     timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"commit": commit, "uncommitted_changes": dirty, "torch": torch.__version__, "device": device,
            "threads": torch.get_num_threads(), "python": sys.version.split()[0]}


def write_atomically(path, text):
    """Write to a temporary name, then rename: a killed run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomically(path, record):
    write_atomically(path, json.dumps(record, indent=1))


def run_from_command_line(main, program):
    """Run `main`; the errors a user can cause end in one line and a non-zero exit."""
    try:
        main()
    except (UsageError, RunFailed, data.DataError) as err:
        sys.exit(f"{program}: error: {err}")
    except KeyboardInterrupt:
        sys.exit(f"{program}: interrupted; finished runs are saved, rerun to redo the rest")


# The number format of the reconstruction's matrix products (`--rec-precision`).
# Under torch.autocast the products and convolutions of Eq. 3's double backward
# take bfloat16 inputs (summed in float32); the rest stays float32. The fit does
# not notice, and on a CPU with bfloat16 instructions (AVX512-BF16 or AMX) a
# step takes 1.6 to 2.4 times less (docs/cost.md). `auto` uses it only there:
# other CPUs would emulate it, and on a GPU it is unmeasured. Training is
# always float32.

def reconstruction_precision(choice, device):
    """'float32' or 'bfloat16' for `--rec-precision` choice ('auto' or either) on `device`."""
    if choice != "auto":
        return choice
    capabilities = torch.cpu.get_capabilities() if device.type == "cpu" else {}
    native = capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")
    return "bfloat16" if native else "float32"
