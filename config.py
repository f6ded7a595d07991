"""What one run is: every default written once, the rows that change them, and `resolve`.

A run is one `Config`; its fields' defaults are the MLP's +ReCL run on SplitMNIST in
CIL. Rows change them for a network, a method (its rows sit with it in strategies.py),
`--paper` and the inversion control; the flags given win over every row. `resolve` does
that once, before anything trains. A config's digest names its result file, so runs that
differ in any setting never share a file or a table row. (Adding a method or a
departure: README.md.)
"""
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import torch

import strategies

METHODS = list(strategies.STRATEGIES)
VARIANTS = ["base", "recl", "inversion"]  # the method alone, +ReCL, +ReCL's pipeline with the inversion control
RECL = strategies.RECL["variant"]         # the variants that reconstruct


@dataclasses.dataclass(frozen=True)
class Config:
    """Every value one run uses; the +ReCL fields are None for the method alone, and those of
    Eq. 3-5 for the inversion control: they do not apply."""
    # what runs
    dataset: str = "mnist"                 # mnist (shipped), mnist-full, fashion-mnist, cifar10, tinyimagenet, a .pt
    scenario: str = "cil"                  # class- or domain-incremental
    method: str = "finetune"
    variant: str = "base"                  # base, recl or inversion
    model: str = "mlp"
    seed: int = 0                          # class order, init and shuffles
    # data
    n_per_class: int | None = 100          # training images per class; None: all
    classes_per_task: int = 2
    validation: bool = False               # score on held-out training images, not the test set
    data_root: str = "data"                # where the datasets that are not shipped live
    # training (Step 2)
    lr: float = 0.05                       # SGD, for a method whose rows do not tune it
    epochs: int = 20
    batch_size: int = 64
    ce_scope: str = "all"                  # departure 8: "new" or "local"
    hp: dict = dataclasses.field(default_factory=dict)  # the method's own hyperparameters (strategies.py)
    # reconstruction (Step 1) and replay
    m: int | None = None                   # candidates per old class; None: as many as training images per class
    n_rec: int | None = 100                # reconstruction steps before each task
    sigma_x: float | None = 1e-3           # std of the initial candidates
    lr_x: float | None = 3.0               # the candidates' step size, for the relative L_rec of departure 1
    lr_lambda: float | None = 0.1          # the lambdas' step size
    lambda_min: float | None = 0.05        # Eq. 4 pushes each lambda_i above this
    alpha: float | None = 100.0            # sharpness of the smooth ReLU's backward
    rec_target: str | None = "displacement"  # departure 1; "weights": Eq. 3 as written
    freeze_old: bool | None = True         # departure 2
    filter: bool | None = True             # departure 3
    replay_noise: float | None = 2.5       # departure 4, in pixel stds of the task
    ce_weight: float | None = 3e-4         # departure 5
    rec_optimizer: str | None = "sgd"      # departure 6: "adam"
    replay_batch: int | None = 0           # departure 9: 0 joins the reconstructions to the task's data
    backtrack: bool | None = False         # departure 11
    budget: str | None = "recl"            # lr, epochs, hp: the method's +ReCL rows ("recl") or its own ("alone")
    rec_precision: str | None = "auto"     # the reconstruction's number format; auto: bfloat16 where the CPU has it
    tuning: str | None = "naive"           # Sec. 4.3: the run's values, or a search (unsup, sup)
    trials: int | None = None              # the search's trials per task
    paper: bool = False                    # --paper: every departure off
    # where
    device: str = "auto"                   # auto: CUDA when present
    set_by: dict = dataclasses.field(default_factory=dict)  # each value not a default: "flag" or its row's name


FIELDS = [f.name for f in dataclasses.fields(Config)]
RECL_FIELDS = FIELDS[FIELDS.index("m"):FIELDS.index("paper")]  # what the method alone does not use
CLASH = {k for spec in strategies.STRATEGIES.values() for k in spec["hyperparameters"]} & set(FIELDS)
if CLASH:  # a method's hyperparameters share the values `resolve` fills: their names must differ
    raise ImportError(f"strategies.py: hyperparameter(s) {sorted(CLASH)} share a name with a Config field")

