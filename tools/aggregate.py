"""The tables of the run records in a folder: one row per config, mean (std) over seeds (the validation searches'
first, if any); per method, each arm beside the others and +ReCL's paired differences with their 95% intervals;
and the charts DIR/chart-DATASET.svg and DIR/matrix-DATASET-SCENARIO-METHOD.svg.
Usage: python tools/aggregate.py DIR"""
import json
import math
import statistics
import sys
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402

RUN_KEYS = ("method", "variant", "scenario", "dataset", "seed", "ACC", "BWT", "acc_matrix", "config", "digest",
            "recl", "seconds", "reconstructions", "failed_reconstructions", "phase_seconds")
number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
VARIANT_ORDER = {"base": 0, "recl": 2, "inversion": 3, "centroids": 4, "real": 5}  # alone at +ReCL's budget: 1
mean_std = lambda values: (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
tuning = lambda record: record["config"].get("tuning") or "naive"
method_rank = lambda method: config.METHODS.index(method) if method in config.METHODS else len(config.METHODS)
run_name = lambda r: (config.variant_name(r["method"], r["variant"], r["config"].get("budget"))
                      + f" ({tuning(r)})" * (tuning(r) != "naive"))
variant_rank = lambda r: 1 if r["config"].get("budget") == "recl" and r["variant"] == "base" else (
    VARIANT_ORDER.get(r["variant"], 6))
plasticity = lambda r: statistics.mean(row[t] for t, row in enumerate(r["acc_matrix"]))  # mean R[t, t]: learning
seeds = lambda n: f"{n} seed{'s' * (n != 1)}"


def read_results(folder, say=print):
    """The run records and validation searches in `folder`; other JSON files are named in one line, skipped."""
    runs, searches = [], []
    for path in sorted(Path(folder).glob("*.json")):  # temporary files start with "." and are skipped
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            say(f"skipping {path}: unreadable ({err})")
            continue
        missing = [k for k in RUN_KEYS if k not in record] if isinstance(record, dict) else ["a JSON object"]
        bad = [k for k in ("ACC", "BWT") if not missing and not record.get("diverged") and not number(record[k])
               and not (k == "BWT" and record[k] is None and record["method"] == "joint")]  # joint has no BWT
        if isinstance(record, dict) and "trials" in record and "config" in record:
            searches.append(record)
        elif missing or bad:
            say(f"skipping {path}: " + (f"not a run record (no {', '.join(missing[:3])})" if missing
                                        else f"{bad[0]} is not a number ({record[bad[0]]!r})"))
        else:
            runs.append(record)
    return runs, searches


def summary_table(records):
    """Markdown: one row per config, mean (std) over seeds; namesakes told apart by digest; diverged runs listed."""
    def cell(values, digits=2):  # one value alone; blank if there is none or one is missing
        if not values or None in values:
            return ""
        mean, std = mean_std(values)
        return f"{mean:.{digits}f}" + (f" ({std:.{digits}f})" if len(values) > 1 else "")
    rows = ["| method | seeds | ACC | BWT | plasticity | stored | SSIM | memorisation gap | reconstruction s | "
            "seconds | flagged rec. |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups, notes = {}, []
    for r in [r for r in records if not r.get("diverged")]:
        groups.setdefault((run_name(r), r["digest"]), []).append(r)
    for (name, key), runs in groups.items():
        namesakes = [(k, rs[0]) for (n, k), rs in groups.items() if n == name]
        (first, old), label = namesakes[0], name if len(namesakes) == 1 else f"{name} [{key}]"
        if first != key:  # what in its settings (its own .pt data by contents too) differs from the first's
            old, new = ({**r["config"], "dataset_sha256": r.get("dataset_sha256", "")[:12]} for r in (old, runs[0]))
            changed = [f"{k} {new.get(k)}" for k in sorted(set(old) | set(new), key=str)
                       if k not in config.NOT_IN_DIGEST and old.get(k) != new.get(k)]
            notes.append(f"\n[{key}] differs from [{first}] in: {', '.join(changed) or 'nothing recorded'}")
        ssim = [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs if r.get("recon_quality")]
        gap = [statistics.mean(q["memorisation_gap"] for q in r["recon_quality"]) for r in runs
               if r.get("recon_quality") and "memorisation_gap" in r["recon_quality"][0]]
        plastic = [plasticity(r) for r in runs if r["method"] != "joint"]
        stored = sorted({r["stored_images"] for r in runs if "stored_images" in r})
        rec_s = [r["phase_seconds"]["reconstruct"] for r in runs if r["recl"]]
        made = sum(len(r["reconstructions"]) for r in runs)
        flagged = f"{sum(r['failed_reconstructions'] for r in runs)}/{made}" if made else ""
        rows.append(f"| {label} | {len(runs)} | {cell([r['ACC'] for r in runs])} | "
                    f"{cell([r['BWT'] for r in runs]) or 'n/a'} | {cell(plastic)} | {'/'.join(map(str, stored))} | "
                    f"{cell(ssim, 3)} | {cell(gap, 3)} | {cell(rec_s, 1)} | "
                    f"{statistics.mean(r['seconds'] for r in runs):.1f} | {flagged} |")
    diverged = [f"\nDiverged, not averaged: {run_name(r)} [{r.get('digest', '?')}] seed {r['seed']} ({r['diverged']})"
                for r in records if r.get("diverged")]
    return "\n".join(rows + notes + diverged)


def tuning_table(searches):
    """Markdown: the setting each validation search chose, ready for strategies.TUNED."""
    rows = ["| dataset | scenario | method | chosen (validation) | val ACC | trials |", "|---|---|---|---|---|---|"]
    for r in sorted(searches, key=lambda r: (r["dataset"], r["scenario"], method_rank(r["method"].split("+")[0]))):
        best = max(r["trials"], key=lambda t: -math.inf if t["val_ACC"] is None else t["val_ACC"])
        chosen = ", ".join(f"{k} {v:g}" for k, v in best["settings"].items())
        score = "all diverged" if best["val_ACC"] is None else f"{best['val_ACC']:.2f}"
        rows.append(f"| {r['dataset']} | {r['scenario']} | {r['method']} | {chosen} | {score} | {len(r['trials'])} |")
    return "\n".join(rows)


# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: within 0.05 of the normal's 1.96).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
       21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}


def paired(a, b):
    """a, b: {seed: value}. The differences a - b on the seeds both have: their mean, the 95% t-interval
    (low, high) and how many are above 0, of how many; None with fewer than 2 shared seeds."""
    diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if len(diffs) < 2:
        return None
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    half = T95.get(len(diffs) - 1, 1.96) * sd / math.sqrt(len(diffs))
    return mean, mean - half, mean + half, sum(d > 0 for d in diffs), len(diffs)


def difference(a, b):
    """'+1.23 [+0.40, +2.06] 5/5': bold when the interval excludes 0."""
    d = paired(a, b)
    if d is None:
        return ""
    text = f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] {d[3]}/{d[4]}"
    return f"**{text}**" if d[1] > 0 or d[2] < 0 else text


