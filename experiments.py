"""What produces this project's tables, beside the method in recl.py.

    python experiments.py aggregate DIR     the tables of the runs in DIR, one row per config
                                            (mean (std) over seeds), DIR/chart-DATASET.svg,
                                            and each method's accuracy matrix, DIR/matrix-*.svg
    python experiments.py tune RECL-FLAGS   choose a method's lr, epochs and own settings on
                                            validation data (paper App. D.3), e.g.
                                            python experiments.py tune --method ewc --scenario cil
    python experiments.py benchmark         what ReCL costs: one reconstruction step, and a
                                            whole run against its base method
    python experiments.py pending           (for run_all.sh) which command lines on stdin
                                            have no result yet
    python experiments.py queue DIR         (for run_all.sh) a worker that runs the command
                                            lines in DIR/commands that no other worker took

Each takes -h. Nothing here changes what a run computes: every run is `recl.main`,
or for `tune` `recl.run_continual` on a validation split.
"""
import argparse
import dataclasses
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

import config
import data
import judging
import models
import recl
import strategies
import cli
from cli import RunFailed, UsageError, write_atomically, write_json_atomically
from config import METHODS, variant_name

# =============================================================================
# 1. For run_all.sh: which runs have no result yet, and workers that run them
# =============================================================================
# A run's result file is named by its config's digest (config.result_path), so
# a command has its result when the files its runs would write exist. After a
# default changes, the same command resolves to another config, another file
# name, and runs again; the old files stay, in rows of their own. A change of
# code that leaves every setting as it was is not detected: the provenance's
# commit records it.

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


def result_paths(args):
    """The files the runs of a checked recl.py command line write."""
    return [config.result_path(args.out, config.resolve(args, seed, variant))
            for seed in range(args.seed, args.seed + (args.seeds or 1)) for variant in config.variants(args)]


def pending_runs(lines, say=lambda message: print(message, file=sys.stderr)):
    """The command lines (each one run, or one search) whose result is missing, less those
    of datasets that cannot be loaded. run_all.sh passes its extra flags to every run: a
    line loses those its run does not use and would refuse (the +ReCL flags for the
    method alone, Eq. 3-6's for the inversion control, --ce-scope for DIL and joint)."""
    todo, loadable, alone_seen = [], {}, set()
    for line in lines:
        command = command_args(line)
        if command is None:
            continue
        (kind, argv), words = command, shlex.split(line)
        prefix = words[:len(words) - len(argv)]
        argv = [w for word in argv for w in (word.split("=", 1) if word.startswith("--") else [word])]  # --f=v: 2 words
        value = lambda flag: argv[argv.index(flag) + 1:][:1] if flag in argv else []
        alone = value("--method") == ["joint"] or value("--variant") == ["base"]
        unused = (cli.RECL_FLAGS if alone else cli.NOT_FOR_INVERSION if value("--rec-objective") == ["inversion"]
                  else ())
        if kind == "tune":  # a search refuses what it does not search, but for this one
            unused = ()
        if value("--scenario") == ["dil"] or value("--method") == ["joint"] or (alone and value("--ce-scope") == [
                "local"]):  # a class-incremental setting; local needs replayed rows
            unused = (*unused, "ce_scope")
        if unused:
            argv = cli.without_flags(argv, unused)
            line = shlex.join(prefix + argv)
        if alone:  # a sweep of a +ReCL setting: the method alone is one run, made in the first folder
            key = tuple(word for i, word in enumerate(argv) if word != "--out" and argv[i - 1:i] != ["--out"])
            if key in alone_seen:
                continue
            alone_seen.add(key)
        try:  # every line checked before any runs: a bad flag stops them all, in one line
            args = (tune_parser() if kind == "tune" else cli.make_parser()).parse_args(argv)
            cli.check(args, probe_out=False)
        except UsageError as err:
            raise UsageError(f"{err} (nothing was run; the first line refused: {line.strip()})") from None
        if args.dataset not in loadable:  # each dataset once: a dataset that cannot load skips its runs
            try:
                data.load(args.dataset, args.data_root or "data")
                loadable[args.dataset] = True
            except data.DataError as err:
                if args.dataset.endswith(".pt"):  # your own file: nothing to skip to
                    raise UsageError(f"{args.dataset}: {err}") from None
                loadable[args.dataset] = False
                say(f"skipping {args.dataset}: {err}")
        if not loadable[args.dataset]:
            continue
        paths = [tuning_path(args)] if kind == "tune" else result_paths(args)
        if not all(path.exists() for path in paths):
            todo.append(line.rstrip())
    if loadable and not any(loadable.values()):  # nothing asked for can run: no table of other runs either
        raise UsageError(f"no dataset asked for can be loaded ({', '.join(loadable)}; why above): nothing was run")
    return todo


