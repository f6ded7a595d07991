"""What produces this project's tables, beside the method in recl.py.

    python experiments.py aggregate DIR     the table of the runs in DIR (mean (std) over
                                            seeds), DIR/chart-DATASET.svg, and the accuracy
                                            matrix of each method, DIR/matrix-*.svg
    python experiments.py tune RECL-FLAGS   choose a method's lr, epochs and own settings on
                                            validation data (paper App. D.3), e.g.
                                            python experiments.py tune --method ewc --scenario cil
    python experiments.py benchmark         what ReCL costs: one reconstruction step, and a
                                            whole run against its base method
    python experiments.py pending           (for run_all.sh) which command lines on stdin
                                            have no current result
    python experiments.py queue DIR         (for run_all.sh) a worker that runs the command
                                            lines in DIR/commands that no other worker took

Nothing here changes what a run computes: every run is `recl.main`, or for
`tune` `recl.run_continual` on a validation split.
"""
import argparse
import itertools
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import data
import models
import recl
import strategies
import cli
from cli import METHODS, RunFailed, UsageError, write_atomically, write_json_atomically
from recl import variant_name

# =============================================================================
# 1. For run_all.sh: is a finished run still what would run now? And workers that run the rest
# =============================================================================
# A result counts only if its recorded config equals what the same command would
# use today, so a change of a default (or of strategies.TUNED) reruns the runs it
# affects instead of mixing old and new settings in one table. Flags that do not
# change the numbers are left out of the comparison; so is the machine (CPU and
# GPU give the same results up to seed noise, and the JSON's "provenance" says
# which made it). A change of code without a change of settings is not detected:
# the provenance's commit records it. A setting added after a run was made
# counts as what the code did before it existed (ADDED_LATER).

ADDED_LATER = {"rec_objective": "stationarity", "ce_weight": 0.0, "paper": False}
NOT_SETTINGS = {"device", "out", "quiet", "seeds", "variant", "data_root", "save_images",
                "aggregate", "pending", "queue", "tune"}  # the last four: old recl.py flags in stored configs