# =============================================================================
# The rows: (name, when, what changes), lowest first
# =============================================================================
# A row applies when each field it names in `when` has that value (or one of a
# tuple) among the values so far; `resolve` reads them in this order. Its name
# starts with its group. Every value was chosen on validation splits, never the
# test set; each comment points to the numbers.
CONTROL = {"lr_lambda": None, "lambda_min": None, "rec_target": None, "ce_weight": None}  # no Eq. 3-4, no term
NETWORK = {**strategies.RECL, "model": ("cnn", "alexnet")}
ROWS = [
    ("alone", {"variant": "base"}, {k: None for k in RECL_FIELDS}),
    ("data: tinyimagenet", {"dataset": "tinyimagenet"}, {"classes_per_task": 20}),
    # The inversion term cost ACC in DIL (docs/departures.md, 5).
    ("data: dil", {"scenario": "dil", "variant": RECL}, {"ce_weight": 0.0}),
    # The conv nets: Adam (6), fewer candidates and steps, a replay batch (9), in CIL local CE (8)
    # and more inversion (5), in DIL less replay noise (docs/networks.md, "Second round").
    ("network: cnn and alexnet", NETWORK, {"rec_optimizer": "adam", "m": 20, "n_rec": 30, "replay_batch": 64,
                               "ce_scope": "local", "ce_weight": 0.03}),
    ("network: cnn and alexnet in dil", {**NETWORK, "scenario": "dil"},
     {"replay_noise": 1.0, "ce_scope": "all", "ce_weight": 0.0}),
    # AlexNet also backtracks (11), at the method alone's budget: training harder bought
    # nothing and cost time (docs/networks.md, "Fourth round").
    ("network: alexnet", {**strategies.RECL, "model": "alexnet"}, {"backtrack": True, "budget": "alone"}),
    # ResNet18: its lambdas' SGD step overflowed (docs/networks.md, "ResNet18").
    ("network: resnet18", {**strategies.RECL, "model": "resnet18"},
     {"rec_optimizer": "adam", "m": 10, "n_rec": 15, "replay_batch": 32, "replay_noise": 1.0, "backtrack": True}),
    # The paper as written: every departure off, the method's own training budget.
    ("paper", {"paper": True, "variant": RECL},
     {"rec_target": "weights", "freeze_old": False, "filter": False, "replay_noise": 0.0, "ce_weight": 0.0,
      "rec_optimizer": "sgd", "replay_batch": 0, "ce_scope": "all", "backtrack": False, "budget": "alone"}),
    "methods",  # "method: NAME", each method's rows from strategies.py, in their order
    # The candidates' step size goes with what they minimise and how, under --paper too: inversion's
    # summed CE, Eq. 3 on the weights, Adam (each pixel moves about lr_x a step); docs/departures.md, 1, 6.
    ("steps: inversion", {"variant": "inversion"}, {"lr_x": 0.003}),
    ("steps: inversion dil", {"variant": "inversion", "scenario": "dil"}, {"lr_x": 0.3}),
    ("steps: weights", {"variant": "recl", "rec_target": "weights"}, {"lr_x": 1.0}),
    ("steps: adam", {"rec_optimizer": "adam"}, {"lr_x": 0.01, "lr_lambda": 0.01}),
    ("steps: resnet18", {"variant": RECL, "model": "resnet18", "rec_optimizer": "adam"}, {"lr_x": 1e-3}),
    ("control", {"variant": "inversion"}, CONTROL),
    ("search", {"tuning": ("unsup", "sup")}, {"trials": 10}),
]


def rows():
    """Every row in the order `resolve` reads them, the methods' in place of "methods"."""
    methods = [(f"method: {name}", {**when, "method": name}, changes) for name, spec in strategies.STRATEGIES.items()
               for when, changes in spec["rows"]]
    return [row for entry in ROWS for row in (methods if entry == "methods" else [entry])]


def matches(when, values):
    return all(values.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in when.items())