def work_through_queue(folder):
    """queue: run the command lines in FOLDER/commands in this process, each one that no
    other worker on FOLDER has claimed.

    Why: starting a process costs seconds here (importing torch, then parsing the
    MNIST CSV), as long as a whole Finetune run. run_all.sh therefore starts JOBS
    workers on one list instead of one process per run. A worker claims run i by
    creating FOLDER/claimed-i, which succeeds for one process only, so runs are
    handed out one at a time and the workers finish together. Every run seeds
    itself, so it gives what it would give alone. A run that fails, for whatever
    reason, is named in one line and the others still run.
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
        kind, argv = command
        try:
            cli.main(argv) if kind == "run" else tune(argv)
        except Exception as err:  # noqa: BLE001 -- one bad run must not stop the others
            print(f"run_all: FAILED: {line}: {type(err).__name__}: {err}".replace("\n", " "), file=sys.stderr, flush=True)
            failed.append(line)
        except SystemExit as err:  # argparse's -h and its like
            if err.code:
                print(f"run_all: FAILED: {line}: exit {err.code}", file=sys.stderr, flush=True)
                failed.append(line)
    if failed:
        raise RunFailed(f"{len(failed)} queued run(s) failed, each named above")


# =============================================================================
# 2. Tables and charts from the results files
# =============================================================================

RUN_KEYS = ("method", "variant", "scenario", "dataset", "seed", "ACC", "BWT", "acc_matrix", "config", "digest")


def read_results(folder, say=print):
    """The run records and the tuning searches in `folder`'s JSON files; every other
    file (a benchmark, a record from before config digests, anything malformed) is
    named in one line and skipped."""
    runs, searches = [], []
    for path in sorted(Path(folder).glob("*.json")):  # temporary files start with "." and are skipped
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            say(f"skipping {path}: unreadable ({err})")
            continue
        if isinstance(record, dict) and "trials" in record and "config" in record:
            searches.append(record)
        elif isinstance(record, dict) and all(k in record for k in RUN_KEYS):
            runs.append(record)
        else:
            missing = [k for k in RUN_KEYS if k not in record] if isinstance(record, dict) else ["a JSON object"]
            say(f"skipping {path}: not a run record (no {', '.join(missing[:3])})")
    return runs, searches


def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_name(record):
    tuning = record["config"].get("tuning") or "naive"
    return variant_name(record["method"], record["variant"]) + ("" if tuning == "naive" else f" ({tuning})")


def method_rank(method):
    """Tables and charts list the methods in the paper's order; unknown ones last."""
    return METHODS.index(method) if method in METHODS else len(METHODS)


def differences(old, new):
    """What in run record `new`'s settings (its own .pt data by contents too) differs from `old`'s."""
    old, new = ({**r["config"], "dataset_sha256": r.get("dataset_sha256", "")[:12]} for r in (old, new))
    keys = sorted(set(old) | set(new), key=str)
    same = lambda k: old.get(k) == new.get(k)
    changed = [f"{k} {new.get(k)}" for k in keys if k not in config.NOT_IN_DIGEST and not same(k)]
    return ", ".join(changed) or "nothing recorded"