def settings_of(config):
    """The part of a run's config that decides its numbers, JSON-normalised."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_SETTINGS}))


def differences(old, new):
    keys = sorted(set(old) | set(new), key=str)
    return ", ".join(f"{k} {old.get(k, 'unset')} -> {new.get(k, 'unset')}" for k in keys if old.get(k) != new.get(k))


def command_args(line):
    """('run', ARGS) for `... recl.py ARGS`, ('tune', ARGS) for `... experiments.py tune ARGS`,
    None for any other line."""
    words = shlex.split(line)
    for at, word in enumerate(words):
        if word.endswith("recl.py"):
            return "run", words[at + 1:]
        if word.endswith("experiments.py") and words[at + 1:at + 2] == ["tune"]:
            return "tune", words[at + 2:]
    return None


def pending_runs(lines, report=print):
    """The command lines (each one run, or one search) whose result is missing or stale."""
    todo = []
    for line in lines:
        command = command_args(line)
        if command is None:
            continue
        kind, args = command
        try:
            cfg = cli.make_parser().parse_args(args)
            cli.check_args(cfg)
        except UsageError:  # let the run itself say what is wrong
            todo.append(line)
            continue
        if kind == "tune":
            if not tuning_path(cfg).exists():
                todo.append(line)
            continue
        use_recl = with_recl(cfg)
        path = recl.result_path(cfg.out, cfg, cfg.method, use_recl, cfg.seed)
        if not path.exists():
            todo.append(line)
            continue
        try:
            recorded = settings_of(json.loads(path.read_text()).get("config", {}))
        except (OSError, ValueError):
            recorded = {}
        wanted = settings_of(vars(recl.run_settings(cfg, cfg.seed, use_recl)))
        if recorded:  # a setting added after the run was made: the run had what the code did before
            recorded = {**ADDED_LATER, **recorded}
        if recorded != wanted:
            report(f"stale: {path} ({differences(recorded, wanted) or 'no settings recorded'})")
            todo.append(line)
    return todo


def work_through_queue(folder):
    """queue: run the command lines in FOLDER/commands in this process, each one that no
    other worker on FOLDER has claimed.

    Why: starting a process costs about 4 s here (importing torch and
    torch._dynamo, then parsing the MNIST CSV), as long as a whole Finetune run.
    run_all.sh therefore starts JOBS workers on one list instead of one process
    per run. A worker claims run i by creating FOLDER/claimed-i, which succeeds
    for one process only, so runs are handed out one at a time and the workers
    finish together. Every run seeds itself, so it gives what it would give
    alone; a run that fails says so in one line and the rest still run.
    """
    if not (Path(folder) / "commands").is_file():
        raise UsageError(f"queue {folder}: there is no file {Path(folder) / 'commands'}")
    lines = (Path(folder) / "commands").read_text().splitlines()
    failed = []
    for number, line in enumerate(lines):
        command = command_args(line)
        if command is None:
            continue
        try:
            os.close(os.open(Path(folder) / f"claimed-{number}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue  # another worker has it
        kind, args = command
        try:
            recl.main(args) if kind == "run" else tune(args)
        except (UsageError, RunFailed, data.DataError) as err:
            print(f"experiments.py: error: {err} ({line})", file=sys.stderr, flush=True)
            failed.append(line)
    if failed:
        raise RunFailed(f"{len(failed)} queued run(s) failed, each named above")


# =============================================================================
# 2. Tables and a chart from the results files
# =============================================================================

def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_name(record):
    tuning = record.get("config", {}).get("tuning", "naive")
    objective = record.get("config", {}).get("rec_objective", "stationarity")
    name = variant_name(record["method"], record["recl"], objective)
    return name + ("" if tuning == "naive" or not record["recl"] else f" ({tuning})")


def summary_table(records):
    """Markdown: one row per method variant, mean(std) over seeds as in the paper's tables,
    with the reconstructions' mean nearest-pair SSIM and seconds for the variants that make
    them. Diverged runs are listed under the table and never averaged."""
    rows = ["| method | seeds | ACC | BWT | SSIM | reconstruction s | seconds |", "|---|---|---|---|---|---|---|"]
    finished = [r for r in records if not r.get("diverged")]

    def cell(values, digits=2):
        return "" if not values or None in values else "{:.{d}f} ({:.{d}f})".format(*mean_std(values), d=digits)

    for name in dict.fromkeys(run_name(r) for r in finished):
        runs = [r for r in finished if run_name(r) == name]
        ssim_ = [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs if r.get("recon_quality")]
        rec_s = [r["phase_seconds"]["reconstruct"] for r in runs if r["recl"] and "phase_seconds" in r]
        seconds = statistics.mean(r["seconds"] for r in runs)
        rows.append(f"| {name} | {len(runs)} | {cell([r['ACC'] for r in runs])} | "
                    f"{cell([r['BWT'] for r in runs]) or 'n/a'} | {cell(ssim_, 3)} | {cell(rec_s, 1)} | "
                    f"{seconds:.1f} |")
    rows += [f"\nDiverged, not averaged: {run_name(r)} seed {r['seed']} ({r['diverged']})"
             for r in records if r.get("diverged")]
    return "\n".join(rows)


def method_rank(method):
    """Tables and charts list the methods in the paper's order; unknown ones last."""
    return METHODS.index(method) if method in METHODS else len(METHODS)


def with_recl(cfg):
    """Whether a one-variant command line (a `tune`, or a queued run) means the +ReCL
    variant: --variant recl, and never for joint, which has nothing to reconstruct."""
    return cfg.variant == "recl" and cfg.method != "joint"


def tuning_table(searches):
    """Markdown: the setting each validation search chose, ready for strategies.TUNED."""
    rows = ["| dataset | scenario | method | chosen (validation) | val ACC | trials |", "|---|---|---|---|---|---|"]
    for r in sorted(searches, key=lambda r: (r["dataset"], r["scenario"], method_rank(r["method"]))):
        best = max(r["trials"], key=trial_score)
        chosen = ", ".join(f"{k} {v:g}" for k, v in best["settings"].items())
        score = "all diverged" if best["val_ACC"] is None else f"{best['val_ACC']:.2f}"
        rows.append(f"| {r['dataset']} | {r['scenario']} | {r['method']} | {chosen} | {score} | {len(r['trials'])} |")
    return "\n".join(rows)


