"""The command line: its flags, the checks made before anything trains, one-line errors,
and results on disk (atomic writes, and what made them)."""
import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

import config
import data
import judging
import models
import recl
import strategies
from config import RECL_FIELDS

# =============================================================================
# The flags
# =============================================================================

class UsageError(Exception):
    """Bad command-line input; printed as one line."""


class RunFailed(Exception):
    """A run finished without usable numbers (it diverged); printed as one line."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # whole names only: run_all.sh reads flags by them (--ou is not --out)
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):  # one line instead of usage + message
        if "--variant: invalid choice: 'inversion'" in message:  # the tables call it a variant
            message += "; the inversion control is --variant recl --rec-objective inversion"
        raise UsageError(message)


def images_per_class(text):
    return text if text == "all" else int(text)


def method_hyperparameter(text):
    key, sep, value = text.partition("=")
    try:
        return key, float(value) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


# Flags that only the +ReCL variants use, by their config names, and those the control does not.
RECL_FLAGS = [k for k in RECL_FIELDS if k != "budget"] + ["paper", "rec_objective", "save_images"]
NOT_FOR_INVERSION = list(config.CONTROL)


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


def default_of(flag):
    """A flag's default as config.py writes it, once: Config's value, then each row that changes it."""
    field, show = flag.replace("-", "_"), lambda v: f"{v:g}" if isinstance(v, float) else str(v)
    value = getattr(config.Config(), field)
    changed = [f"{name} {show(changes[field])}" for name, _, changes in config.rows()
               if field in changes and changes[field] is not None]
    value = "--n-per-class, or 100 with all" if value is None and field == "m" else "all" if value is None else value
    return (f"(default: {show(value)}"
            + (f"; rows: {', '.join(changed)}" if changed else "") + ")")


DESCRIPTION = ("Train a continual-learning method with and without ReCL (reconstruction of old data from the "
               "model) on a stream of tasks, and report ACC and BWT. Default: SplitMNIST from the shipped MNIST "
               "subset. Defaults not shown: config.py.")


def make_parser(prog="recl.py", description=DESCRIPTION):
    """Every flag a row may change defaults to None, "not given": `resolve` fills in config.py's values."""
    p = Parser(prog=prog, description=description)
    C = config.Config  # the defaults, written once there
    p.add_argument("--scenario", choices=["cil", "dil"], default=C.scenario,
                   help="class-incremental (a growing head) or domain-incremental (the same labels every task)")
    p.add_argument("--method", choices=config.METHODS, default=C.method, help="the continual-learning method")
    p.add_argument("--variant", choices=["both", "base", "recl"],
                   help="the method alone, with ReCL, or both on the same seeds (default: both)")
    p.add_argument("--dataset", default=C.dataset, help=f"one of {', '.join(data.DATASETS)}, or a .pt file")
    p.add_argument("--data-root", help="where mnist-full, fashion-mnist, cifar10, tinyimagenet live "
                                       f"(default: {C.data_root}; mnist and .pt files do not use it)")
    p.add_argument("--classes-per-task", type=int, help=f"classes per task {default_of('classes_per_task')}")
    p.add_argument("--model", choices=models.MODELS, default=C.model,
                   help="the paper's homogeneous MLP or CNN, or a non-homogeneous AlexNet/ResNet18")
    p.add_argument("--seeds", type=int, help="number of seeds, each its own class order and init (default: 1)")
    p.add_argument("--seed", type=int, default=C.seed, help=f"first seed (default: {C.seed})")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, help="epochs per task (default: the method's rows)")
    g.add_argument("--lr", type=float, help="SGD learning rate (default: the method's rows)")
    g.add_argument("--batch-size", type=int, help=f"training batch size {default_of('batch_size')}")
    g.add_argument("--n-per-class", type=images_per_class,
                   help=f"training images per class, or 'all' {default_of('n_per_class')}")
    g.add_argument("--validation", action="store_true", default=None,
                   help="score on 20%% of each task's training images, held out, not on the test set")
    g.add_argument("--ce-scope", choices=["all", "new", "local"],
                   help="CIL: the cross-entropy of the task's own images over all classes, or over its new classes "
                        "only, so that they never push down old classes, or local: also replayed rows over the old "
                        f"classes only, and old against new learned by the head alone {default_of('ce-scope')}")
    p.add_argument("--hp", type=method_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
                   help="a method hyperparameter, e.g. --hp ewc_lambda=1000 (default: the method's rows)")
    g = p.add_argument_group("reconstruction (the +ReCL variant only; each default is config.Config's, and "
                             "the rows of config.ROWS named after it change it)")
    flag = lambda name, meaning, **kw: g.add_argument(f"--{name}", help=f"{meaning} {default_of(name)}", **kw)
    flag("m", "candidates per old class (in DIL per class and old task)", type=int)
    flag("n-rec", "reconstruction steps before each task", type=int)
    flag("sigma-x", "std of the initial random candidates", type=float)
    g.add_argument("--rec-objective", choices=["stationarity", "inversion"],
                   help="Eq. 3-6, or plain model inversion, the control (default: stationarity)")
    flag("lr-x", "step size for the candidates", type=float)
    flag("lr-lambda", "step size for the coefficients lambda_i", type=float)
    flag("lambda-min", "Eq. 4 pushes each lambda_i above this", type=float)
    flag("alpha", "sharpness of the smooth ReLU backward", type=float)
    flag("rec-target", "what Eq. 3 fits: theta as written, or theta - theta_0", choices=["weights", "displacement"])
    flag("freeze-old", "classes reconstructed before keep their candidates, fixed",
         action=argparse.BooleanOptionalAction)
    flag("filter", "train only on candidates the model classifies as their label",
         action=argparse.BooleanOptionalAction)
    flag("replay-noise", "std of the fresh noise on replayed reconstructions, in pixel stds of the task",
         type=float)
    flag("replay-batch", "each training step adds this many reconstructions, drawn at random, to a batch of the "
         "task's own images, and an epoch is one pass over those; 0: they join the task's data, as the paper",
         type=int)
    flag("backtrack", "a reconstruction step that raises the loss is undone and the step sizes halved",
         action=argparse.BooleanOptionalAction)
    flag("ce-weight", "weight of inversion's cross-entropy added to Eq. 6", type=float)
    flag("rec-optimizer", "the optimiser of the candidates and lambdas: SGD, as the paper (with momentum), or Adam, "
         "as image inversion on conv nets", choices=["sgd", "adam"])
    g.add_argument("--paper", action="store_true", default=None,
                   help="the paper as written: every departure off (config.ROWS' paper row), the method's own "
                        "training budget; explicit flags win")
    flag("rec-precision", "number format of the reconstruction's products (auto: bfloat16 where the CPU has it)",
         choices=["auto", "float32", "bfloat16"])
    flag("tuning", "the run's values (naive), or a search per task scored by the final L_full (unsup) or by SSIM "
         "to a few stored real images (sup) (Sec. 4.3)", choices=["naive", "unsup", "sup"])
    flag("trials", "random-search trials per task, with --tuning unsup or sup", type=int)
    g.add_argument("--save-images", action="store_true", default=None,
                   help="per task, a PNG of real images over their nearest reconstructions, and a .pt of them")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help=f"auto: CUDA when present {default_of('device')}")
    p.add_argument("--out", default="results", help="folder for one JSON file per run (default: results)")
    p.add_argument("--quiet", action="store_true", help="print only one line per finished run")
    p.add_argument("--skip-done", action="store_true",
                   help="skip a run whose result file exists, diverged or not (run_all's lists carry it, so a list can "
                        "be rerun; a change of code is not detected)")
    return p