ARMS = (("alone", ""), ("alone at ReCL's budget", "@recl-budget"), ("+ReCL", "+recl"), ("+inversion", "+inversion"),
        ("+centroids", "+centroids"), ("+real", "+real"))


def arms_tables(records):
    """Markdown: per method, each arm's mean ACC over seeds; then +ReCL's paired differences with each other arm,
    in ACC and BWT, with 95% t-intervals and sign counts. An arm with several configs is left out (see above)."""
    by = {}
    for r in (r for r in records if not r.get("diverged") and tuning(r) == "naive"):
        by.setdefault(run_name(r), {}).setdefault(r["digest"], {})[r["seed"]] = r
    runs = {name: next(iter(d.values())) for name, d in by.items() if len(d) == 1}  # {name: {seed: record}}
    value = lambda name, key: {s: r[key] for s, r in runs.get(name, {}).items()}
    methods = sorted({r["method"] for r in records if r["method"] != "joint"}, key=method_rank)
    mean = lambda name: f"{statistics.mean(value(name, 'ACC').values()):.2f}" if name in runs else ""
    last = "ReCL − inversion (ACC, 95% CI, seeds above)"
    acc = ["| method | " + " | ".join(label for label, _ in ARMS) + f" | {last} |",
           "|---|" + "---|" * (len(ARMS) + 1)]
    acc += [f"| {m} | " + " | ".join(mean(m + suffix) for _, suffix in ARMS)
            + f" | {difference(value(m + '+recl', 'ACC'), value(m + '+inversion', 'ACC'))} |" for m in methods]
    others = [(label, suffix) for label, suffix in ARMS if suffix != "+recl"]
    diff = ["| method | metric | " + " | ".join(f"ReCL − {label.lstrip('+')}" for label, _ in others) + " |",
            "|---|---|" + "---|" * len(others)]
    for m in methods:
        for key in ("ACC", "BWT"):
            diff.append(f"| {m} | {key} | " + " | ".join(difference(value(m + "+recl", key), value(m + suffix, key))
                                                         for _, suffix in others) + " |")
    return "\n".join(acc) + "\n\nPaired over seeds: mean [95% t-interval] and the seeds where +ReCL is above; " \
        "bold when the interval excludes 0.\n\n" + "\n".join(diff)