def summary_table(records):
    """Markdown: one row per config (mean (std) over its seeds, as in the paper's tables),
    with the reconstructions' mean nearest-pair SSIM, their seconds, and how many of them
    were flagged. Configs that share a name are told apart by their digest, and the lines
    under the table say how each differs from the first; diverged runs are listed there
    and never averaged."""
    rows = ["| method | seeds | ACC | BWT | SSIM | reconstruction s | seconds | flagged rec. |",
            "|---|---|---|---|---|---|---|---|"]
    finished = [r for r in records if not r.get("diverged")]
    groups = {}
    for r in finished:
        groups.setdefault((run_name(r), r["digest"]), []).append(r)
    names = [name for name, _ in groups]
    notes, first_of = [], {}

    def cell(values, digits=2):
        if not values or None in values:
            return ""
        return f"{values[0]:.{digits}f}" if len(values) == 1 else "{:.{d}f} ({:.{d}f})".format(*mean_std(values), d=digits)

    for (name, key), runs in groups.items():
        label = name if names.count(name) == 1 else f"{name} [{key}]"
        if names.count(name) > 1:
            if name in first_of:
                notes.append(f"[{key}] differs from [{first_of[name][0]}] in: {differences(first_of[name][1], runs[0])}")
            else:
                first_of[name] = (key, runs[0])
        ssim_ = [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs if r.get("recon_quality")]
        rec_s = [r["phase_seconds"]["reconstruct"] for r in runs if r["recl"]]
        made = sum(len(r["reconstructions"]) for r in runs)
        flagged = f"{sum(r['failed_reconstructions'] for r in runs)}/{made}" if made else ""
        rows.append(f"| {label} | {len(runs)} | {cell([r['ACC'] for r in runs])} | "
                    f"{cell([r['BWT'] for r in runs]) or 'n/a'} | {cell(ssim_, 3)} | {cell(rec_s, 1)} | "
                    f"{statistics.mean(r['seconds'] for r in runs):.1f} | {flagged} |")
    rows += [f"\n{note}" for note in notes]
    rows += [f"\nDiverged, not averaged: {run_name(r)} [{r.get('digest', '?')}] seed {r['seed']} ({r['diverged']})"
             for r in records if r.get("diverged")]
    return "\n".join(rows)


def tuning_table(searches):
    """Markdown: the setting each validation search chose, ready for the method's rows in strategies.py."""
    rows = ["| dataset | scenario | method | chosen (validation) | val ACC | trials |", "|---|---|---|---|---|---|"]
    for r in sorted(searches, key=lambda r: (r["dataset"], r["scenario"], method_rank(r["method"].split("+")[0]))):
        best = max(r["trials"], key=trial_score)
        chosen = ", ".join(f"{k} {v:g}" for k, v in best["settings"].items())
        score = "all diverged" if best["val_ACC"] is None else f"{best['val_ACC']:.2f}"
        rows.append(f"| {r['dataset']} | {r['scenario']} | {r['method']} | {chosen} | {score} | {len(r['trials'])} |")
    return "\n".join(rows)


def drawn(records, say=print):
    """The runs the charts draw: finished, on the test set, at naive tuning, and only for
    methods whose every variant has one config in the folder with one task count, so a
    figure never sets one experiment beside another (the others are named, not drawn)."""
    chosen = [r for r in records if not r.get("diverged") and not r["config"].get("validation")
              and (r["config"].get("tuning") or "naive") == "naive"]
    methods = {}
    for r in chosen:
        methods.setdefault((r["dataset"], r["scenario"], r["method"]), []).append(r)
    kept = []
    for (dataset, scenario, method), runs in methods.items():
        configs = {(run_name(r), r["digest"]) for r in runs}
        if len(configs) > len({name for name, _ in configs}) or len({len(r["acc_matrix"]) for r in runs}) > 1:
            say(f"charts: {dataset} {scenario} {method} has runs of several configs; not drawn (see the table)")
        else:
            kept += runs
    return kept


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
    finished = [r for r in records if r["dataset"] == dataset]  # drawn() chose them
    scenarios = [s for s in ("cil", "dil") if any(r["scenario"] == s for r in finished)]
    panel_w, top, plot_h, bar_w = 430, 70, 240, 14
    y = lambda acc: top + plot_h * (1 - acc / 100)
    legend = "".join(f'<rect x="{10 + 90 * i}" y="28" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{24 + 90 * i}" y="37">{label}</text>' for i, (_, colour, label) in enumerate(CHART_VARIANTS))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(panel_w * len(scenarios) + 20, 560)}" '  # the legend
             f'height="{top + plot_h + 30}"'
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
                                 f'{mean:.2f}{f" ({std:.2f})" * (len(accs) > 1)}, {len(accs)} seed{"s" * (len(accs) != 1)}</title></rect>')
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


