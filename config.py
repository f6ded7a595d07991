"""What one run is, and the command line that asks for it. Every setting is one field of `Config`: its default
(the MLP's +ReCL run on SplitMNIST), help and valid range, from which `make_parser` and `check` make the flags and
checks. `resolve` looks a run's values up: the network's (NETWORKS), the method's (strategies.TUNED), --paper's,
the control's, then the flags given, which win. A run's digest names its result file."""
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

METHODS = list(strategies.STRATEGIES)
SOURCES = {"eq3": "recl", "inversion": "inversion", "real": "real", "centroids": "centroids"}  # --replay-source
show = lambda value: f"{value:g}" if isinstance(value, float) else str(value)  # as help and header print a value


def setting(default, help, low=None, high=None, above=None, choices=None, kind=None, flag=True):
    """A Config field: its default, its help, and what a flag may give it (low <= v, above < v, v <= high)."""
    return dataclasses.field(default=default, metadata=dict(help=help, low=low, high=high, above=above,
                                                            choices=choices, kind=kind, flag=flag))


def per_class(text):
    return text if text == "all" else int(text)


COUNT = dict(above=0, high=100_000)  # far beyond any study here, far short of forever


@dataclasses.dataclass(frozen=True)
class Config:
    """Every value one run uses. The fields from `m` to `trials` are the +ReCL variant's: None for
    the method alone, and those of Eq. 3-5 None for the inversion control, which does not use them."""
    # what runs
    dataset: str = setting("mnist", "mnist (shipped), fashion-mnist, cifar10, or a .pt")
    scenario: str = setting("cil", "class-incremental (a growing head) or domain-incremental (one head)",
                            choices=["cil", "dil"])
    method: str = setting("finetune", "the continual-learning method", choices=METHODS)
    variant: str = setting("base", "base (the method alone), or what it replays: recl (Eq. 3), inversion, real "
                           "or centroids", flag=False)  # the flags are --variant and --replay-source, below
    model: str = setting("mlp", "the paper's MLP or CNN, or the non-homogeneous AlexNet or ResNet18",
                         choices=models.MODELS)
    seed: int = setting(0, "first seed: class order, init and shuffles", low=0)
    # data
    n_per_class: int | None = setting(100, "training images per class, or 'all'", kind=per_class, above=0)
    classes_per_task: int = setting(2, "classes per task", above=0)
    validation: bool = setting(False, "score on 20%% of each task's training images, held out, not the test set")
    data_root: str = setting("data", "where fashion-mnist and cifar10 live")
    # training (Step 2)
    lr: float = setting(0.05, "SGD learning rate", above=0, high=10.0)
    epochs: int = setting(20, "epochs per task", above=0, high=10_000)
    batch_size: int = setting(64, "training batch size", above=0)
    ce_scope: str = setting("all", "CIL, departure 8: the task's own images scored over all classes, over its new "
                            "classes only (new), or also the replayed ones over the old only (local)",
                            choices=["all", "new", "local"])
    hp: dict = dataclasses.field(default_factory=dict)  # the method's own hyperparameters (strategies.py), by --hp
    # reconstruction (Step 1) and replay: the +ReCL variant only
    m: int | None = setting(None, "candidates per old class (in DIL per class and old task); "
                            "default: as many as training images per class", kind=int, **COUNT)
    n_rec: int | None = setting(100, "reconstruction steps before each task", **COUNT)
    sigma_x: float | None = setting(1e-3, "std of the initial random candidates", above=0)
    lr_x: float | None = setting(3.0, "step size of the candidates", above=0, high=1000.0)
    lr_lambda: float | None = setting(0.1, "step size of the lambdas", above=0, high=1000.0)
    lambda_min: float | None = setting(0.05, "Eq. 4 pushes each lambda_i above this", above=0)
    alpha: float | None = setting(100.0, "sharpness of the smooth ReLU's backward", above=0)
    rec_target: str | None = setting("displacement", "departure 1: what Eq. 3 fits, theta - theta_0 or theta "
                                     "as written (weights)", choices=["weights", "displacement"])
    freeze_old: bool | None = setting(True, "departure 2: classes reconstructed before keep their candidates")
    filter: bool | None = setting(True, "departure 3: replay only candidates the model files under their label")
    replay_noise: float | None = setting(2.5, "departure 4: std of fresh noise on replayed rows, in pixel stds", low=0)
    ce_weight: float | None = setting(3e-4, "departure 5: weight of inversion's cross-entropy added to Eq. 6", low=0)
    rec_optimizer: str | None = setting("sgd", "departure 6: the candidates' optimiser", choices=["sgd", "adam"])
    replay_batch: int | None = setting(0, "departure 9: reconstructions drawn into each batch of the task's "
                                       "own images; 0: they join the task's data", low=0, high=100_000)
    budget: str | None = setting("recl", "the method's lr, epochs, hp: its +ReCL variant's (recl) or its own (alone); "
                                 "--budget recl on the method alone trains it as +ReCL trains, without replay",
                                 choices=["alone", "recl"])
    rec_precision: str | None = setting("float32", "number format of the reconstruction's products",
                                        choices=["float32", "bfloat16"])
    tuning: str | None = setting("naive", "Sec. 4.3: the run's values, or a search per task scored by the final "
                                 "L_full (unsup) or by SSIM to a few stored real images (sup)",
                                 choices=["naive", "unsup", "sup"])
    trials: int | None = setting(None, "the search's trials per task (default: 10)", kind=int, above=0, high=1000)
    paper: bool = setting(False, "the paper as written: every departure off, the method's own training budget")
    # where
    device: str = setting("auto", "auto: CUDA when present", choices=["auto", "cpu", "cuda"])
    set_by: dict = dataclasses.field(default_factory=dict)  # each value not a default: where it came from


