"""What one run is: its config, the table of presets it comes from, and the checks.

A run is one `Config`: every value it uses, written out. It comes from three
places, in this order, and nowhere else:

    1. PRESETS below: per scenario and method, what the method alone trains
       with and what its +ReCL variant changes; NETWORKS: what a network
       changes in both (and ALONE_BUDGET: the networks whose +ReCL variant
       trains as the method alone); RECONSTRUCTION: Step 1's settings; PAPER:
       what `--paper` puts back.
    2. the flags given on the command line (a flag always wins);
    3. the machine, for `--rec-precision auto` and `--device auto` only.

`resolve` does that once, before anything trains; `check` refuses, in one line,
values out of range and flags that would do nothing for the run asked for. The
config's digest names the run's result file, so two runs that differ in any
setting never share a file or a table row (`result_path`).

Adding a method: write its hooks in strategies.py and give it one entry in
strategies.STRATEGIES (hooks, and each hyperparameter's default and valid
range; defaults are numbers); add its name to ALL_METHODS in run_all.sh, before
joint, for the full table, and its own hyperparameters' grid to
strategies.SEARCH_GRID for `tune` to search them. It then runs at
DEFAULT_TRAINING and its literature defaults; a row in PRESETS, once chosen on
validation data (`python experiments.py tune`), makes those its defaults.

Also here: the command line's flags, the one-line errors, the atomic writers
and what a result records about the machine that made it.
"""
import argparse
import dataclasses
import functools
import hashlib
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
VARIANTS = ["base", "recl", "inversion"]  # the method alone, +ReCL, +ReCL's pipeline with the inversion control

# =============================================================================
# The presets: every default of a run, in one table
# =============================================================================
# Chosen on validation splits, never the test set: the methods' own settings
# by `experiments.py tune` (docs/hyperparameters.md), the +ReCL budgets and
# Step 1's settings by the studies in docs/departures.md.
#
# The +ReCL column lists only what the +ReCL variant changes. ReCL reads the
# old data out of the weights, so it needs a network that has fitted its
# tasks: most +ReCL variants train harder than the method alone (not on AlexNet,
# ALONE_BUDGET below). GPM replays
# without noise: its projection lets a layer learn only outside the input
# space of old tasks, so noisy replay would train directions real images never use. ER scores
# its own images over all classes (departure 8 off) on any network: its memory of real images
# already teaches old against new, and on the CNN's validation split local CE cost it 2.5 points
# (docs/networks.md, "Third round").
DEFAULT_TRAINING = {"lr": 0.05, "epochs": 20}  # for a method no row below tunes

PRESETS = {
    "cil": {  # method: (the method alone, what its +ReCL variant changes)
        "finetune": ({"lr": 0.01, "epochs": 10}, {"lr": 0.1, "epochs": 20}),
        "ewc": ({"lr": 0.01, "epochs": 20, "ewc_lambda": 1000.0}, {"lr": 0.1, "ewc_lambda": 100.0}),
        "er": ({"lr": 0.05, "epochs": 20}, {"lr": 0.1, "ce_scope": "all"}),
        "upgd": ({"lr": 0.01, "epochs": 10, "upgd_beta": 0.99, "upgd_sigma": 0.001}, {"lr": 0.1, "epochs": 20}),
        "agem": ({"lr": 0.05, "epochs": 40, "agem_patterns_per_task": 100}, {"lr": 0.1, "epochs": 20}),
        "lwf": ({"lr": 0.01, "epochs": 20, "lwf_lambda": 0.5, "lwf_temperature": 4.0}, {"lr": 0.1}),
        "gpm": ({"lr": 0.01, "epochs": 20, "gpm_threshold": 0.9}, {"lr": 0.1, "replay_noise": 0.0}),
        "joint": ({"lr": 0.1, "epochs": 80}, None),
    },
    "dil": {
        "finetune": ({"lr": 0.01, "epochs": 10}, {"lr": 0.05, "epochs": 20}),
        "ewc": ({"lr": 0.01, "epochs": 20, "ewc_lambda": 10000.0}, {"lr": 0.05, "ewc_lambda": 100.0}),
        "er": ({"lr": 0.1, "epochs": 10}, {"lr": 0.05, "epochs": 20}),
        "upgd": ({"lr": 0.01, "epochs": 20, "upgd_beta": 0.99, "upgd_sigma": 0.0001}, {"lr": 0.1}),
        "agem": ({"lr": 0.05, "epochs": 40, "agem_patterns_per_task": 50}, {"lr": 0.1, "epochs": 20}),
        "lwf": ({"lr": 0.05, "epochs": 20, "lwf_lambda": 2.0, "lwf_temperature": 2.0}, {"lwf_lambda": 0.5}),
        "gpm": ({"lr": 0.1, "epochs": 20, "gpm_threshold": 0.9}, {"replay_noise": 0.0}),
        "joint": ({"lr": 0.1, "epochs": 40}, None),
    },
}