PAPER_ACC = {  # Tables 1 and 2: (method, +ReCL) on SplitMNIST
    "cil": {"finetune": (50.34, 73.18), "ewc": (40.67, 68.13), "er": (68.59, 71.94), "upgd": (29.10, 70.10),
            "agem": (37.03, 63.31), "lwf": (50.56, 57.15), "gpm": (18.48, 39.25)},
    "dil": {"finetune": (82.23, 83.80), "ewc": (82.91, 84.48), "er": (84.00, 85.44), "upgd": (83.19, 82.95),
            "agem": (83.46, 84.00), "lwf": (83.62, 84.67), "gpm": (73.48, 75.29)}}
VARIANTS = (("", "#9e9e9e", "method"), ("+recl", "#1f77b4", "+ReCL"), ("+inversion", "#ff7f0e", "+inversion"))
task_colour = lambda i: f"hsl({36 * i}, 70%, 45%)"
y = lambda acc: 70 + 240 * (1 - acc / 100)  # in both figures: 0-100 % over 240 px


def svg(title, legend, width, panels):
    """An SVG: a title, a legend of (colour, label) squares, and side by side, `width` px apart, the
    (heading, parts) panels, each over grid lines at 0, 20, ..., 100 %."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(width * len(panels), 80 * len(legend)) + 20}" '
           f'height="340" font-family="sans-serif" font-size="11">',
           f'<text x="10" y="18" font-size="14">{title}</text>']
    out += [f'<rect x="{10 + 80 * i}" y="28" width="10" height="10" fill="{colour}"/>'
            f'<text x="{24 + 80 * i}" y="37">{escape(label)}</text>' for i, (colour, label) in enumerate(legend)]
    for p, (heading, parts) in enumerate(panels):
        grid = [f'<line x1="-4" y1="{y(t):.0f}" x2="{width - 50}" y2="{y(t):.0f}" stroke="#ddd"/>'
                f'<text x="-6" y="{y(t) + 4:.0f}" text-anchor="end">{t}</text>' for t in range(0, 101, 20)]
        out += [f'<g transform="translate({50 + width * p}, 0)">', *grid, *parts,
                f'<text y="58" font-weight="bold">{escape(heading)}</text></g>']
    return "\n".join(out + ["</svg>"]) + "\n"


def chart_svg(records, dataset):
    """Mean ACC per method and variant, whiskers of one std, the paper's value as a tick; a panel per scenario."""
    panels = []
    for scenario in ("cil", "dil"):
        runs, parts = [r for r in records if (r["dataset"], r["scenario"]) == (dataset, scenario)], []
        methods = sorted({r["method"] for r in runs}, key=method_rank)
        for i, method in enumerate(methods):
            gx = (i + 0.5) * 380 / len(methods)  # the middle of the method's three 14 px bars
            parts.append(f'<text x="{gx:.1f}" y="326" text-anchor="middle">{escape(method)}</text>')
            for v, (suffix, colour, _) in enumerate(VARIANTS):
                name, bx = method + suffix, gx - 21 + 14 * v
                if accs := [r["ACC"] for r in runs if run_name(r) == name]:
                    mean, std = mean_std(accs)
                    parts += [f'<rect class="bar" data-method="{name}" data-scenario="{scenario}" x="{bx:.1f}" '
                              f'y="{y(mean):.1f}" width="12" height="{y(0) - y(mean):.1f}" fill="{colour}">'
                              f'<title>{name} {scenario.upper()}: {mean:.2f}{f" ({std:.2f})" * (len(accs) > 1)}, '
                              f'{seeds(len(accs))}</title></rect>',
                              f'<line x1="{bx + 6:.1f}" y1="{y(min(100, mean + std)):.1f}" x2="{bx + 6:.1f}" '
                              f'y2="{y(max(0, mean - std)):.1f}" stroke="#333"/>']
                if dataset == "mnist" and v < 2 and (paper := PAPER_ACC.get(scenario, {}).get(method)):  # over the bar
                    parts.append(f'<line class="paper" x1="{bx - 2:.1f}" y1="{y(paper[v]):.1f}" x2="{bx + 14:.1f}" '
                                 f'y2="{y(paper[v]):.1f}" stroke="black" stroke-width="3"/>')
        panels += [(scenario.upper(), parts)] if runs else []
    title = f"{escape(dataset)}: mean ACC over seeds (whiskers: one std; black ticks: the paper)"
    return svg(title, [(colour, label) for _, colour, label in VARIANTS], 430, panels)


