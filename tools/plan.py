"""run_all.sh's list: every run its knobs and flags ask for, each checked before any runs,
less those whose result file exists. Prints the results folder on the first line, then one
runnable command per run left to do (run them from the repository's folder).

    python tools/plan.py [recl.py flags]     knobs from the environment, as run_all.sh documents
"""
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402

OWN = ("--out", "--method", "--variant", "--scenario", "--dataset", "--seed", "--seeds", "--rec-objective",
       "--data-root")  # what run_all sets per run


def knob(name, default, allowed=None):
    """A knob's words, each one of `allowed` if given; one line and exit 2 otherwise."""
    words = os.environ.get(name, default).split()
    if not words:
        raise config.UsageError(f"{name} is empty; it takes some of: {' '.join(allowed or [])}")
    for word in words if allowed else ():
        if word not in allowed:
            raise config.UsageError(f'{name}="{os.environ[name]}": {word} is not one of: {" ".join(allowed)}')
    return words


def number(name, default, most):
    text = os.environ.get(name, str(default))
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise config.UsageError(f'{name} must be a whole number from 1 to {most}, got "{text}"')
    return int(text)


def flags_of(settings):
    """Command-line words for {dest: value}, as make_parser reads them."""
    words = []
    for dest, value in settings.items():
        flag = "--" + dest.replace("_", "-")
        if dest == "hp":
            words += [w for k, v in value for w in ("--hp", f"{k}={v:g}")]
        elif value is True or value is False:
            words += [flag if value else "--no-" + flag[2:]]
        else:
            words += [flag, str(value)]
    return words


def plan(argv, env_cwd):
    parser = config.make_parser()
    for word in argv:
        if word.split("=")[0] in OWN:
            raise config.UsageError(f"{word.split('=')[0]} is run_all's to set per run: use its knobs")
    asked, plain = vars(parser.parse_args(argv)), vars(parser.parse_args([]))
    given = {k: v for k, v in asked.items() if v != plain[k] and v is not None  # the same for any spelling
             and k not in ("quiet", "skip_done")}  # every line has them
    for name in ("QUICK", "DRY_RUN"):
        if os.environ.get(name, "0") not in ("0", "1"):
            raise config.UsageError(f'{name} must be 0 or 1, got "{os.environ[name]}"')
    quick = os.environ.get("QUICK", "0") == "1"
    seeds = number("SEEDS", 1 if quick else 5, 1000)
    jobs = number("JOBS", max(1, len(os.environ.get("DEVICES", "").split())), 4 * os.cpu_count())
    devices = os.environ.get("DEVICES", "").split()
    if not all(d.isdigit() for d in devices) or len(devices) > jobs:
        raise config.UsageError(f'DEVICES lists GPU numbers, at most JOBS={jobs} of them, like "0 1"; got "'
                                f'{os.environ.get("DEVICES")}"')
    if devices and os.environ.get("DRY_RUN") == "1":
        raise config.UsageError("DEVICES places run_all's own workers; DRY_RUN=1 only lists runs")
    methods, scenarios = knob("METHODS", " ".join(config.METHODS), config.METHODS), knob("SCENARIOS", "cil dil",
                                                                                         ["cil", "dil"])
    variants = knob("VARIANTS", "base recl inversion", ["base", "recl", "inversion"])
    datasets = [str(env_cwd / d) if d.endswith(".pt") else d for d in knob("DATASETS", "mnist")]
    for d in datasets:
        if not d.endswith(".pt") and d not in data.DATASETS:
            raise config.UsageError(f"DATASETS: {d} is not one of: {' '.join(data.DATASETS)}")
    if not set(variants) - {"base"} and any(k in config.RECL_FLAGS for k in given):
        raise config.UsageError(f"--{next(k for k in given if k in config.RECL_FLAGS).replace('_', '-')} applies "
                                "to the +ReCL variants, and VARIANTS has none")
    root = str(env_cwd / os.environ.get("DATA_ROOT", "data"))
    name = "_".join(w.lstrip("-") for w in flags_of(given)).replace(" ", "_")
    name = "_".join(filter(None, ["quick" if quick else "", "".join(c if c.isalnum() or c in ".=-" else "_"
                                                                       for c in name)]))
    results = env_cwd / os.environ.get("RESULTS", "results" + (f"/{name}" if name else ""))
    config.check_writable(results)
    lines, loadable, count = [], {}, 0
    for dataset in datasets:
        try:
            loadable[dataset] = data.load(dataset, root) is not None
        except data.DataError as err:
            if dataset.endswith(".pt"):
                raise config.UsageError(f"{dataset}: {err}") from None
            print(f"run_all: skipping {dataset}: {err}", file=sys.stderr)
            continue
        for scenario, method, variant in ((s, m, v) for s in scenarios for m in methods for v in variants):
            if method == "joint" and variant != "base":
                continue
            base = method == "joint" or variant == "base"
            settings = {**({"epochs": 5} if quick else {}), **({"n_rec": 20} if quick and not base else {}),
                        **{k: v for k, v in given.items() if not (base and k in config.RECL_FLAGS)
                           and not (variant == "inversion" and k in config.CONTROL)
                           and not (k == "ce_scope" and (scenario == "dil" or method == "joint"
                                                         or (base and v == "local")))}}
            words = (["--dataset", dataset, "--scenario", scenario, "--method", method]
                     + ([] if method == "joint" else ["--variant", "base" if base else "recl"])
                     + (["--rec-objective", "inversion"] if variant == "inversion" else [])
                     + ([] if dataset == "mnist" or dataset.endswith(".pt") else ["--data-root", root]))
            for seed in range(seeds):
                argv_ = words + ["--seed", str(seed), "--out", str(results), "--quiet", "--skip-done"]
                args = parser.parse_args(argv_ + flags_of(settings))
                try:
                    config.check(args, probe_out=False)
                except config.UsageError as err:
                    raise config.UsageError(f"{err} (nothing was run; refused: {method} {variant} {scenario})")
                if not all(config.result_path(results, config.resolve(args, seed, v)).exists()
                           for v in config.variants(args)):
                    count += 1
                    lines.append(shlex.join([os.environ.get("PYTHON", "python"), "recl.py", *argv_,
                                             *flags_of(settings)]))
    if not loadable:
        raise config.UsageError("no dataset asked for can be loaded (why above): nothing was run")
    print(f"run_all: {count} run{'s' * (count != 1)} to do in {results}/ with {jobs} job(s)", file=sys.stderr)
    return [str(results)] + lines


if __name__ == "__main__":
    config.run_from_command_line(lambda: print("\n".join(plan(sys.argv[1:], Path.cwd()))), "run_all")