# Step 1 and the replay, for every +ReCL run (recl.py part 1 explains each).
# m None: as many candidates per class as training images per class (100 with all).
RECONSTRUCTION = {
    "m": None, "n_rec": 100, "sigma_x": 1e-3, "lr_lambda": None, "lambda_min": 0.05, "alpha": 100.0,
    "rec_target": "displacement",          # departure 1
    "freeze_old": True,                    # departure 2
    "filter": True,                        # departure 3
    "replay_noise": 2.5,                   # departure 4, in pixel stds of the task
    "ce_weight": {"cil": 3e-4, "dil": 0.0},  # departure 5; it cost ACC in DIL
    "rec_optimizer": "sgd",                # departure 6: "adam" for the conv nets (NETWORKS)
    "replay_batch": 0,                     # departure 9: 0 joins the reconstructions to the task's data
    "backtrack": False,                    # departure 11
    "rec_precision": "auto", "tuning": "naive", "trials": None,
}
# The candidates' step size depends on what their loss is: the displacement
# target's relative L_rec, Eq. 3 on the weights, or inversion's summed cross-entropy.
# Adam (departure 6) moves each pixel by about lr_x a step, whatever the loss's scale:
# one value for every objective (validated for Eq. 3 only); ResNet18 takes a tenth (NETWORKS).
LR_X = {"displacement": 3.0, "weights": 1.0, "inversion": {"cil": 0.003, "dil": 0.3}, "adam": 0.01}
# The lambdas' step size, by optimiser: SGD's 0.1 is the MLP's; under Adam each lambda moves
# about lr_lambda a step, and 0.01 is a hundredth of their U(0, 1) start (docs/networks.md).
LR_LAMBDA = {"sgd": 0.1, "adam": 0.01}

# Per network, what its runs change from the MLP's settings above: (the method alone,
# +ReCL), each a dict of Config fields, a value per scenario where it is a dict. The paper
# tunes per architecture too; these were chosen on Fashion-MNIST's validation split
# (docs/networks.md).
# The CNN's +ReCL column. Finetune+ReCL, Fashion validation, 5 seeds (docs/networks.md, "Second round"):
# a replay batch (departure 9) and, in CIL, local CE (8) and a stronger inversion term (5) lift it from
# 27.4 to 57.5, above the inversion control's 53.2 and Finetune alone's 17.7 (41.6 with CE over the new
# classes); in DIL, with less replay noise, 74.8 against Finetune alone's 72.4, within the seeds' spread.
# ce_weight 0.03 against 0.01 is a toss-up (57.5, 56.0). 20 candidates per class and 30 steps: 100
# per class at 30 steps was no better (CIL seeds 0-2 at ce_weight 0.01: 54.5 against 59.3).
CNN_RECL = {"rec_optimizer": "adam", "m": 20, "n_rec": 30, "replay_batch": 64,
            "replay_noise": {"cil": 2.5, "dil": 1.0}, "ce_scope": {"cil": "local", "dil": "all"},
            "ce_weight": {"cil": 0.03, "dil": 0.0}}