def mixed_settings(records):
    """Warnings for table rows whose seeds were run with different settings."""
    warnings, groups = [], {}
    for r in records:
        if "config" in r:
            groups.setdefault((r["dataset"], r["scenario"], run_name(r)), []).append(r)
    for (dataset, scenario, name), runs in groups.items():
        seen = [settings_of({k: v for k, v in r["config"].items() if k != "seed"}) for r in runs]
        if any(s != seen[0] for s in seen):
            other = next(s for s in seen if s != seen[0])
            warnings.append(f"warning: {dataset} {scenario} {name} mixes runs made with different settings "
                            f"({differences(seen[0], other)}); rerun them with run_all.sh")
    return warnings


PAPER_ACC = {
    "cil": {"finetune": (50.34, 73.18), "ewc": (40.67, 68.13), "er": (68.59, 71.94), "upgd": (29.10, 70.10),
            "agem": (37.03, 63.31), "lwf": (50.56, 57.15), "gpm": (18.48, 39.25)},
    "dil": {"finetune": (82.23, 83.80), "ewc": (82.91, 84.48), "er": (84.00, 85.44), "upgd": (83.19, 82.95),
            "agem": (83.46, 84.00), "lwf": (83.62, 84.67), "gpm": (73.48, 75.29)},
}


CHART_VARIANTS = (("", "#9e9e9e", "method"), ("+recl", "#1f77b4", "+ReCL"), ("+inversion", "#ff7f0e", "+inversion"))