FIELDS, DEFAULTS = [f.name for f in dataclasses.fields(Config)], dataclasses.asdict(Config())
RECL_FIELDS = FIELDS[FIELDS.index("m"):FIELDS.index("paper")]  # what the method alone does not use
CONTROL = {"lr_lambda": None, "lambda_min": None, "rec_target": None, "ce_weight": None}  # no Eq. 3-4, no term
# The stored arms (real images, class centroids) optimise nothing: only m, the filter and the replay are theirs.
STORED = {k: None for k in RECL_FIELDS if k not in ("m", "filter", "replay_noise", "replay_batch", "budget")}
PAPER = {"rec_target": "weights", "freeze_old": False, "filter": False, "replay_noise": 0.0, "ce_weight": 0.0,
         "rec_optimizer": "sgd", "replay_batch": 0, "ce_scope": "all", "budget": "alone"}  # --paper

# ==== A run's values, looked up ======================================================================================
# The replay variants' values per network and scenario, chosen on validation (networks.md: "Why, in numbers" for the
# CNN, "ResNet18"); in DIL no inversion term (departures.md, 5). AlexNet takes the CNN's, at the method's own budget:
# the harder one bought it nothing (networks.md, "AlexNet").
CONV = {"rec_optimizer": "adam", "m": 20, "n_rec": 30, "replay_batch": 64}
RESNET = {"rec_optimizer": "adam", "m": 10, "n_rec": 15, "replay_batch": 32, "replay_noise": 1.0}
NETWORKS = {"mlp": {"cil": {}, "dil": {"ce_weight": 0.0}},
            "cnn": {"cil": {**CONV, "ce_scope": "local", "ce_weight": 0.03},
                    "dil": {**CONV, "replay_noise": 1.0, "ce_weight": 0.0}},
            "resnet18": {"cil": RESNET, "dil": {**RESNET, "ce_weight": 0.0}}}
NETWORKS["alexnet"] = {scenario: {**values, "budget": "alone"} for scenario, values in NETWORKS["cnn"].items()}