NETWORKS = {
    "mlp": ({}, {}),
    "cnn": ({}, CNN_RECL),
    # AlexNet takes the CNN's column, with backtracking (departure 11), at the method alone's training budget
    # (ALONE_BUDGET below). Finetune, DIL, validation, 5 seeds: 69.2, against 68.7 at the +ReCL budget and
    # 67.8 alone, all within the seeds' spread; at 60% of the time, and no reconstruction flagged (4 of 20
    # without backtracking). The MLP's settings were level on 2 seeds at about 8 times the time. CIL
    # (3 seeds): 36.7 against 16.8 alone; at the +ReCL budget one seed collapsed and one diverged
    # (docs/networks.md, "Fourth round").
    "alexnet": ({}, {**CNN_RECL, "backtrack": True}),
    # departure 6 at a tenth of Adam's lr_x: with SGD the lambdas' step overflowed; at lr_x 0.01
    # the fit climbed, at 0.001 it fell 4.78 -> 1.20 (one reconstruction, docs/networks.md). Chosen at
    # 20 images per class (validation, DIL, 2 seeds): a replay batch of 32 with noise 1 took
    # Finetune+ReCL from 45.0 to 75.0 (alone 73.75), and backtracking (departure 11) kept it level
    # (76.25) while no reconstruction can end above its start; 10 candidates per class, 15 steps.
    "resnet18": ({}, {"rec_optimizer": "adam", "lr_x": 1e-3, "m": 10, "n_rec": 15, "replay_batch": 32,
                      "replay_noise": 1.0, "backtrack": True}),
}
# Networks whose +ReCL (and +inversion) variant trains as the method alone: its lr, epochs and
# hyperparameters, not those of PRESETS' second column, of which only the replay's settings apply
# (GPM's noise, ER's CE). ReCL then only adds data. On AlexNet the harder training bought nothing
# and cost time.
ALONE_BUDGET = ("alexnet",)
# `--paper`: the paper as written. Every departure off, and the method's own training budget.
PAPER = {"rec_target": "weights", "freeze_old": False, "filter": False, "replay_noise": 0.0, "ce_weight": 0.0,
         "rec_optimizer": "sgd", "replay_batch": 0, "ce_scope": "all", "backtrack": False}
# The inversion control has no lambdas, no stationarity target and no added cross-entropy.
NOT_FOR_INVERSION = ("lr_lambda", "lambda_min", "rec_target", "ce_weight")


@dataclasses.dataclass(frozen=True)
class Config:
    """Every value one run uses. Reconstruction fields are None for the method alone,
    and those of Eq. 3-4 are None for the inversion control: they do not apply."""
    # what runs
    dataset: str = "mnist"
    scenario: str = "cil"
    method: str = "finetune"
    variant: str = "base"
    model: str = "mlp"
    seed: int = 0
    # data
    n_per_class: int | None = 100          # None: every training image
    classes_per_task: int = 2
    validation: bool = False               # score on held-out training images, not the test set
    data_root: str = "data"
    # training
    lr: float = 0.05
    epochs: int = 20
    batch_size: int = 64
    ce_scope: str = "all"                  # departure 8: "new" or "local" (recl.py part 1)
    hp: dict = dataclasses.field(default_factory=dict)  # the method's own hyperparameters
    # reconstruction (Step 1) and replay (Step 2)
    m: int | None = None
    n_rec: int | None = None
    sigma_x: float | None = None
    lr_x: float | None = None
    lr_lambda: float | None = None
    lambda_min: float | None = None
    alpha: float | None = None
    rec_target: str | None = None
    freeze_old: bool | None = None
    filter: bool | None = None
    replay_noise: float | None = None
    ce_weight: float | None = None
    rec_optimizer: str | None = None       # departure 6
    replay_batch: int | None = None        # departure 9
    backtrack: bool | None = None          # departure 11
    rec_precision: str | None = None
    tuning: str | None = None
    trials: int | None = None
    paper: bool = False
    # where
    device: str = "cpu"


# Where the data lives and which machine runs it do not define a run (the
# record's provenance names the machine); the seed is in the file name.
NOT_IN_DIGEST = ("seed", "device", "data_root")
# Settings added after runs were shipped, at the value those runs used: left out of the
# digest while they have it, so that the earlier results keep their names.
ADDED_LATER = {"ce_scope": "all", "rec_optimizer": "sgd", "replay_batch": 0, "backtrack": False,
               # retired: departures 7, 10 and 12 and weight decay, tried and removed; records still hold them
               "bn_weight": 0.0, "stats_weight": 0.0, "tv_weight": 0.0, "jitter": 0, "rec_distance": "l2",
               "weight_decay": 0.0}