def matrix_svg(records, dataset, scenario, method):
    """The accuracy matrix as lines, the figure continual-learning papers draw: one line per
    task i, its test accuracy after each task t >= i (mean over seeds), so forgetting shows
    as a line falling. One panel for the method alone, one with ReCL, and one with the
    inversion control when it was run."""
    from xml.sax.saxutils import escape
    chosen = [r for r in records if (r["dataset"], r["scenario"], r["method"]) == (dataset, scenario, method)]
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
                     f' (ACC {acc:.1f}, {len(runs)} seed{"s" * (len(runs) != 1)})</text>')
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



# =============================================================================
# 3. Choosing a method's hyperparameters (paper App. D.3: on validation data)
# =============================================================================

def tune_method(cfg, trials, log=print):
    """Choose lr, epochs and the method's own hyperparameters on validation data.

    Random search over strategies.TRAINING_GRID and the method's grid (`trials` draws
    without repetition, seeded; judging.random_search), each draw scored by the ACC
    of the run `cfg` describes (with ReCL if its variant says so) on a split held
    out from the training images of seed cfg.seed. The test images are never
    loaded into the tasks this sees. Returns every trial, best first.
    """
    tasks, _, mean_image, _ = cli.make_tasks(cfg)
    cli.check_tasks(tasks, cfg)
    grid = {**strategies.TRAINING_GRID, **strategies.STRATEGIES[cfg.method]["grid"]}
    combos = list(itertools.product(*grid.values()))
    picks = torch.randperm(len(combos), generator=torch.Generator().manual_seed(cfg.seed))[:trials]
    candidates = [dict(zip(grid, combos[pick])) for pick in picks.tolist()]
    log(f"tuning {variant_name(cfg.method, cfg.variant)} | {cfg.scenario} | {cfg.dataset} | "
        f"seed {cfg.seed}: {len(picks)} of {len(combos)} settings, scored on validation data")

    def evaluate(chosen):
        own = {k: v for k, v in chosen.items() if k not in strategies.TRAINING_GRID}
        run = dataclasses.replace(cfg, lr=chosen["lr"], epochs=chosen["epochs"], hp={**cfg.hp, **own})
        record = recl.run_continual(run, tasks, lambda *a: None, mean_image=mean_image)
        outcome = (f"diverged ({record['diverged']})" if record["diverged"]
                   else f"validation ACC {record['ACC']:.2f}")
        log(f"  trial {candidates.index(chosen) + 1}/{len(candidates)}: "
            + " ".join(f"{k} {v:g}" for k, v in chosen.items()) + f" -> {outcome} ({record['seconds']:.0f}s)")
        trial = {"settings": chosen, "val_ACC": record["ACC"], "val_BWT": record["BWT"],
                 "seconds": record["seconds"], "diverged": record["diverged"]}
        return trial_score(trial), trial, None

    trials, _ = judging.random_search(candidates, evaluate)
    return [trial for _, _, trial in trials]  # a diverged trial ranks last


def trial_score(trial):
    return -math.inf if trial["val_ACC"] is None else trial["val_ACC"]


def tuned_config(args):
    """The run a search scores: one variant (--variant recl: with ReCL), seed --seed, on
    the validation split."""
    variant = config.variants(args)[-1] if args.variant == "recl" else "base"
    return dataclasses.replace(config.resolve(args, args.seed, variant), validation=True)


def tuning_path(args):
    """Named by the config searched around and by the number of draws."""
    cfg = tuned_config(args)
    return Path(args.out) / f"{config.run_name(cfg)}-tuning-{config.digest(cfg)}-{args.draws}draws-seed{cfg.seed}.json"


def tune_parser():
    parser = cli.make_parser("experiments.py tune", "Choose a method's lr, epochs and own hyperparameters on "
                                "a validation split of seed --seed (paper App. D.3): --draws settings from "
                                "strategies.TRAINING_GRID and the method's grid, each scored by the validation ACC of "
                                "the method alone, or with --variant recl of its +ReCL variant. Takes recl.py's "
                                "flags for everything else.")
    parser.add_argument("--draws", type=int, default=10, help="settings drawn from the grid (default: 10)")
    return parser