def resolve(args, seed, variant):
    """The Config of one run, from the command line's `args` (None: not given).

    Config's defaults, with the flags given over them; then each row of `rows()` whose `when`
    matches the values so far, in the order of their groups: alone, data, network, paper, method,
    steps, control, search; a row never overrides a flag, and matches on it (`--rec-optimizer
    adam` brings Adam's step sizes). Last, what depends on the machine or the data: --device
    auto, --rec-precision auto, and m None (as many as images per class)."""
    given = {k: v for k, v in vars(args).items() if v is not None and k in FIELDS and k not in ("seed", "variant")}
    given.update(dict(args.hp))  # --hp names the method's own hyperparameters
    if given.get("n_per_class") == "all":
        given["n_per_class"] = None  # every training image
    values = {**dataclasses.asdict(Config()), **strategies.defaults(args.method), "seed": seed, "variant": variant,
              **given}
    set_by = {k: "flag" for k in given if k in FIELDS or k in strategies.defaults(args.method)}
    for name, when, changes in rows():
        if matches(when, values):
            values.update({k: v for k, v in changes.items() if k not in given})
            set_by.update({k: name for k in changes if k not in given})
    values["hp"] = {k: values.pop(k) for k in strategies.defaults(args.method)}
    values["set_by"] = {k: v for k, v in set_by.items() if values.get(k, values["hp"].get(k)) is not None
                        and k not in ("dataset", "scenario", "method", "model", "device", "n_per_class",
                                      "batch_size", "validation", "hp", "paper")}
    values["paper"] = bool(values["paper"]) and variant != "base"  # the method alone is the same run either way
    if values["device"] == "auto":
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if variant != "base":
        values["m"] = values["m"] or values["n_per_class"] or 100
        values["rec_precision"] = reconstruction_precision(values["rec_precision"], torch.device(values["device"]))
    return Config(**values)


def variants(args):
    """The variants `--variant` and `--rec-objective` ask for."""
    recl = "inversion" if args.rec_objective == "inversion" else "recl"
    if args.method == "joint":
        return ["base"]
    return {None: ["base", recl], "both": ["base", recl], "base": ["base"], "recl": [recl]}[args.variant]


# `--rec-precision auto`: bfloat16 products in Eq. 3's double backward only where the CPU has
# bfloat16 instructions (docs/cost.md); elsewhere emulated, on a GPU unmeasured.
def reconstruction_precision(choice, device):
    if choice != "auto":
        return choice
    capabilities = torch.cpu.get_capabilities() if device.type == "cpu" else {}
    return "bfloat16" if capabilities.get("avx512_bf16") or capabilities.get("amx_bf16") else "float32"


# =============================================================================
# Names: a run's digest, file and header
# =============================================================================

# Where the data lives and which machine runs it do not define a run (the record's
# provenance names the machine); the seed is in the file name.
NOT_IN_DIGEST = ("seed", "device", "data_root", "set_by")


def digest(cfg):
    """Eight hex digits that change with any setting of the run except its seed. Your own .pt
    counts by its contents, not its path: changed data runs again, one file by any path is one."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_DIGEST}
    if cfg.dataset.endswith(".pt") and Path(cfg.dataset).is_file():
        settings["dataset"] = f"sha256:{file_sha256(cfg.dataset)}"
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def file_sha256(path):
    path = Path(path).resolve()
    return _sha256(path, path.stat().st_mtime_ns, path.stat().st_size)


@functools.cache  # a file is read once per change
def _sha256(path, mtime_ns, size):
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def describe(cfg):
    """The header line of a run: what it is and every setting it resolved to."""
    split = " (validation split)" if cfg.validation else ""
    text = (f"{variant_name(cfg.method, cfg.variant)} | {cfg.scenario} | {cfg.dataset}{split} | {cfg.model} | "
            f"seed {cfg.seed} | {cfg.device} | {cfg.n_per_class or 'all'} per class, {cfg.classes_per_task} "
            f"per task | lr {cfg.lr:g}, {cfg.epochs} epochs, batch {cfg.batch_size}"
            + {"all": "", "new": ", CE over the new classes", "local": ", local CE"}[cfg.ce_scope])
    text += "".join(f", {k} {v:g}" for k, v in cfg.hp.items())
    if cfg.variant != "base":
        values = [f"{k} {getattr(cfg, k):g}" if isinstance(getattr(cfg, k), float) else f"{k} {getattr(cfg, k)}"
                  for k in RECL_FIELDS if getattr(cfg, k) is not None]
        paper = next(changes for name, _, changes in rows() if name == "paper")
        except_ = [k for k, v in paper.items() if cfg.paper and getattr(cfg, k) != v]
        text += (" | " + ("" if not cfg.paper else f"the paper as written, except {', '.join(except_)}: "
                          if except_ else "the paper as written: ") + ", ".join(values))
    by = {}  # where each value that is not Config's default came from
    for k, source in cfg.set_by.items():
        by.setdefault(source, []).append(k)
    by_source = "; ".join(f"{s}: {', '.join(ks)}" for s, ks in by.items())
    return text + f" | set by {by_source}; the rest Config's defaults, set for the MLP | config {digest(cfg)}"