def digest(cfg):
    """Eight hex digits that change with any setting of the run except its seed."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items()
                if k not in NOT_IN_DIGEST and not (k in ADDED_LATER and v in (None, ADDED_LATER[k]))}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def variant_name(method, variant):
    """'gpm', 'gpm+recl', or 'gpm+inversion'."""
    return method + ("" if variant == "base" else f"+{variant}")


def dataset_name(dataset):
    return Path(dataset).stem if dataset.endswith(".pt") else dataset


def run_name(cfg):
    """What a run is, for people: dataset, scenario, variant, tuning, split."""
    tuning = "" if cfg.tuning in (None, "naive") else f"-{cfg.tuning}"
    split = "-validation" if cfg.validation else ""
    return f"{dataset_name(cfg.dataset)}-{cfg.scenario}-{variant_name(cfg.method, cfg.variant)}{tuning}{split}"


def result_path(out, cfg):
    """out/NAME-DIGEST-seedS.json: one file per config and seed."""
    return Path(out) / f"{run_name(cfg)}-{digest(cfg)}-seed{cfg.seed}.json"


def in_scenario(table, scenario):
    """A table's values for `scenario`: a value given per scenario is a dict of them."""
    return {k: (v[scenario] if isinstance(v, dict) else v) for k, v in table.items()}


def preset(scenario, method, variant, model="mlp"):
    """What a run starts from before RECONSTRUCTION and the flags, lowest first: the defaults,
    the method alone (PRESETS, then the network's NETWORKS column), then, for a +ReCL variant,
    what it changes (the network's NETWORKS column, then the method's own in PRESETS, which is
    the more specific: GPM replays without noise on any network; on a network in ALONE_BUDGET
    without its lr, epochs and method hyperparameters)."""
    alone, recl_changes = PRESETS.get(scenario, {}).get(method, ({}, {}))
    net_alone, net_recl = NETWORKS[model]
    if model in ALONE_BUDGET:  # the method's +ReCL changes, less how hard and with what it trains
        training = {"lr", "epochs", *strategies.defaults(method)}
        recl_changes = {k: v for k, v in (recl_changes or {}).items() if k not in training}
    chosen = {**DEFAULT_TRAINING, **strategies.defaults(method), **alone, **in_scenario(net_alone, scenario)}
    return {**chosen, **in_scenario(net_recl, scenario), **(recl_changes or {})} if variant != "base" else chosen