def tune(argv, log=None):
    """tune: run the validation search, save every trial, print the winner."""
    args = tune_parser().parse_args(argv)
    if args.variant == "both":
        raise UsageError("tune scores one variant: --variant base (the default) or recl")
    if args.save_images:
        raise UsageError("--save-images does not apply to tune: it keeps no run's reconstructions")
    args.variant = args.variant or "base"  # so that check refuses the +ReCL flags of a base search
    cli.check(args)
    if args.draws < 1:
        raise UsageError(f"--draws must be at least 1, got {args.draws}")
    for flag, value in (("lr", args.lr), ("epochs", args.epochs)):
        if value is not None:
            raise UsageError(f"tune chooses --{flag} itself; leave it out")
    for key in strategies.STRATEGIES[args.method]["grid"]:
        if key in args.hp:
            raise UsageError(f"tune chooses --hp {key} itself; leave it out")
    if args.validation:
        raise UsageError("tune always scores on the validation split; --validation does not apply")
    if args.seeds is not None:
        raise UsageError("tune searches on one seed (--seed); --seeds does not apply")
    log = log or ((lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True)))
    cfg = tuned_config(args)
    trials = tune_method(cfg, args.draws, log)
    path = tuning_path(args)
    name = variant_name(cfg.method, cfg.variant)
    write_json_atomically(path, {"method": name, "scenario": cfg.scenario, "dataset": config.dataset_name(cfg.dataset),
                                 "seed": cfg.seed, "draws": args.draws, "trials": trials,
                                 "config": dataclasses.asdict(cfg),
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
#    product, in float32 and in bfloat16 (where the machine has instructions for it);
# 2. one reconstruction step (the losses of Eq. 3-5 and their backward, what
#    recl.reconstruct repeats n_rec times) for the MLP on MNIST-shaped input and
#    the CNN on CIFAR10-shaped input, at m = 200 and 800 candidates, in float32
#    and (as above) under bfloat16 autocast: seconds, the floating-point work of its matrix
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
    convolution_backward, so it undercounts a CNN step (docs/cost.md); FlopCounterMode
    tracks modules with hooks that torch.func.grad breaks.
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
    target, scale = recl.displacement_target(params, model)
    labels = torch.arange(10, device=device).repeat_interleave(m // 10)
    x = (1e-3 * torch.randn(len(labels), *input_shape, device=device)).requires_grad_()
    lam = torch.rand(len(labels), device=device).requires_grad_()
    return net, params, target, scale, x, labels, lam


def eq6_losses(net, params, target, scale, x, labels, lam, lambda_min):
    """The terms of Eq. 3-5 for the displacement target, as recl.reconstruct computes them."""
    return recl.stationarity_loss(net, params, labels, target, lambda_min, None, scale)(x, lam)


def reconstruction_step(name, input_shape, m, device, repeats, precision="float32", compiled=False):
    """Time and count one step of recl.reconstruct's loop for m candidates over 10 classes, its
    products in `precision` (with `compiled`, of torch.compile(eq6_losses), its first call
    timed apart)."""
    net, params, target, scale, x, labels, lam = reconstruction_problem(name, input_shape, m, device)
    lambda_min = 0.05

    compute = torch.compile(eq6_losses) if compiled else eq6_losses

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
        sum(eq6_losses(net, params, target, scale, x, labels, lam, lambda_min).values()).backward()
    x.grad = lam.grad = None
    flops = counter.flops
    seconds = timed(step, device, repeats)
    return {"model": name, "m": m, "precision": precision, "compiled": compiled, "first_call_seconds": first,
            "seconds": seconds,
            "gflop": flops / 1e9, "gflops": flops / seconds / 1e9}


def end_to_end(device, model="mlp", dataset="mnist", scenario="cil", data_root=None):
    """Finetune and Finetune+ReCL, seed 0, one after the other, as the command line runs them."""
    args = cli.make_parser().parse_args(["--device", device.type, "--model", model, "--dataset", dataset,
                                         "--scenario", scenario] + (["--data-root", data_root] if data_root else []))
    cli.check(args, probe_out=False)
    runs = {}
    for variant in ("base", "recl"):
        run = config.resolve(args, 0, variant)
        tasks, _, mean_image, _ = cli.make_tasks(run)
        judge = lambda old, x_rec, y_rec: judging.report_reconstruction("", old, x_rec, run, mean_image,
                                                                        log=lambda *a: None)
        record = recl.run_continual(run, tasks, lambda *a: None, judge, mean_image)
        runs[variant_name("finetune", variant)] = {
            "seconds": record["seconds"], "ACC": record["ACC"], "phase_seconds": record["phase_seconds"]}
        runs["rec_precision"] = run.rec_precision or runs.get("rec_precision")
    runs["ratio"] = runs["finetune+recl"]["seconds"] / runs["finetune"]["seconds"]
    return runs


def benchmark(argv):
    p = cli.Parser(prog="experiments.py benchmark",
                      description="What ReCL costs: a reconstruction step, and a whole run")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per step (median)")
    p.add_argument("--no-runs", action="store_true", help="skip the end-to-end runs")
    p.add_argument("--compile", action="store_true",
                   help="also time the MLP step under torch.compile (compiling takes seconds to a minute)")
    p.add_argument("--out", default=None, help="JSON file (default: results/benchmark-DEVICE.json, with the runs' "
                   "model, dataset and scenario in the name when they are not mlp, mnist, cil)")
    p.add_argument("--model", choices=models.MODELS, help="the network of the end-to-end runs (default: mlp)")
    p.add_argument("--dataset", help="the dataset of the end-to-end runs (default: mnist)")
    p.add_argument("--data-root", help="where that dataset lives (default: data)")
    p.add_argument("--scenario", choices=["cil", "dil"], help="their scenario (default: cil)")
    p.add_argument("--no-steps", action="store_true", help="skip the per-step timings")
    args = p.parse_args(argv)
    runs_flags = [f"--{k.replace('_', '-')}" for k in ("model", "dataset", "data_root", "scenario") if getattr(args, k)]
    if args.no_runs and runs_flags:
        raise UsageError(f"{', '.join(runs_flags)} set(s) the end-to-end runs, which --no-runs skips")
    args.model, args.dataset, args.scenario = args.model or "mlp", args.dataset or "mnist", args.scenario or "cil"
    if not args.no_runs:  # a dataset that cannot load says so before any step is timed
        try:
            data.load(args.dataset, args.data_root or "data")
        except data.DataError as err:
            raise UsageError(str(err)) from None
    if args.dataset not in data.DATASETS:
        raise UsageError(f"--dataset must be one of {', '.join(data.DATASETS)}, got {args.dataset!r}")
    if args.no_runs and args.no_steps:
        raise UsageError("--no-runs with --no-steps leaves nothing to measure")
    if args.compile and args.no_steps:
        raise UsageError("--compile times a step against the eager one; it cannot go with --no-steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a folder; it names the JSON file to write")
    cli.check_writable(Path(args.out).parent if args.out else Path("results"))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    machine = cli.provenance()
    print(f"device {machine['device']}, {machine['threads']} threads, torch {machine['torch']}", flush=True)

    # bfloat16 only where it has instructions: a CPU without them emulates it, about a hundred times slower
    half = (torch.cuda.get_device_capability(device)[0] >= 8 if device.type == "cuda"  # Ampere on: bfloat16 units
            else config.reconstruction_precision("auto", device) == "bfloat16")
    peak, peak_bf16 = matmul_peak(device), matmul_peak(device, torch.bfloat16) if half else None
    print(f"matrix product {peak['size']}x{peak['size']}: {peak['gflops']:.0f} GFLOP/s in float32, " + (
        f"{peak_bf16['gflops']:.0f} in bfloat16" if half else "bfloat16 not timed (no instructions for it)"), flush=True)
    steps = []
    if not args.no_steps:
        print("| model | m | products in | seconds per step | GFLOP per step | GFLOP/s | share of float32 matmul "
              "rate |\n|---|---|---|---|---|---|---|")
    for name, shape in () if args.no_steps else (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
        for m in (200, 800):
            for precision in ("float32", "bfloat16") if half else ("float32",):
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
        runs = end_to_end(device, args.model, args.dataset, args.scenario, args.data_root)
        result["runs"] = {**runs, "model": args.model, "dataset": args.dataset, "scenario": args.scenario}
        print(f"\n| {args.dataset} {args.scenario.upper()}, {args.model}, seed 0 | seconds | ACC | of which reconstruction |"
              "\n|---|---|---|---|")
        for name in ("finetune", "finetune+recl"):
            r = runs[name]
            print(f"| {name} | {r['seconds']:.1f} | {r['ACC']:.2f} | {r['phase_seconds']['reconstruct']:.1f} |")
        print(f"Finetune+ReCL / Finetune: {runs['ratio']:.1f}x (reconstruction in {runs['rec_precision']})")
    runs_of = "" if args.no_runs or (args.model, args.dataset, args.scenario) == ("mlp", "mnist", "cil") else (
        f"-{args.model}-{args.dataset}-{args.scenario}")
    out = Path(args.out or f"results/benchmark-{device.type}{runs_of}.json")
    write_json_atomically(out, result)
    print(f"-> {out}")


# =============================================================================
# The command line
# =============================================================================

def aggregate(folder, say=lambda message: print(message, file=sys.stderr)):
    """The tables of every run record in `folder`, one per (dataset, scenario, split),
    with the tuning searches' table first if there are any; and the charts."""
    if not Path(folder).is_dir():
        raise UsageError(f"aggregate: {folder} is not a folder")
    records, searches = read_results(folder, say)
    if not records and not searches:
        raise UsageError(f"no finished runs (*.json) in {folder}")
    tables = [f"### Validation searches\n\n{tuning_table(searches)}\n"] if searches else []
    records.sort(key=lambda r: (method_rank(r["method"]), VARIANT_ORDER.get(r["variant"], 3), r["seed"]))
    for dataset, scenario, validation in sorted({(r["dataset"], r["scenario"], bool(r["config"].get("validation")))
                                                 for r in records}):
        chosen = [r for r in records if (r["dataset"], r["scenario"], bool(r["config"].get("validation")))
                  == (dataset, scenario, validation)]
        split = " (validation split)" if validation else ""
        tables.append(f"### {dataset}, {scenario.upper()}{split}\n\n{summary_table(chosen)}\n")
    pictured = drawn(records, say)
    for dataset in sorted({r["dataset"] for r in pictured}):
        path = Path(folder) / f"chart-{dataset}.svg"
        write_atomically(path, chart_svg(pictured, dataset))
        say(f"chart: {path}")
    for dataset, scenario, method in sorted({(r["dataset"], r["scenario"], r["method"]) for r in pictured
                                             if r["method"] != "joint"}):
        path = Path(folder) / f"matrix-{dataset}-{scenario}-{method}.svg"
        write_atomically(path, matrix_svg(pictured, dataset, scenario, method))
    if pictured:
        say(f"accuracy matrices: {folder}/matrix-DATASET-SCENARIO-METHOD.svg")
    return "\n".join(tables)


VARIANT_ORDER = {"base": 0, "recl": 1, "inversion": 2}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = cli.Parser(prog="experiments.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
    a = sub.add_parser("aggregate", help="the tables and charts of the runs in a folder")
    a.add_argument("folder")
    sub.add_parser("pending", help="which recl.py command lines on stdin have no result yet")
    q = sub.add_parser("queue", help="work through FOLDER/commands beside other workers")
    q.add_argument("folder")
    sub.add_parser("tune", help="choose a method's settings on validation data (takes recl.py's flags)")
    sub.add_parser("benchmark", help="what ReCL costs")
    if argv[:1] == ["tune"]:  # these two parse their own flags, -h included
        return tune(argv[1:])
    if argv[:1] == ["benchmark"]:
        return benchmark(argv[1:])
    args = p.parse_args(argv)
    if args.command == "aggregate":
        print(aggregate(args.folder))
    elif args.command == "pending":
        try:
            todo = pending_runs(sys.stdin.read().splitlines())
        except UsageError as err:
            sys.exit(f"run_all: {err}")
        print("\n".join(todo))
    else:
        work_through_queue(args.folder)


if __name__ == "__main__":
    cli.run_from_command_line(main, "experiments.py")