def matrix_svg(records, dataset, scenario, method):
    """Per task i a line of its mean test accuracy after each task t >= i (forgetting falls); a panel per variant."""
    chosen = [r for r in records if (r["dataset"], r["scenario"], r["method"]) == (dataset, scenario, method)]
    n = len(chosen[0]["acc_matrix"])
    x, panels = lambda t: 240 * t / max(1, n - 1), []
    for suffix, _, label in VARIANTS:
        if runs := [r for r in chosen if run_name(r) == method + suffix]:
            R = lambda t, i: statistics.mean(r["acc_matrix"][t][i] for r in runs)  # after task t, on task i
            parts = [f'<text x="{x(t):.1f}" y="326" text-anchor="middle">{t + 1}</text>' for t in range(n)]
            for i in range(n):
                points = " ".join(f"{x(t):.1f},{y(R(t, i)):.1f}" for t in range(i, n))
                parts += [f'<polyline class="task" data-panel="{escape(label)}" data-task="{i + 1}" points="{points}" '
                          f'fill="none" stroke="{task_colour(i)}" stroke-width="2"/>',
                          f'<circle cx="{x(i):.1f}" cy="{y(R(i, i)):.1f}" r="2.5" fill="{task_colour(i)}"/>']
            acc = statistics.mean(r["ACC"] for r in runs)
            panels.append((f"{method + label.replace('method', '')} (ACC {acc:.1f}, {seeds(len(runs))})", parts))
    title = f"{escape(dataset)}, {scenario.upper()}: test accuracy of each task after training task t (mean over seeds)"
    return svg(title, [(task_colour(i), f"task {i + 1}") for i in range(n)], 300, panels)


def aggregate(folder, say=lambda message: print(message, file=sys.stderr)):
    """The tables of `folder`'s records, one per (dataset, scenario, split), the searches' first; writes the charts."""
    if not Path(folder).is_dir():
        raise config.UsageError(f"{folder} is not a folder")
    records, searches = read_results(folder, say)
    if not records and not searches:
        raise config.UsageError(f"no finished runs (*.json) in {folder}")
    tables = [f"### Validation searches\n\n{tuning_table(searches)}\n"] if searches else []
    records.sort(key=lambda r: (method_rank(r["method"]), variant_rank(r), r["seed"]))
    table_of = lambda r: (r["dataset"], r["scenario"], bool(r["config"].get("validation")))
    for dataset, scenario, validation in sorted({table_of(r) for r in records}):
        chosen = [r for r in records if table_of(r) == (dataset, scenario, validation)]
        tables.append(f"### {dataset}, {scenario.upper()}{' (validation split)' * validation}\n\n"
                      f"{summary_table(chosen)}\n")
        if any(r["variant"] != "base" or r["config"].get("budget") for r in chosen):
            tables.append(f"#### {dataset}, {scenario.upper()}{' (validation split)' * validation}: the arms\n\n"
                          f"{arms_tables(chosen)}\n")
    # the charts draw finished runs on the test set, untuned, of methods with one config per variant
    pictured = [r for r in records if not r.get("diverged") and not r["config"].get("validation")
                and tuning(r) == "naive"]
    figure = lambda r: (r["dataset"], r["scenario"], r["method"])
    for key in sorted({figure(r) for r in pictured}):
        runs = [r for r in pictured if figure(r) == key]
        configs = {(run_name(r), r["digest"]) for r in runs}
        if len(configs) > len({name for name, _ in configs}) or len({len(r["acc_matrix"]) for r in runs}) > 1:
            say(f"charts: {' '.join(key)} has runs of several configs; not drawn (see the table)")
            pictured = [r for r in pictured if figure(r) != key]
    for dataset in sorted({r["dataset"] for r in pictured}):
        config.write_atomically(Path(folder) / f"chart-{dataset}.svg", chart_svg(pictured, dataset))
    for key in sorted({figure(r) for r in pictured if r["method"] != "joint"}):
        config.write_atomically(Path(folder) / f"matrix-{'-'.join(key)}.svg", matrix_svg(pictured, *key))
    say(f"charts: {folder}/chart-DATASET.svg, matrix-DATASET-SCENARIO-METHOD.svg" if pictured else "no charts")
    return "\n".join(tables)


if __name__ == "__main__":
    parser = config.Parser(prog="aggregate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder of run records (*.json)")
    config.run_from_command_line(lambda: print(aggregate(parser.parse_args().folder)), "aggregate.py")