def resolve(args, seed, variant):
    """The Config of one run: the presets, then the flags given in `args` (None: not given).

    Lowest first: `preset` (PRESETS and NETWORKS), RECONSTRUCTION, PAPER with --paper
    (which also drops both +ReCL columns), and the flags given."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    device = given["device"] if given.get("device", "auto") != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    paper = bool(args.paper)
    chosen = preset(args.scenario, args.method, "base" if paper else variant, args.model)
    fields = {"dataset": args.dataset, "scenario": args.scenario, "method": args.method, "variant": variant,
              "model": args.model, "seed": seed, "n_per_class": args.n_per_class, "validation": args.validation,
              "classes_per_task": given.get("classes_per_task", 20 if args.dataset == "tinyimagenet" else 2),
              "data_root": args.data_root or "data", "batch_size": args.batch_size, "device": device,
              "lr": given.get("lr", chosen["lr"]), "epochs": given.get("epochs", chosen["epochs"]),
              "ce_scope": given.get("ce_scope", PAPER["ce_scope"] if paper else chosen.get("ce_scope", "all")),
              "hp": {**{k: chosen[k] for k in strategies.defaults(args.method)}, **dict(args.hp)}}
    if variant != "base":
        rec = {**in_scenario(RECONSTRUCTION, args.scenario), "m": args.n_per_class or 100}
        rec.update({k: chosen[k] for k in rec if k in chosen})
        rec.update({k: v for k, v in PAPER.items() if k in rec} if paper else {}, paper=paper)
        rec.update({k: given[k] for k in rec if k in given})
        if rec["lr_lambda"] is None:
            rec["lr_lambda"] = LR_LAMBDA[rec["rec_optimizer"]]
        if variant == "inversion":
            rec.update({k: None for k in NOT_FOR_INVERSION})
        default_lr_x = (LR_X["adam"] if rec["rec_optimizer"] == "adam" else LR_X["inversion"][args.scenario]
                        if variant == "inversion" else LR_X[rec["rec_target"]])
        own = chosen.get("lr_x") if chosen.get("rec_optimizer") == rec["rec_optimizer"] else None
        rec["lr_x"] = given.get("lr_x", own or default_lr_x)  # a network's lr_x goes with its optimiser
        rec["rec_precision"] = reconstruction_precision(rec["rec_precision"], torch.device(device))
        if rec["tuning"] != "naive" and rec["trials"] is None:
            rec["trials"] = 10
        fields.update(rec)
    return Config(**fields)


def variants(args):
    """The variants `--variant` and `--rec-objective` ask for."""
    recl = "inversion" if args.rec_objective == "inversion" else "recl"
    if args.method == "joint":
        return ["base"]
    return {None: ["base", recl], "both": ["base", recl], "base": ["base"], "recl": [recl]}[args.variant]


def describe(cfg):
    """The header line of a run: what it is and every setting it resolved to."""
    split = " (validation split)" if cfg.validation else ""
    text = (f"{variant_name(cfg.method, cfg.variant)} | {cfg.scenario} | {cfg.dataset}{split} | {cfg.model} | "
            f"seed {cfg.seed} | {cfg.device} | {cfg.n_per_class or 'all'} per class, {cfg.classes_per_task} "
            f"per task | lr {cfg.lr:g}, {cfg.epochs} epochs, batch {cfg.batch_size}"
            + {"all": "", "new": ", CE over the new classes", "local": ", local CE"}[cfg.ce_scope])
    text += "".join(f", {k} {v:g}" for k, v in cfg.hp.items())
    if cfg.variant != "base":
        shown = ["m", "n_rec", "sigma_x", "lr_x", "lr_lambda", "lambda_min", "alpha", "rec_target", "ce_weight",
                 "rec_optimizer", "replay_noise", "replay_batch", "backtrack", "freeze_old", "filter",
                 "rec_precision", "tuning", "trials"]
        values = [f"{k} {getattr(cfg, k):g}" if isinstance(getattr(cfg, k), float) else f"{k} {getattr(cfg, k)}"
                  for k in shown if getattr(cfg, k) is not None]
        text += f" | {'the paper as written, ' if cfg.paper else ''}" + ", ".join(values)
    return text + f" | config {digest(cfg)}"


# =============================================================================
# The command line
# =============================================================================

class UsageError(Exception):
    """Bad command-line input; printed as one line."""


class RunFailed(Exception):
    """A run finished without usable numbers (it diverged); printed as one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def images_per_class(text):
    return None if text == "all" else int(text)


def method_hyperparameter(text):
    key, sep, value = text.partition("=")
    try:
        return key, float(value) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


# Flags that only the +ReCL variants use, by their config names.
RECL_FLAGS = ["m", "n_rec", "sigma_x", "lr_x", "lr_lambda", "lambda_min", "alpha", "rec_target", "freeze_old",
              "filter", "replay_noise", "replay_batch", "backtrack", "ce_weight", "rec_optimizer",
              "rec_precision", "tuning", "trials", "paper", "rec_objective", "save_images"]


SWITCHES = {"paper", "save_images", "freeze_old", "no_freeze_old", "filter", "no_filter", "backtrack", "no_backtrack"}


def without_flags(argv, names):
    """`argv` less the flags named (config names) and their values: run_all.sh passes its
    extra flags to every run, and a run that does not use one would refuse it."""
    kept, skip = [], False
    for word in argv:
        name = word[2:].split("=")[0].replace("-", "_") if word.startswith("--") else None
        if skip:
            skip = False
        elif name is not None and name.removeprefix("no_") in names:
            skip = "=" not in word and name not in SWITCHES
        else:
            kept.append(word)
    return kept


