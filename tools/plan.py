"""run_all.sh's list, from `python tools/plan.py [recl.py flags]` and the knobs in the environment: the results folder,
then one command per run asked for, each checked before any runs, less those whose result file exists."""
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402


# run_all's variants, as recl.py's flags: the method alone, alone at +ReCL's budget, and the four replay arms
VARIANTS = {"base": ["--variant", "base"], "budget": ["--variant", "base", "--budget", "recl"],
            "recl": ["--variant", "recl"], "inversion": ["--variant", "recl", "--replay-source", "inversion"],
            "real": ["--variant", "recl", "--replay-source", "real"],
            "centroids": ["--variant", "recl", "--replay-source", "centroids"]}


def knob(name, default, allowed=None):
    words = os.environ.get(name, default).split()
    if not words:
        raise config.UsageError(f"{name} is empty; it takes some of: {' '.join(allowed or [])}")
    for word in (w for w in words if allowed and w not in allowed):
        raise config.UsageError(f'{name}="{os.environ[name]}": {word} is not one of: {" ".join(allowed)}')
    return words


def number(name, default, most):
    text = os.environ.get(name, str(default))
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise config.UsageError(f'{name} must be a whole number from 1 to {most}, got "{text}"')
    return int(text)


def flags_of(settings):
    """Command-line words for {dest: value}, as make_parser reads them."""
    for dest, value in settings.items():
        flag = "--" + dest.replace("_", "-")
        yield from ([w for k, v in value for w in (flag, f"{k}={v:g}")] if dest == "hp"
                    else [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)])


def plan(argv, cwd):
    # run_all sets these per run
    own = "--out --method --variant --scenario --dataset --seed --seeds --replay-source --budget --data-root".split()
    for word in (w.split("=")[0] for w in argv if w.split("=")[0] in own):
        raise config.UsageError(f"{word} is run_all's to set per run: use its knobs")
    parser = config.make_parser()
    given = {k: v for k, v in vars(parser.parse_args(argv)).items()  # the same for any spelling
             if v not in (None, parser.get_default(k)) and k not in ("quiet", "skip_done")}  # every line has them
    for name in (n for n in ("QUICK", "DRY_RUN") if os.environ.get(n, "0") not in ("0", "1")):
        raise config.UsageError(f'{name} must be 0 or 1, got "{os.environ[name]}"')
    quick, devices = os.environ.get("QUICK") == "1", os.environ.get("DEVICES", "").split()
    seeds, jobs = number("SEEDS", 1 if quick else 5, 1000), number("JOBS", max(1, len(devices)), 4 * os.cpu_count())
    first = os.environ.get("FIRST_SEED", "0")  # seeds FIRST_SEED, ..., FIRST_SEED + SEEDS - 1
    if not first.isdigit() or int(first) + seeds > 2 ** 31:
        raise config.UsageError(f'FIRST_SEED must be a whole number from 0, got "{first}"')
    first = int(first)
    if not all(d.isdigit() for d in devices) or len(devices) > jobs:
        raise config.UsageError(f'DEVICES lists GPU numbers, at most JOBS={jobs} of them, like "0 1"; got "'
                                f'{os.environ.get("DEVICES")}"')
    if devices and os.environ.get("DRY_RUN") == "1":
        raise config.UsageError("DEVICES places run_all's own workers; DRY_RUN=1 only lists runs")
    methods = knob("METHODS", " ".join(config.METHODS), config.METHODS)
    scenarios = knob("SCENARIOS", "cil dil", ["cil", "dil"])
    variants = knob("VARIANTS", " ".join(VARIANTS), list(VARIANTS))
    datasets = [str(cwd / d) if d.endswith(".pt") else d for d in knob("DATASETS", "mnist")]
    for d in (d for d in datasets if not d.endswith(".pt") and d not in data.DATASETS):
        raise config.UsageError(f"DATASETS: {d} is not one of: {' '.join(data.DATASETS)}")
    for k in (k for k in given if k in config.RECL_FLAGS and set(variants) == {"base"}):
        raise config.UsageError(f"--{k.replace('_', '-')} applies to the +ReCL variants, and VARIANTS has none")
    name = "_".join(["quick"] * quick + [w.lstrip("-") for w in flags_of(given)])
    out = cwd / os.environ.get("RESULTS", "results/" + "".join(c if c.isalnum() or c in ".=-" else "_" for c in name))
    config.check_writable(out)
    runs = [(s, m, v, seed) for s in scenarios for m in methods for v in variants if m != "joint" or v == "base"
            for seed in range(first, first + seeds)]
    asked = {**({"epochs": 5, "n_rec": 20} if quick else {}), **given}  # QUICK's, where no flag says
    root, lines, loaded = str(cwd / os.environ.get("DATA_ROOT", "data")), [], []
    for dataset in datasets:
        try:
            loaded.append(data.load(dataset, root))
        except data.DataError as err:
            if dataset.endswith(".pt"):
                raise config.UsageError(f"{dataset}: {err}") from None
            print(f"run_all: skipping {dataset}: {err}", file=sys.stderr)
            continue
        for scenario, method, variant, seed in runs:
            base = variant in ("base", "budget")  # joint is the method alone too
            settings = {k: v for k, v in asked.items() if not (base and k in config.RECL_FLAGS)  # what this run takes
                        and not (variant == "inversion" and k in config.CONTROL)
                        and not (variant in ("real", "centroids") and k in config.STORED)
                        and not (k == "ce_scope" and (scenario == "dil" or method == "joint" or base and v == "local"))}
            words = (["--dataset", dataset, "--scenario", scenario, "--method", method]
                     + ([] if method == "joint" else VARIANTS[variant])
                     + ([] if dataset == "mnist" or dataset.endswith(".pt") else ["--data-root", root])
                     + ["--seed", str(seed), "--out", str(out), "--quiet", "--skip-done", *flags_of(settings)])
            args = parser.parse_args(words)
            try:
                config.check(args, probe_out=False)
            except config.UsageError as err:
                raise config.UsageError(f"{err} (nothing was run; refused: {method} {variant} {scenario})")
            if not all(config.result_path(out, config.resolve(args, seed, v)).exists() for v in config.variants(args)):
                lines.append(shlex.join([os.environ.get("PYTHON", "python"), "recl.py", *words]))
    if not loaded:
        raise config.UsageError("no dataset asked for can be loaded (why above): nothing was run")
    print(f"run_all: {len(lines)} run{'s' * (len(lines) != 1)} to do in {out}/ with {jobs} job(s)", file=sys.stderr)
    return [str(out)] + lines


if __name__ == "__main__":
    config.run_from_command_line(lambda: print("\n".join(plan(sys.argv[1:], Path.cwd()))), "run_all")