def resolve(args, seed, variant):
    """The Config of one run from the command line's `args` (None: not given): Config's defaults, then the network's
    (replay variants), the method's at the run's budget, --paper's, the control's and the flags given, each over those
    before; then the values that depend on others, in named `if` lines that never override a flag."""
    given = {k: v for k, v in vars(args).items() if v is not None and k in FIELDS and k not in ("seed", "variant", "hp")
             and not (variant == "base" and k in RECL_FIELDS and k != "budget")}
    given.update(dict(args.hp))
    if variant == "base" and given.get("budget") == "alone":
        del given["budget"]  # the method alone trains at its own budget anyway
    if given.get("n_per_class") == "all":
        given["n_per_class"] = None  # every training image
    method, scenario, model, replay = args.method, args.scenario, args.model, variant != "base"
    paper = replay and bool(given.get("paper"))
    tuned = replay and not paper  # a replay variant with the values tuned here, not the paper's
    network = NETWORKS[model][scenario] if tuned else {}
    # a flag's budget, else the method's own for the method alone and under --paper, else the network's or +ReCL's
    budget = given.get("budget", network.get("budget", "recl") if tuned else "alone")
    own, arms = strategies.TUNED[scenario].get(method, {}), strategies.ARMS  # a method not tuned yet: Config's
    arm = {**arms.get((scenario, method), {}), **arms.get((scenario, method, variant), {})} if tuned else {}
    sources = {"default": {**DEFAULTS, **strategies.defaults(method), "seed": seed, "variant": variant},
               "network": network,
               "method": {**own.get("alone", {}), **own.get(budget, {}), **arm},
               "paper": PAPER if paper else {},
               "control": {"inversion": CONTROL, "real": STORED, "centroids": STORED}.get(variant, {}),
               "flag": given}
    values = {k: v for changes in sources.values() for k, v in changes.items()}
    set_by = {k: source for source, changes in sources.items() if source != "default" for k in changes
              if k not in ("dataset", "scenario", "method", "model")}  # what runs, always known

    def retune(source, **changes):  # never a flag's value, nor one the run does not use
        for k in (k for k in changes if k not in given and values[k] is not None):
            values[k], set_by[k] = changes[k], source
    if not replay:  # the method alone takes no +ReCL value (its --budget recl is at the end)
        values.update({k: None for k in RECL_FIELDS if k not in given})
    # the candidates' step size follows what they fit and how, under --paper too (departures.md, 1, 6; attribution.md)
    if variant == "inversion":
        retune("steps", lr_x=0.3 if scenario == "dil" else 0.003)
    if variant == "recl" and values["rec_target"] == "weights":
        retune("steps", lr_x=1.0)
    if values["rec_optimizer"] == "adam":
        retune("steps", lr_x=1e-3 if model == "resnet18" else 0.01, lr_lambda=0.01)
    # the CNN trains gently in DIL, for every method: Eq. 3 can then read it (networks.md, "The CNN's budget in DIL")
    if model == "cnn" and scenario == "dil" and tuned and budget == "recl":
        retune("network", lr=0.01, epochs=40)
    if values["tuning"] in ("unsup", "sup") and values["trials"] is None:
        values["trials"] = 10  # the search's default
    if replay:
        values["m"] = values["m"] or values["n_per_class"] or 100
    values["hp"] = {k: values.pop(k) for k in strategies.defaults(method)}
    values["set_by"], values["paper"] = set_by, paper  # the method alone is the same run with --paper or without
    if values["device"] == "auto":
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if variant == "base" and values["budget"] == "recl":  # the method alone, trained exactly as its +ReCL run trains
        recl = resolve(args, seed, "recl")
        values.update(lr=recl.lr, epochs=recl.epochs, hp=recl.hp,
                      ce_scope="new" if recl.ce_scope == "local" else recl.ce_scope)  # local needs replayed rows
        values["set_by"].update({k: "budget" for k in ("lr", "epochs", "ce_scope", *recl.hp)})
    return Config(**values)


def variants(args):
    recl = SOURCES[args.replay_source or "eq3"]
    if args.method == "joint":
        return ["base"]
    return {None: ["base", recl], "both": ["base", recl], "base": ["base"], "recl": [recl]}[args.variant]


# ==== The flags, made from the fields, and the checks made before anything trains ====================================
class UsageError(Exception):  # bad command-line input, printed as one line
    pass


class RunFailed(Exception):  # a run diverged: no usable numbers, printed as one line
    pass


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # whole names only (--ou is not --out)
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):  # one line instead of usage + message
        if "--variant: invalid choice: 'inversion'" in message:
            message += "; the inversion control is --variant recl --replay-source inversion"
        raise UsageError(message)


def method_hyperparameter(text):
    key, sep, value = text.partition("=")
    try:
        return key, float(value) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