def chart_svg(records, dataset):
    """An SVG bar chart, written by hand: mean ACC per method alone (grey), with ReCL (blue)
    and with the inversion control (orange), one panel per scenario, whiskers of one std,
    and the paper's value as a black tick."""
    from xml.sax.saxutils import escape
    finished = [r for r in records if not r.get("diverged") and r["dataset"] == dataset
                and r.get("config", {}).get("tuning", "naive") == "naive"]
    scenarios = [s for s in ("cil", "dil") if any(r["scenario"] == s for r in finished)]
    panel_w, top, plot_h, bar_w = 430, 70, 240, 14
    y = lambda acc: top + plot_h * (1 - acc / 100)
    legend = "".join(f'<rect x="{10 + 90 * i}" y="28" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{24 + 90 * i}" y="37">{label}</text>' for i, (_, colour, label) in enumerate(CHART_VARIANTS))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel_w * len(scenarios) + 20}" height="{top + plot_h + 30}"'
             ' font-family="sans-serif" font-size="11">',
             f'<text x="10" y="18" font-size="14">{escape(dataset)}: mean ACC over seeds</text>', legend,
             '<line x1="280" y1="33" x2="294" y2="33" stroke="black" stroke-width="3"/>'
             '<text x="298" y="37">the paper (Tables 1, 2)</text><text x="440" y="37">whiskers: one std</text>']
    for p, scenario in enumerate(scenarios):
        x0 = 20 + 30 + p * panel_w
        runs = [r for r in finished if r["scenario"] == scenario]
        methods = sorted({r["method"] for r in runs}, key=method_rank)
        group_w = (panel_w - 50) / max(1, len(methods))
        parts.append(f'<text x="{x0}" y="{top - 12}" font-weight="bold">{scenario.upper()}</text>')
        for tick in range(0, 101, 20):
            parts.append(f'<line x1="{x0 - 4}" y1="{y(tick):.1f}" x2="{x0 + panel_w - 50}" y2="{y(tick):.1f}" '
                         f'stroke="#ddd"/><text x="{x0 - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick}</text>')
        for i, method in enumerate(methods):
            gx = x0 + i * group_w + (group_w - len(CHART_VARIANTS) * bar_w) / 2
            for v, (suffix, colour, _) in enumerate(CHART_VARIANTS):
                name = method + suffix
                accs = [r["ACC"] for r in runs if run_name(r) == name]
                bx = gx + v * bar_w
                if accs:
                    mean, std = mean_std(accs)
                    parts.append(f'<rect class="bar" data-method="{name}" data-scenario="{scenario}" x="{bx:.1f}" '
                                 f'y="{y(mean):.1f}" width="{bar_w - 2}" height="{y(0) - y(mean):.1f}" '
                                 f'fill="{colour}"><title>{name} {scenario.upper()}: '
                                 f'{mean:.2f} ({std:.2f}), {len(accs)} seeds</title></rect>')
                    cx = bx + (bar_w - 2) / 2
                    parts.append(f'<line x1="{cx:.1f}" y1="{y(min(100, mean + std)):.1f}" x2="{cx:.1f}" '
                                 f'y2="{y(max(0, mean - std)):.1f}" stroke="#333"/>')
                paper = PAPER_ACC.get(scenario, {}).get(method) if dataset == "mnist" and v < 2 else None
                if paper:  # drawn last, over the bar
                    parts.append(f'<line class="paper" x1="{bx - 2:.1f}" y1="{y(paper[v]):.1f}" x2="{bx + bar_w:.1f}" '
                                 f'y2="{y(paper[v]):.1f}" stroke="black" stroke-width="3"/>')
            parts.append(f'<text x="{gx + 1.5 * bar_w:.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
                         f'{escape(method)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


TASK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf")


def mean_accuracy_matrix(runs):
    """R[t][i] averaged over seeds: test accuracy on task i after training task t (None above
    the diagonal, where task i is not trained yet)."""
    rows = [r["acc_matrix"] for r in runs]
    return [[None if rows[0][t][i] is None else statistics.mean(m[t][i] for m in rows)
             for i in range(len(rows[0][t]))] for t in range(len(rows[0]))]


def drawn(record):
    """Runs the accuracy-matrix figure draws: finished, and (for +ReCL) reconstructed at
    the run's own settings (naive tuning); the Sec. 4.3 tuned rows get no panel of their own."""
    return (bool(record.get("acc_matrix")) and not record.get("diverged")
            and record.get("config", {}).get("tuning", "naive") == "naive")


def matrix_svg(records, dataset, scenario, method):
    """The accuracy matrix as lines, the figure continual-learning papers draw: one line per
    task i, its test accuracy after each task t >= i (mean over seeds), so forgetting shows
    as a line falling. One panel for the method alone, one with ReCL, and one with the
    inversion control when it was run."""
    from xml.sax.saxutils import escape
    chosen = [r for r in records if (r["dataset"], r["scenario"], r["method"]) == (dataset, scenario, method)
              and drawn(r)]
    panels = [(label, [r for r in chosen if run_name(r) == method + suffix])
              for suffix, _, label in CHART_VARIANTS]
    panels = [(label, runs) for label, runs in panels if runs]
    n_tasks = len(panels[0][1][0]["acc_matrix"])
    panel_w, left, top, plot_h = 300, 40, 60, 200
    x = lambda p, t: p * panel_w + left + (panel_w - left - 20) * t / max(1, n_tasks - 1)
    y = lambda acc: top + plot_h * (1 - acc / 100)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel_w * len(panels) + 10}" '
             f'height="{top + plot_h + 50}" font-family="sans-serif" font-size="11">',
             f'<text x="10" y="18" font-size="14">{escape(dataset)}, {scenario.upper()}: test accuracy of '
             f'each task after training task t (mean over seeds)</text>']
    parts += [f'<line x1="{10 + 60 * i}" y1="33" x2="{24 + 60 * i}" y2="33" stroke="{TASK_COLOURS[i % 10]}" '
              f'stroke-width="2"/><text x="{28 + 60 * i}" y="37">task {i + 1}</text>' for i in range(n_tasks)]
    for p, (label, runs) in enumerate(panels):
        R = mean_accuracy_matrix(runs)
        acc = statistics.mean(r["ACC"] for r in runs)
        parts.append(f'<text x="{x(p, 0)}" y="{top - 8}" font-weight="bold">{escape(method if label == "method" else method + label)}'
                     f' (ACC {acc:.1f}, {len(runs)} seeds)</text>')
        for tick in range(0, 101, 20):
            parts.append(f'<line x1="{x(p, 0) - 4}" y1="{y(tick)}" x2="{x(p, n_tasks - 1)}" y2="{y(tick)}" '
                         f'stroke="#ddd"/><text x="{x(p, 0) - 6}" y="{y(tick) + 4}" text-anchor="end">{tick}</text>')
        parts += [f'<text x="{x(p, t):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{t + 1}</text>'
                  for t in range(n_tasks)]
        parts.append(f'<text x="{x(p, (n_tasks - 1) / 2):.1f}" y="{top + plot_h + 34}" text-anchor="middle">'
                     f'after training task t</text>')
        for i in range(n_tasks):
            points = " ".join(f"{x(p, t):.1f},{y(R[t][i]):.1f}" for t in range(i, n_tasks))
            parts.append(f'<polyline class="task" data-panel="{escape(label)}" data-task="{i + 1}" points="{points}" '
                         f'fill="none" stroke="{TASK_COLOURS[i % 10]}" stroke-width="2"/>')
            parts.append(f'<circle cx="{x(p, i):.1f}" cy="{y(R[i][i]):.1f}" r="2.5" fill="{TASK_COLOURS[i % 10]}"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def aggregate(folder):
    """One table per (dataset, scenario) from every finished run's JSON in `folder`,
    and a chart per dataset, DIR/chart-DATASET.svg."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):  # temporary files start with "." and are skipped
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            print(f"skipping unreadable {path}: {err}", file=sys.stderr)
    if not records:
        raise UsageError(f"no finished runs (*.json) in {folder}")
    searches = [r for r in records if "trials" in r]  # `tune` results
    if searches:
        return tuning_table(searches)
    for warning in mixed_settings(records):
        print(warning, file=sys.stderr)
    records.sort(key=lambda r: (method_rank(r["method"]), r["recl"],
                                r.get("config", {}).get("rec_objective") == "inversion", r["seed"]))
    tables = []
    for dataset, scenario in sorted({(r["dataset"], r["scenario"]) for r in records}):
        chosen = [r for r in records if (r["dataset"], r["scenario"]) == (dataset, scenario)]
        tables.append(f"### {dataset}, {scenario.upper()}\n\n{summary_table(chosen)}\n")
    for dataset in sorted({r["dataset"] for r in records}):
        path = Path(folder) / f"chart-{dataset}.svg"
        write_atomically(path, chart_svg(records, dataset))
        print(f"chart: {path}", file=sys.stderr)
    for dataset, scenario, method in sorted({(r["dataset"], r["scenario"], r["method"]) for r in records
                                             if drawn(r) and r["method"] != "joint"}):
        path = Path(folder) / f"matrix-{dataset}-{scenario}-{method}.svg"
        write_atomically(path, matrix_svg(records, dataset, scenario, method))
    print(f"accuracy matrices: {folder}/matrix-DATASET-SCENARIO-METHOD.svg", file=sys.stderr)
    return "\n".join(tables)


# =============================================================================
# 3. Choosing a method's hyperparameters (paper App. D.3: on validation data)
# =============================================================================

def tune_method(cfg, log=print):
    """Choose lr, epochs and the method's own hyperparameters on validation data.

    Random search over strategies.TRAINING_GRID and SEARCH_GRID (cfg.trials
    draws without repetition, seeded; recl.random_search), each draw scored by
    the ACC of the method (with ReCL if cfg.variant is "recl") on a split held
    out from the training images of seed cfg.seed. The test images are never
    loaded into the tasks this sees. Returns every trial, best first.
    """
    use_recl = with_recl(cfg)
    base = recl.run_settings(cfg, cfg.seed, use_recl)
    tasks, _, mean_image = data.make_tasks(cfg.dataset, cfg.seed, cfg.n_per_class, cfg.scenario,
                                           base.classes_per_task, cfg.data_root)
    tasks = data.validation_split(tasks, 0.2, cfg.seed)
    grid = {**strategies.TRAINING_GRID, **strategies.SEARCH_GRID[cfg.method]}
    combos = list(itertools.product(*grid.values()))
    picks = torch.randperm(len(combos), generator=torch.Generator().manual_seed(cfg.seed))[:cfg.trials]
    candidates = [dict(zip(grid, combos[pick])) for pick in picks.tolist()]
    log(f"tuning {variant_name(cfg.method, use_recl, cfg.rec_objective)} | {cfg.scenario} | {cfg.dataset} | "
        f"seed {cfg.seed}: {len(picks)} of {len(combos)} settings, scored on validation data")

    def evaluate(chosen):
        own = {k: v for k, v in chosen.items() if k not in strategies.TRAINING_GRID}
        run = argparse.Namespace(**{**vars(base), "lr": chosen["lr"], "epochs": chosen["epochs"],
                                    "hp": {**base.hp, **own}})
        record = recl.timed_run(run, tasks, cfg.method, use_recl, lambda *a: None, mean_image)
        outcome = (f"diverged ({record['diverged']})" if record["diverged"]
                   else f"validation ACC {record['ACC']:.2f}")
        log(f"  trial {candidates.index(chosen) + 1}/{len(candidates)}: "
            + " ".join(f"{k} {v:g}" for k, v in chosen.items()) + f" -> {outcome} ({record['seconds']:.0f}s)")
        trial = {"settings": chosen, "val_ACC": record["ACC"], "val_BWT": record["BWT"],
                 "seconds": record["seconds"], "diverged": record["diverged"]}
        return trial_score(trial), trial, None

    trials, _ = recl.random_search(candidates, evaluate)
    return [trial for _, _, trial in trials]  # a diverged trial ranks last


def trial_score(trial):
    return -math.inf if trial["val_ACC"] is None else trial["val_ACC"]


def tuning_path(cfg):
    name = variant_name(cfg.method, with_recl(cfg), cfg.rec_objective)
    return Path(cfg.out) / f"{recl.dataset_name(cfg.dataset)}-{cfg.scenario}-{name}-tuning-seed{cfg.seed}.json"


def tune(argv, log=None):
    """tune: run the validation search, save every trial, print the winner."""
    cfg = cli.make_parser().parse_args(argv)
    cli.check_args(cfg)
    if cfg.lr is not None or cfg.epochs is not None:
        raise UsageError("tune chooses --lr and --epochs itself; leave them out")
    log = log or ((lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True)))
    trials = tune_method(cfg, log)
    use_recl = with_recl(cfg)
    name = variant_name(cfg.method, use_recl, cfg.rec_objective)
    path = tuning_path(cfg)
    searched = {**vars(recl.run_settings(cfg, cfg.seed, use_recl)), "lr": None, "epochs": None}  # what it chose
    write_json_atomically(path, {"method": name, "scenario": cfg.scenario, "dataset": recl.dataset_name(cfg.dataset),
                                 "seed": cfg.seed, "trials": trials, "config": searched,
                                 "provenance": cli.provenance()})
    best = trials[0]
    if best["val_ACC"] is None:
        raise RunFailed(f"{name} {cfg.scenario}: every trial diverged ({path})")
    print(f"{name} {cfg.scenario}: best validation ACC {best['val_ACC']:.2f} with {best['settings']} -> {path}")


# =============================================================================
# 4. The benchmark: what ReCL costs
# =============================================================================
# Three measurements, printed as tables and written as one JSON file:
# 1. the machine's practical peak: GFLOP/s of a plain 2000 x 2000 matrix
#    product, in float32 and in bfloat16;
# 2. one reconstruction step (the losses of Eq. 3-5 and their backward, what
#    recl.reconstruct repeats n_rec times) for the MLP on MNIST-shaped input and
#    the CNN on CIFAR10-shaped input, at m = 200 and 800 candidates, in float32
#    and under bfloat16 autocast: seconds, the floating-point work of its matrix
#    products and convolutions (forward, backward and double backward, by
#    torch.utils.flop_counter's formulas), and the rate achieved;
# 3. end to end: `python recl.py --scenario cil --method finetune` (SplitMNIST,
#    seed 0, the shipped defaults) for Finetune and Finetune+ReCL, their
#    seconds, the ratio, and the +ReCL run's reconstruction seconds.
# A benchmark, not a test: nothing here passes or fails.

def synchronise(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    synchronise(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronise(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_peak(device, dtype=torch.float32, n=2000, repeats=10):
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats)
    return {"size": n, "seconds": seconds, "gflops": 2 * n ** 3 / seconds / 1e9}


class CountFlops(TorchDispatchMode):
    """Counts the floating-point operations of every matrix product and convolution run
    inside it, forward and backward, with the formulas of torch.utils.flop_counter.

    Why not the usual tools: torch.profiler's with_flops leaves out
    convolution_backward, so it counted the CNN step at 0.37 of its real work (this
    benchmark used it before and so put the CNN step at 0.1-0.2 of the matmul rate;
    docs/cost.md); FlopCounterMode tracks modules with hooks that torch.func.grad breaks.
    """

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def trained_looking(name, input_shape, n_classes, device, seed=0):
    """A network whose weights moved away from their start, as after training."""
    torch.manual_seed(seed)
    model = models.build_model(name, input_shape, n_classes).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def reconstruction_problem(name, input_shape, m, device):
    """What one step of recl.reconstruct works on, for m candidates over 10 classes: the
    smooth-ReLU copy of a trained-looking network, its parameters, the displacement
    target and its scale, the candidates, their labels and lambdas (also for the
    probes in docs/runs/cost-probes/)."""
    model = trained_looking(name, input_shape, 10, device)
    net = models.with_smooth_relu(model, 100.0).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
    labels = torch.arange(10, device=device).repeat_interleave(m // 10)
    x = (1e-3 * torch.randn(len(labels), *input_shape, device=device)).requires_grad_()
    lam = torch.rand(len(labels), device=device).requires_grad_()
    return net, params, target, scale, x, labels, lam


def reconstruction_step(name, input_shape, m, device, repeats, precision="float32", compiled=False):
    """Time and count one step of recl.reconstruct's loop for m candidates over 10 classes, its
    products in `precision` (with `compiled`, of torch.compile(recl.reconstruction_losses),
    its first call timed apart)."""
    net, params, target, scale, x, labels, lam = reconstruction_problem(name, input_shape, m, device)
    lambda_min = 0.05

    compute = torch.compile(recl.reconstruction_losses) if compiled else recl.reconstruction_losses

    def losses_fn(*args):  # as recl.reconstruct calls it
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            return compute(*args)

    def step():
        losses = losses_fn(net, params, target, scale, x, labels, lam, lambda_min)
        sum(losses.values()).backward()
        x.grad = lam.grad = None

    first = time.perf_counter()
    step()  # a compiled function compiles here
    synchronise(device)
    first = time.perf_counter() - first
    with CountFlops() as counter:  # the same work in either format; counted uncompiled
        sum(recl.reconstruction_losses(net, params, target, scale, x, labels, lam, lambda_min).values()).backward()
    x.grad = lam.grad = None
    flops = counter.flops
    seconds = timed(step, device, repeats)
    return {"model": name, "m": m, "precision": precision, "compiled": compiled, "first_call_seconds": first,
            "seconds": seconds,
            "gflop": flops / 1e9, "gflops": flops / seconds / 1e9}


def end_to_end(device):
    """Finetune and Finetune+ReCL, SplitMNIST CIL, seed 0, as the command line runs them."""
    cfg = cli.make_parser().parse_args(["--device", device.type])
    cli.check_args(cfg)
    tasks, _, mean_image = data.make_tasks(cfg.dataset, 0, cfg.n_per_class, cfg.scenario, 2, cfg.data_root)
    runs = {}
    for use_recl in (False, True):
        run = recl.run_settings(cfg, 0, use_recl)
        judge = lambda old, x_rec: recl.report_reconstruction("", old, x_rec, run, mean_image, lambda *a: None)
        record = recl.timed_run(run, tasks, cfg.method, use_recl, lambda *a: None, mean_image, judge)
        runs["finetune+recl" if use_recl else "finetune"] = {
            "seconds": record["seconds"], "ACC": record["ACC"], "phase_seconds": record["phase_seconds"]}
        runs["rec_precision"] = run.rec_precision
    runs["ratio"] = runs["finetune+recl"]["seconds"] / runs["finetune"]["seconds"]
    return runs


def benchmark(argv):
    p = argparse.ArgumentParser(prog="experiments.py benchmark",
                                description="What ReCL costs: a reconstruction step, and a whole run")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per step (median)")
    p.add_argument("--no-runs", action="store_true", help="skip the end-to-end runs")
    p.add_argument("--compile", action="store_true",
                   help="also time the MLP step under torch.compile (compiling takes seconds to a minute)")
    p.add_argument("--out", default=None, help="JSON file (default: results/benchmark-DEVICE.json)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    machine = cli.provenance()
    print(f"device {machine['device']}, {machine['threads']} threads, torch {machine['torch']}", flush=True)

    peak, peak_bf16 = matmul_peak(device), matmul_peak(device, torch.bfloat16)
    print(f"matrix product {peak['size']}x{peak['size']}: {peak['gflops']:.0f} GFLOP/s in float32, "
          f"{peak_bf16['gflops']:.0f} in bfloat16", flush=True)
    steps = []
    print("| model | m | products in | seconds per step | GFLOP per step | GFLOP/s | share of float32 matmul rate |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
        for m in (200, 800):
            for precision in ("float32", "bfloat16"):
                row = reconstruction_step(name, shape, m, device, args.repeats, precision)
                row["share_of_matmul"] = row["gflops"] / peak["gflops"]
                steps.append(row)
                print(f"| {name} | {m} | {precision} | {row['seconds']:.3f} | {row['gflop']:.1f} | "
                      f"{row['gflops']:.0f} | {row['share_of_matmul']:.2f} |", flush=True)
    if args.compile:
        print("\n| torch.compile | m | seconds per step | eager | first call (compiling) |\n|---|---|---|---|---|")
        for m in (200, 800):
            row = reconstruction_step("mlp", (1, 28, 28), m, device, args.repeats, compiled=True)
            eager = next(r["seconds"] for r in steps
                         if r["model"] == "mlp" and r["m"] == m and r["precision"] == "float32")
            steps.append(row)
            print(f"| mlp | {m} | {row['seconds']:.4f} | {eager:.4f} | {row['first_call_seconds']:.1f} |", flush=True)
    result = {"machine": machine, "matmul": peak, "matmul_bfloat16": peak_bf16, "steps": steps}
    if not args.no_runs:
        runs = end_to_end(device)
        result["runs"] = runs
        print("\n| SplitMNIST CIL, seed 0 | seconds | ACC | of which reconstruction |\n|---|---|---|---|")
        for name in ("finetune", "finetune+recl"):
            r = runs[name]
            print(f"| {name} | {r['seconds']:.1f} | {r['ACC']:.2f} | {r['phase_seconds']['reconstruct']:.1f} |")
        print(f"Finetune+ReCL / Finetune: {runs['ratio']:.1f}x (reconstruction in {runs['rec_precision']})")
    out = Path(args.out or f"results/benchmark-{device.type}.json")
    write_json_atomically(out, result)
    print(f"-> {out}")


# =============================================================================
# The command line
# =============================================================================

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("", "-h", "--help"):
        print(__doc__)
    elif command == "aggregate" and len(rest) == 1:
        print(aggregate(rest[0]))
    elif command == "pending" and not rest:
        print("\n".join(pending_runs(sys.stdin.read().splitlines(), lambda m: print(m, file=sys.stderr))))
    elif command == "queue" and len(rest) == 1:
        work_through_queue(rest[0])
    elif command == "tune":
        tune(rest)
    elif command == "benchmark":
        benchmark(rest)
    else:
        raise UsageError("usage: experiments.py aggregate DIR | tune RECL-FLAGS | benchmark [FLAGS] | pending "
                         "| queue DIR (see its docstring)")


if __name__ == "__main__":
    cli.run_from_command_line(main, "experiments.py")