def given(args, name):
    """Whether the command line set flag `name`: every flag it may refuse defaults to None."""
    return getattr(args, name, None) is not None


def check(args, probe_out=True):
    """Refuse, in one line, what makes no sense or would do nothing, before any work starts.
    Fills args.hp as a dict of typed values. `probe_out`: also check that --out takes files."""
    positive = {"batch-size": args.batch_size, "seeds": args.seeds, "epochs": args.epochs, "lr": args.lr,
                "n-per-class": None if args.n_per_class == "all" else args.n_per_class,
                "classes-per-task": args.classes_per_task, "m": args.m,
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
    if not 0 <= args.seed or args.seed + (args.seeds or 1) > MAX_SEED:
        raise UsageError(f"--seed must be >= 0, and --seed plus --seeds at most {MAX_SEED}, got {args.seed}")
    if (args.seeds or 1) > MAX_SEEDS:
        raise UsageError(f"--seeds {args.seeds} is more than {MAX_SEEDS}, more runs than a table needs")
    for flag, most in MAX_STEP.items():
        if positive[flag] is not None and positive[flag] > most:
            raise UsageError(f"--{flag} {positive[flag]:g} is above {most:g}, far beyond any step that trains here")
    for flag, most in MAX_COUNT.items():
        if positive[flag] is not None and positive[flag] > most:
            raise UsageError(f"--{flag} {positive[flag]} is more than {most:,}: far beyond what any run here uses")
    if not str(args.out).strip():
        raise UsageError("--out is empty; it must name a folder")
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
    too_many = args.n_per_class == "all" or (args.n_per_class or 0) > most
    if args.dataset == "mnist" and too_many:
        raise UsageError(f"--n-per-class {args.n_per_class} is more than mnist allows "
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


MAX_SEED, MAX_SEEDS = 2 ** 31, 1000  # beyond them a seed overflows, a queue never ends
MAX_STEP = {"lr": 10.0, "lr-x": 1000.0, "lr-lambda": 1000.0}  # sanity caps: far above what trains, below overflow
MAX_COUNT = {"epochs": 10_000, "n-rec": 100_000, "trials": 1000}  # far beyond any study here, far short of forever


# Numbers held per input, as multiples of those its layers output: measured on the CNN, a reconstruction
# step and a training step (docs/cost.md, "Memory"), rounded up.
STEP_COPIES, TRAIN_COPIES = 4, 2


def layer_outputs(net, shape):
    """How many numbers the network's layers output for one input of `shape`."""
    sizes = []
    hooks = [m.register_forward_hook(lambda m, i, out: sizes.append(out.numel())) for m in net.modules()
             if not list(m.children())]
    try:
        with torch.no_grad():
            net.eval()(torch.zeros(1, *shape))
    finally:
        for hook in hooks:
            hook.remove()
    return sum(sizes)


def memory_available(device):
    """Bytes a run may fill: the GPU's free memory, or the machine's physical memory."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_tasks(tasks, cfg):
    """What must hold before the first task trains: a network that takes the data's images, the
    memory the run will fill, and training and test images for every class of every task."""
    shape = tasks[0].x_train.shape[1:]
    try:
        net = models.build_model(cfg.model, shape, len(tasks[0].classes))
    except ValueError as err:
        raise UsageError(f"--model {cfg.model}: {err}") from None
    if cfg.variant != "base":  # the most a run will hold, against the memory there is (docs/cost.md, "Memory")
        numel, per_task = shape.numel(), len(tasks[0].classes)
        last, acts = per_task * (len(tasks) - 1), layer_outputs(net, shape)
        # the most candidates one backward pass goes through: with --freeze-old, each step the newest classes' and,
        # once before the steps, the kept ones'; without it, all of them each step
        in_pass = cfg.m * (max(per_task, last - per_task) if cfg.freeze_old else last)
        batch = cfg.replay_batch + cfg.batch_size
        for what, rows, need in ((f"--m {cfg.m} candidates per class", cfg.m * last,
                                  cfg.m * last * numel + in_pass * STEP_COPIES * acts),
                                 (f"--replay-batch {cfg.replay_batch} with --batch-size {cfg.batch_size}", batch,
                                  batch * (numel + TRAIN_COPIES * acts))):
            need, have = 4 * need, memory_available(cfg.device)
            if need > have:
                raise UsageError(f"{what}: {rows:,} images of {numel:,} numbers and their activations need about "
                                 f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of {cfg.device} "
                                 "memory")
    split = "validation" if cfg.validation else "test"
    for t, task in enumerate(tasks):
        for label, c in enumerate(task.classes):
            own = label if cfg.scenario == "dil" else label + t * len(task.classes)
            for name, y in (("training", task.y_train), (split, task.y_test)):
                if not (y == own).any():
                    raise UsageError(f"{cfg.dataset}: class {c} of task {t + 1} has no {name} images" + (
                        " left: --validation holds out a fifth of them; give a larger --n-per-class"
                        if cfg.validation else ""))


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
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
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


# =============================================================================
# main: one config per run, checked before anything trains
# =============================================================================

def make_tasks(cfg):
    """The run's tasks (its validation split with --validation), class order, mean image,
    and the classes no task holds."""
    tasks, order, mean_image, left_out = data.make_tasks(cfg.dataset, cfg.seed, cfg.n_per_class, cfg.scenario,
                                                         cfg.classes_per_task, cfg.data_root)
    if cfg.validation:
        tasks = data.validation_split(tasks, 0.2, cfg.seed)
    return tasks, order, mean_image, left_out


def main(argv=None):
    """Run a method (and/or its +ReCL variant) over `--seeds` seeds; one JSON file per run."""
    args = make_parser().parse_args(argv)
    provenance()  # the code this process loaded, named now: a commit made while it runs is not it
    check(args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    runs = [config.resolve(args, seed, variant) for seed in range(args.seed, args.seed + (args.seeds or 1))
            for variant in config.variants(args)]
    for i, cfg in enumerate(runs):  # each seed's data and each run's memory, checked before any task trains
        if i == 0 or cfg.seed != runs[i - 1].seed:
            tasks, _, _, left_out = make_tasks(cfg)
            if left_out:  # the class order decides which; the run's JSON records them
                print(f"note: seed {cfg.seed} leaves out class(es) {left_out}: they fill no whole task of "
                      f"{cfg.classes_per_task} classes", flush=True)
        check_tasks(tasks, cfg)
    results, failed, loaded = {}, [], None
    for cfg in runs:
        name, path = config.variant_name(cfg.method, cfg.variant), config.result_path(args.out, cfg)
        if args.skip_done and path.exists():
            print(f"{name} {cfg.scenario} seed {cfg.seed}: done before, skipped -> {path}", flush=True)
            continue
        if loaded is None or loaded[0] != cfg.seed:
            loaded = (cfg.seed, *make_tasks(cfg))
        _, tasks, class_order, mean_image, left_out = loaded
        log(f"{config.describe(cfg)} | class order {class_order}")
        image_path = path if args.save_images else None  # the images are named like the JSON
        judge = lambda old, x_rec, y_rec: judging.report_reconstruction(name, old, x_rec, cfg, mean_image, image_path,
                                                                        log, y_rec)
        record = recl.run_continual(cfg, tasks, log, judge, mean_image)
        record.update(dataset=config.dataset_name(cfg.dataset), class_order=class_order, classes_left_out=left_out,
                      config=dataclasses.asdict(cfg), digest=config.digest(cfg), provenance=provenance(),
                      **({"dataset_sha256": config.file_sha256(cfg.dataset)} if cfg.dataset.endswith(".pt") else {}))
        write_json_atomically(path, record)
        if record["diverged"]:
            failed.append(f"{name} {cfg.scenario} seed {cfg.seed} diverged: {record['diverged']} "
                          f"(lr {cfg.lr:g}); marked so in {path}, never averaged")
            continue
        bwt = "n/a" if record["BWT"] is None else f"{record['BWT']:.2f}"
        flagged = record["failed_reconstructions"]
        print(f"{name} {cfg.scenario} seed {cfg.seed}: ACC {record['ACC']:.2f} BWT {bwt} in {record['seconds']:.0f}s"
              + (f", {flagged} of {len(record['reconstructions'])} reconstructions FLAGGED (see the "
                 f"{'JSON' if args.quiet else 'log'})" if flagged else "") + f" -> {path}"
              + (" (and its images, named like it)" if args.save_images else ""), flush=True)
        results.setdefault(name, []).append(record["ACC"])
    for name, accs in results.items():
        if len(accs) > 1:
            log(f"{name}: mean ACC {sum(accs) / len(accs):.2f} over {len(accs)} seeds "
                f"(tables: python experiments.py aggregate {args.out})")
    if failed:
        raise RunFailed("; ".join(failed))