def make_parser(prog="recl.py", description=None):
    """One flag per Config field, each defaulting to None ("not given"), and the few that are not settings."""
    p = Parser(prog=prog, description=description or "Train a continual-learning method with and without ReCL on "
               "a stream of tasks; one JSON file per run. Defaults: config.Config, the MLP's; a flag given wins.")
    tabled = {"lr", "epochs", "lr_x", "lr_lambda", *(k for n in NETWORKS.values() for v in n.values() for k in v)}
    for f in (f for f in dataclasses.fields(Config) if f.metadata.get("flag")):
        kind = f.metadata["kind"] or type(f.default)
        kwargs = ({"action": "store_true" if f.name in ("validation", "paper") else argparse.BooleanOptionalAction}
                  if kind is bool else {"type": kind, "choices": f.metadata["choices"]})
        known = f.name in ("scenario", "method", "model", "dataset", "seed")  # what runs is always known
        own = "; networks and methods have their own: config.NETWORKS, strategies.TUNED" * (f.name in tabled)
        help = f"{f.metadata['help']} (default: {show(f.default)}{own})"
        p.add_argument(f"--{f.name.replace('_', '-')}", help=help, default=f.default if known else None, **kwargs)
    p.add_argument("--variant", choices=["both", "base", "recl"], help="the method alone, with ReCL, or both")
    p.add_argument("--replay-source", choices=list(SOURCES),
                   help="what the replay variant replays: candidates fitted to Eq. 3-6 (eq3, +ReCL), candidates "
                   "fitted by model inversion (the control), m real training images per old class (real: the "
                   "ceiling, a buffer that size) or each old class's mean image (centroids: the floor) "
                   "(default: eq3)")
    p.add_argument("--hp", type=method_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
                   help="a method's own hyperparameter, e.g. --hp ewc_lambda=1000 (default: strategies.TUNED's)")
    p.add_argument("--seeds", type=int, help="number of seeds (default: 1)")
    p.add_argument("--save-images", action="store_true", default=None,
                   help="per task, a PNG of real images over their nearest reconstructions, and a .pt of them")
    p.add_argument("--out", default="results", help="folder for one JSON file per run (default: results)")
    p.add_argument("--quiet", action="store_true", help="print only one line per finished run")
    p.add_argument("--skip-done", action="store_true", help="skip a run whose result file exists")
    return p


RECL_FLAGS = [k for k in RECL_FIELDS if k != "budget"] + ["paper", "replay_source", "save_images"]
given = lambda args, name: getattr(args, name, None) is not None


# What no field can say alone: (refused when, why), for the runs asked for.
def combinations(a):
    return [
        (a.seed + (a.seeds or 1) > 2 ** 31, f"--seed plus --seeds must stay below {2 ** 31}, got {a.seed}"),
        (a.seeds is not None and not 0 < a.seeds <= 1000, f"--seeds must be from 1 to 1000, got {a.seeds}"),
        (not str(a.out).strip(), "--out is empty; it must name a folder"),
        (a.scenario == "dil" and a.classes_per_task == 1, "--classes-per-task 1 in DIL gives every task one label"),
        (a.method == "joint" and a.variant not in (None, "base"),
         f"--variant {a.variant}: joint trains on all tasks at once and has nothing to reconstruct"),
        ((a.method == "joint" or a.variant == "base") and any(given(a, k) for k in RECL_FLAGS),
         f"--{next((k for k in RECL_FLAGS if given(a, k)), '').replace('_', '-')} applies to the +ReCL variant "
         f"only; {'joint has none' if a.method == 'joint' else '--variant base runs the method alone'}"),
        (a.replay_source == "inversion" and any(given(a, k) for k in CONTROL),
         f"--{next((k for k in CONTROL if given(a, k)), '').replace('_', '-')} is part of Eq. 3-6; the "
         "inversion control (--replay-source inversion) does not use it"),
        (a.replay_source in ("real", "centroids") and any(given(a, k) for k in [*STORED, "paper"]),
         f"--{next((k for k in [*STORED, 'paper'] if given(a, k)), '').replace('_', '-')} belongs to the "
         f"reconstruction; --replay-source {a.replay_source} stores images and reconstructs nothing"),
        (a.budget is not None and a.method == "joint", "--budget: joint trains on all tasks at once, at its own"),
        (a.ce_scope == "local" and a.variant != "recl",
         "--ce-scope local needs replayed rows: give it with --variant recl (--ce-scope new is the method alone's)"),
        (a.ce_scope is not None and (a.scenario == "dil" or a.method == "joint"),
         "--ce-scope applies to class-incremental training after the first task"),
        (a.trials is not None and a.tuning in (None, "naive"), "--trials needs --tuning unsup or sup"),
        (a.dataset not in data.DATASETS and not a.dataset.endswith(".pt"),
         f"--dataset must be one of {', '.join(data.DATASETS)} or a .pt file, got {a.dataset!r}"),
        (a.data_root is not None and (a.dataset == "mnist" or a.dataset.endswith(".pt")),
         f"--data-root: {a.dataset} is not read from a data folder; leave it out"),
        (a.dataset == "mnist" and (a.n_per_class == "all" or (a.n_per_class or 0) >= data.MNIST_SUBSET_PER_CLASS),
         f"--n-per-class {a.n_per_class} is more than mnist allows ({data.MNIST_SUBSET_PER_CLASS - 1}; "
         "it holds 500 images per class and needs some to test on)"),
        (a.device == "cuda" and not torch.cuda.is_available(), "--device cuda: no CUDA device is available"),
    ]