DESCRIPTION = ("Train a continual-learning method with and without ReCL (reconstruction of old data from the "
               "model) on a stream of tasks, and report ACC and BWT. Default: SplitMNIST from the shipped MNIST "
               "subset. Defaults not shown come from config.py's PRESETS.")


def make_parser(prog="recl.py", description=DESCRIPTION):
    """Every flag that can be refused defaults to None, "not given": `resolve` fills in the presets."""
    p = Parser(prog=prog, description=description)
    p.add_argument("--scenario", choices=["cil", "dil"], default="cil",
                   help="class-incremental (a growing head) or domain-incremental (the same labels every task)")
    p.add_argument("--method", choices=METHODS, default="finetune", help="the continual-learning method")
    p.add_argument("--variant", choices=["both", "base", "recl"],
                   help="the method alone, with ReCL, or both on the same seeds (default: both)")
    p.add_argument("--dataset", default="mnist", help=f"one of {', '.join(data.DATASETS)}, or a .pt file")
    p.add_argument("--data-root", help="where mnist-full, fashion-mnist, cifar10, tinyimagenet live "
                                       "(default: data; mnist and .pt files do not use it)")
    p.add_argument("--classes-per-task", type=int, help="classes per task (default: 2; 20 for tinyimagenet)")
    p.add_argument("--model", choices=models.MODELS, default="mlp",
                   help="the paper's homogeneous MLP or CNN, or a non-homogeneous AlexNet/ResNet18")
    p.add_argument("--seeds", type=int, help="number of seeds, each its own class order and init (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default: 0)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, help="epochs per task (default: PRESETS; AlexNet's +ReCL and "
                                               "+inversion: the method alone's)")
    g.add_argument("--lr", type=float, help="SGD learning rate (default: PRESETS; AlexNet's +ReCL and +inversion: "
                                                 "the method alone's)")
    g.add_argument("--batch-size", type=int, default=64, help="training batch size (default: 64)")
    g.add_argument("--n-per-class", type=images_per_class, default=100,
                   help="training images per class, or 'all' (default: 100)")
    g.add_argument("--validation", action="store_true",
                   help="score on 20%% of each task's training images, held out, not on the test set")
    g.add_argument("--ce-scope", choices=["all", "new", "local"],
                   help="CIL: the cross-entropy of the task's own images over all classes, or over its new classes "
                        "only, so that they never push down old classes, or local: also replayed rows over the old "
                        "classes only, and old against new learned by the head alone (default: all; local for "
                        "the CNN's and AlexNet's +ReCL, except ER's)")
    p.add_argument("--hp", type=method_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
                   help="a method hyperparameter, e.g. --hp ewc_lambda=1000 (default: PRESETS)")
    g = p.add_argument_group("reconstruction (the +ReCL variant only; defaults: config.RECONSTRUCTION)")
    g.add_argument("--m", type=int, help="candidates per old class (default: --n-per-class, or 100 with all; "
                                         "20 for the CNN and AlexNet, 10 for ResNet18; in DIL per class and old task)")
    g.add_argument("--n-rec", type=int, help="reconstruction steps before each task (default: 100; 30 for the CNN "
                                              "and AlexNet, 15 for ResNet18)")
    g.add_argument("--sigma-x", type=float, help="std of the initial random candidates (default: 0.001)")
    g.add_argument("--rec-objective", choices=["stationarity", "inversion"],
                   help="Eq. 3-6, or plain model inversion, the control (default: stationarity)")
    g.add_argument("--lr-x", type=float, help="step size for the candidates (default: 3 for the displacement "
                   "target, 1 for the weights, 0.003 (CIL) and 0.3 (DIL) for inversion; with Adam 0.01, "
                   "the CNN's default, and 0.001 for ResNet18)")
    g.add_argument("--lr-lambda", type=float, help="step size for the coefficients lambda_i (default: 0.1; with Adam 0.01)")
    g.add_argument("--lambda-min", type=float, help="Eq. 4 pushes each lambda_i above this (default: 0.05)")
    g.add_argument("--alpha", type=float, help="sharpness of the smooth ReLU backward (default: 100)")
    g.add_argument("--rec-target", choices=["weights", "displacement"],
                   help="fit theta (Eq. 3 as written) or theta - theta_0 (default: displacement)")
    g.add_argument("--freeze-old", action=argparse.BooleanOptionalAction,
                   help="classes reconstructed before keep their candidates, fixed (default: on)")
    g.add_argument("--filter", action=argparse.BooleanOptionalAction,
                   help="train only on candidates the model classifies as their label (default: on)")
    g.add_argument("--replay-noise", type=float, help="std of the fresh noise on replayed reconstructions, in "
                   "pixel stds of the task (default: 2.5, 0 for GPM, 1 for the CNN and AlexNet in DIL and for "
                   "ResNet18)")
    g.add_argument("--replay-batch", type=int, help="each training step adds this many reconstructions, drawn at "
                   "random, to a batch of the task's own images, and an epoch is one pass over those; 0: the "
                   "reconstructions join the task's data, as the paper (default: 0; 64 for the CNN and AlexNet, 32 "
                   "for ResNet18)")
    g.add_argument("--backtrack", action=argparse.BooleanOptionalAction, help="a reconstruction step that raises "
                   "the loss is undone and the step sizes halved (default: off; on for AlexNet and ResNet18)")
    g.add_argument("--ce-weight", type=float, help="weight of inversion's cross-entropy added to Eq. 6 "
                   "(default: 0.0003 in CIL, 0.03 for the CNN and AlexNet in CIL, 0 in DIL)")
    g.add_argument("--rec-optimizer", choices=["sgd", "adam"],
                   help="the optimiser of the candidates and lambdas: SGD with momentum, as the paper, or Adam, "
                        "as image inversion on conv nets (default: sgd; adam for the CNN, AlexNet and ResNet18)")
    g.add_argument("--paper", action="store_true", default=None,
                   help="the paper as written: Eq. 3 on the weights, every class afresh, no filter, no replay "
                        "noise, no cross-entropy term, SGD for the candidates, no replay batch, CE over all "
                        "classes, no backtracking, the method's own training budget; explicit flags win")
    g.add_argument("--rec-precision", choices=["auto", "float32", "bfloat16"],
                   help="number format of the reconstruction's products (default auto: bfloat16 where the CPU "
                        "has it)")
    g.add_argument("--tuning", choices=["naive", "unsup", "sup"],
                   help="the run's values (default: naive), or a search per task scored by the final L_full "
                        "(unsup) or by SSIM to a few stored real images (sup) (Sec. 4.3)")
    g.add_argument("--trials", type=int, help="random-search trials per task, with --tuning unsup or sup "
                                              "(default: 10)")
    g.add_argument("--save-images", action="store_true", default=None,
                   help="per task, a PNG of real images over their nearest reconstructions, and a .pt of them")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when present (default: auto)")
    p.add_argument("--out", default="results", help="folder for one JSON file per run (default: results)")
    p.add_argument("--quiet", action="store_true", help="print only one line per finished run")
    return p


def given(args, name):
    """Whether the command line set flag `name`: every flag it may refuse defaults to None."""
    return getattr(args, name, None) is not None


def check(args, probe_out=True):
    """Refuse, in one line, what makes no sense or would do nothing, before any work starts.
    Fills args.hp as a dict of typed values. `probe_out`: also check that --out takes files."""
    positive = {"batch-size": args.batch_size, "seeds": args.seeds, "epochs": args.epochs, "lr": args.lr,
                "n-per-class": args.n_per_class, "classes-per-task": args.classes_per_task, "m": args.m,
                "n-rec": args.n_rec, "sigma-x": args.sigma_x, "lr-x": args.lr_x, "lr-lambda": args.lr_lambda,
                "lambda-min": args.lambda_min, "alpha": args.alpha, "trials": args.trials}
    for flag, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{flag} must be a positive finite number, got {value}")
    for flag, value in (("replay-noise", args.replay_noise), ("ce-weight", args.ce_weight)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{flag} must be a finite number >= 0, got {value}")
    if args.replay_batch is not None and args.replay_batch < 0:
        raise UsageError(f"--replay-batch must be a whole number >= 0, got {args.replay_batch}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.scenario == "dil" and args.classes_per_task == 1:
        raise UsageError("--classes-per-task 1 in DIL gives every task the one label 0: nothing to learn")
    args.hp = strategies.check_hyperparameters(args.method, args.hp, UsageError)
    # flags that would do nothing for the runs asked for
    if args.method == "joint" and args.variant not in (None, "base"):
        raise UsageError(f"--variant {args.variant}: joint trains one model on all tasks at once, so it has "
                         "nothing to reconstruct; leave --variant out")
    if args.method == "joint" or args.variant == "base":
        reason = "joint has no +ReCL variant" if args.method == "joint" else "--variant base runs the method alone"
        for name in RECL_FLAGS:
            if given(args, name):
                raise UsageError(f"--{name.replace('_', '-')} applies to the +ReCL variant only; {reason}")
    if args.rec_objective == "inversion":
        for name in NOT_FOR_INVERSION:
            if given(args, name):
                raise UsageError(f"--{name.replace('_', '-')} is part of Eq. 3-6; the inversion control "
                                 "(--rec-objective inversion) does not use it")
    if args.ce_scope == "local" and args.variant != "recl":
        raise UsageError("--ce-scope local learns old against new from replayed rows, which the method alone has "
                         "none of: give it with --variant recl (--ce-scope new is the method alone's counterpart)")
    if args.ce_scope is not None and (args.scenario == "dil" or args.method == "joint"):
        raise UsageError("--ce-scope applies to class-incremental training after the first task; "
                         + ("DIL tasks share their classes" if args.scenario == "dil" else "joint trains all at once"))
    if args.trials is not None and args.tuning in (None, "naive"):
        raise UsageError("--trials sets the Sec. 4.3 search; it needs --tuning unsup or sup")
    if args.dataset not in data.DATASETS and not args.dataset.endswith(".pt"):
        raise UsageError(f"--dataset must be one of {', '.join(data.DATASETS)} or a .pt file, got {args.dataset!r}")
    if args.data_root is not None and (args.dataset == "mnist" or args.dataset.endswith(".pt")):
        raise UsageError(f"--data-root: {args.dataset} is not read from a data folder; leave it out")
    most = data.MNIST_SUBSET_PER_CLASS - 1  # keep at least one test image
    if args.dataset == "mnist" and (args.n_per_class or most + 1) > most:
        raise UsageError(f"--n-per-class {args.n_per_class or 'all'} is more than mnist allows "
                         f"({most}; it holds {most + 1} images per class and needs some to test on)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available")
    if probe_out:
        check_writable(args.out)


def check_writable(folder):
    """The results folder exists or can be made, and takes a file: checked before any run trains."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is a file; it must name a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--out {folder}: cannot write results there ({err.strerror or err})") from None


def check_tasks(tasks, cfg):
    """What the data must give before the first task trains: a network that takes its images,
    and training and test images for every class of every task."""
    try:
        models.build_model(cfg.model, tasks[0].x_train.shape[1:], len(tasks[0].classes))
    except ValueError as err:
        raise UsageError(f"--model {cfg.model}: {err}") from None
    split = "validation" if cfg.validation else "test"
    for t, task in enumerate(tasks):
        for label, c in enumerate(task.classes):
            own = label if cfg.scenario == "dil" else label + t * len(task.classes)
            for name, y in (("training", task.y_train), (split, task.y_test)):
                if not (y == own).any():
                    raise UsageError(f"{cfg.dataset}: class {c} of task {t + 1} has no {name} images")


# =============================================================================
# Results on disk, and what made them
# =============================================================================

@functools.cache  # once per process: the code it loaded, whatever is committed while it runs
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
    path = Path(path)
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
# not notice, and where the CPU has bfloat16 instructions (AVX512-BF16 or AMX)
# a step is faster (docs/cost.md). `auto` uses it only there: other CPUs would
# emulate it, and on a GPU it is unmeasured. Training is always float32.

def reconstruction_precision(choice, device):
    """'float32' or 'bfloat16' for `--rec-precision` choice ('auto' or either) on `device`."""
    if choice != "auto":
        return choice
    capabilities = torch.cpu.get_capabilities() if device.type == "cpu" else {}
    native = capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")
    return "bfloat16" if native else "float32"