def check(args, probe_out=True):
    """Refuse, in one line, what makes no sense or would do nothing, before any work starts.
    Fills args.hp as a dict of typed values; `probe_out`: also check that --out takes files."""
    for f in dataclasses.fields(Config):  # each number a flag gives, within its field's range
        value, meta, flag = getattr(args, f.name, None), f.metadata, f"--{f.name.replace('_', '-')}"
        if value is None or isinstance(value, str) or not meta or meta["choices"]:
            continue
        if not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, got {value}")
        if meta["above"] is not None and not value > meta["above"]:
            raise UsageError(f"{flag} must be > {meta['above']}, got {value}")
        if meta["low"] is not None and not value >= meta["low"]:
            raise UsageError(f"{flag} must be >= {meta['low']}, got {value}")
        if meta["high"] is not None and value > meta["high"]:
            raise UsageError(f"{flag} {value:g} is above {meta['high']:g}, far beyond what any run here uses")
    for refused, why in combinations(args):
        if refused:
            raise UsageError(why)
    args.hp = strategies.check_hyperparameters(args.method, args.hp, UsageError)
    if probe_out:
        check_writable(args.out)


def check_writable(folder):
    """The results folder, or the nearest folder above it that exists, takes a file; nothing is
    made here, so a run refused later leaves no empty folder behind."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is a file; it must name a folder")
    there = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    try:
        if not there.is_dir():
            raise NotADirectoryError(f"{there} is a file")
        probe = there / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--out {folder}: cannot write results there ({err.strerror or err})") from None


def check_tasks(tasks, cfg):
    """Before the first task trains: a network that takes the images, the memory the run will
    fill (docs/cost.md, "Memory"), and training and test images for every class of every task."""
    shape = tasks[0].x_train.shape[1:]
    try:
        net = models.build_model(cfg.model, shape, len(tasks[0].classes))
    except ValueError as err:
        raise UsageError(f"--model {cfg.model}: {err}") from None
    if cfg.variant != "base":
        sizes = []  # the numbers each layer outputs for one image; the network is dropped after
        for layer in (m for m in net.modules() if not list(m.children())):
            layer.register_forward_hook(lambda m, i, out: sizes.append(out.numel()))
        with torch.no_grad():
            net.eval()(torch.zeros(1, *shape))
        numel, per_task, acts = shape.numel(), len(tasks[0].classes), sum(sizes)
        last = per_task * (len(tasks) - 1)
        # the most candidates one backward pass goes through: with --freeze-old the newest classes' each
        # step, and once before the steps the kept ones'; without it, all of them each step
        in_pass = cfg.m * (max(per_task, last - per_task) if cfg.freeze_old else last)
        batch = cfg.replay_batch + cfg.batch_size
        have = (torch.cuda.mem_get_info()[0] if cfg.device == "cuda"
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30  # GiB
        # per image, 4 copies of its layers' outputs in a reconstruction step, 2 in training (the CNN's, rounded up)
        for what, images, held in ((f"--m {cfg.m} candidates per class", cfg.m * last, in_pass * 4 * acts),
                                   (f"--replay-batch {cfg.replay_batch} with --batch-size {cfg.batch_size}", batch,
                                    batch * 2 * acts)):
            need = 4 * (images * numel + held) / 2**30  # GiB, 4 bytes a number
            if need > have:
                raise UsageError(f"{what}: {images:,} images of {numel:,} numbers and their activations need about "
                                 f"{need:,.1f} GiB, more than the {have:,.1f} GiB of {cfg.device} memory")
    for t, task in enumerate(tasks):
        for label, c in enumerate(task.classes):
            own = label if cfg.scenario == "dil" else label + t * len(task.classes)
            for name, y in (("training", task.y_train), ("validation" if cfg.validation else "test", task.y_test)):
                if not (y == own).any():
                    raise UsageError(f"{cfg.dataset}: class {c} of task {t + 1} has no {name} images" + (
                        " left: --validation holds out a fifth; give a larger --n-per-class" if cfg.validation else ""))


def make_tasks(cfg):
    """The run's tasks (its validation split with --validation), class order, mean image, classes left out."""
    tasks, *rest = data.make_tasks(cfg.dataset, cfg.seed, cfg.n_per_class, cfg.scenario, cfg.classes_per_task,
                                   cfg.data_root)
    return data.validation_split(tasks, 0.2, cfg.seed) if cfg.validation else tasks, *rest


# ==== Names, and results on disk =====================================================================================
NOT_IN_DIGEST = ("seed", "device", "data_root", "set_by")  # where it ran does not define a run
REMOVED = {"backtrack": False}  # fields of departures that lost, at their "off" value: older records keep their names


def digest(cfg):
    """Eight hex digits that change with any setting of the run but its seed; a .pt counts by its contents."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_DIGEST}
    settings.update({k: None if cfg.variant == "base" else off for k, off in REMOVED.items()})
    if cfg.dataset.endswith(".pt") and Path(cfg.dataset).is_file():
        settings["dataset"] = f"sha256:{file_sha256(cfg.dataset)}"
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


@functools.cache  # a file is read once per change of its time or size
def _sha256(path, mtime_ns, size):
    return hashlib.sha256(path.read_bytes()).hexdigest()


file_sha256 = lambda path: _sha256(Path(path).resolve(), Path(path).stat().st_mtime_ns, Path(path).stat().st_size)


def variant_name(method, variant, budget=None):
    """finetune, finetune+recl, finetune+inversion, ...; the method alone at +ReCL's budget: finetune@recl-budget."""
    return method + ("@recl-budget" if budget == "recl" else "") if variant == "base" else f"{method}+{variant}"


def dataset_name(dataset):
    return Path(dataset).stem if dataset.endswith(".pt") else dataset


def run_name(cfg):
    tuning = "" if cfg.tuning in (None, "naive") else f"-{cfg.tuning}"
    return (f"{dataset_name(cfg.dataset)}-{cfg.scenario}-{variant_name(cfg.method, cfg.variant, cfg.budget)}{tuning}"
            + ("-validation" if cfg.validation else ""))


def result_path(out, cfg):
    """out/NAME-DIGEST-seedS.json: one file per config and seed."""
    return Path(out) / f"{run_name(cfg)}-{digest(cfg)}-seed{cfg.seed}.json"


def describe(cfg):
    """The header line of a run: what it is, each setting it resolved to under the one word that says where it came
    from (`resolve`), and the digest that names its file."""
    text = (f"{variant_name(cfg.method, cfg.variant, cfg.budget)} | {cfg.scenario} | {cfg.dataset}"
            f"{' (validation split)' if cfg.validation else ''} | {cfg.model} | seed {cfg.seed} | {cfg.device} | "
            f"{cfg.n_per_class or 'all'} per class, {cfg.classes_per_task} per task")
    settings = {"lr": cfg.lr, "epochs": cfg.epochs, "batch_size": cfg.batch_size, "ce_scope": cfg.ce_scope, **cfg.hp,
                **{k: getattr(cfg, k) for k in RECL_FIELDS if getattr(cfg, k) is not None}}
    by = {s: [f"{k} {show(v)}" for k, v in settings.items() if cfg.set_by.get(k, "default") == s]
          for s in ("default", "network", "method", "paper", "control", "steps", "budget", "flag")}
    return text + "".join(f" | {s}: {', '.join(kv)}" for s, kv in by.items() if kv) + f" | config {digest(cfg)}"


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


def write_atomically(path, text):
    """Write to a temporary name, then rename: a killed run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


write_json_atomically = lambda path, record: write_atomically(path, json.dumps(record, indent=1))


def run_from_command_line(main, program):
    """Run `main`; the errors a user can cause end in one line and a non-zero exit."""
    try:
        main()
    except (UsageError, RunFailed, data.DataError) as err:
        sys.exit(f"{program}: error: {err}")
    except KeyboardInterrupt:
        sys.exit(f"{program}: interrupted; finished runs are saved, rerun to redo the rest")
