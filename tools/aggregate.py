"""The tables of the run records in a folder: one row per config, mean (std) over seeds (the validation searches'
first, if any); per method, each arm and +ReCL's paired differences with their 95% intervals. Usage: aggregate.py DIR"""
import json
import math
import sys
from pathlib import Path
from statistics import mean, stdev

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import recl  # noqa: E402

METHODS = list(recl.strategies.STRATEGIES)

RUN_KEYS = ("method", "variant", "scenario", "dataset", "seed", "ACC", "BWT", "acc_matrix", "config", "digest",
            "recl", "seconds", "reconstructions", "failed_reconstructions", "phase_seconds")
ARMS = (("alone", ""), ("alone at ReCL's budget", "@recl-budget"), ("+ReCL", "+recl"), ("+inversion", "+inversion"),
        ("+centroids", "+centroids"), ("+real", "+real"))  # (column, suffix of the run's name), in the tables' order
T95 = dict(enumerate((12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.16, 2.145,
    2.131, 2.12, 2.11, 2.101, 2.093, 2.086, 2.08, 2.074, 2.069, 2.064, 2.06, 2.056, 2.052, 2.048, 2.045, 2.042), 1))
ok = lambda r, k: type(r[k]) in (int, float) and math.isfinite(r[k]) or (k, r[k], r["method"]) == ("BWT", None, "joint")
tuning = lambda record: record["config"].get("tuning") or "naive"
method_rank = lambda method: METHODS.index(method) if method in METHODS else len(METHODS)
arm = lambda r: recl.variant_name("", r["variant"], r["config"].get("budget"))  # its name's suffix, as in ARMS
run_name = lambda r: r["method"] + arm(r) + f" ({tuning(r)})" * (tuning(r) != "naive")
plasticity = lambda r: None if r["method"] == "joint" else mean(a[t] for t, a in enumerate(r["acc_matrix"]))  # R[t, t]
cell = lambda v, d=2: "" if not v or None in v else f"{mean(v):.{d}f}" + (len(v) > 1 and f" ({stdev(v):.{d}f})" or "")
row = lambda *cells: "| " + " | ".join(map(str, cells)) + " |"  # of a Markdown table, whose rule is "|---" * n + "|"

def read_results(folder, say=print):
    """The run records and validation searches in `folder`; other JSON files are named in one line, skipped."""
    runs, searches = [], []
    for path in sorted(Path(folder).glob("*.json")):  # temporary files start with "." and are skipped
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            say(f"skipping {path}: unreadable ({err})")
            continue
        if isinstance(record, dict) and "trials" in record and "config" in record:
            searches.append(record)
        elif missing := [k for k in RUN_KEYS if k not in record] if isinstance(record, dict) else ["a JSON object"]:
            say(f"skipping {path}: not a run record (no {', '.join(missing[:3])})")
        elif bad := [k for k in ("ACC", "BWT") if not record.get("diverged") and not ok(record, k)]:
            say(f"skipping {path}: {bad[0]} is not a number ({record[bad[0]]!r})")
        else:
            runs.append(record)
    return runs, searches

def summary_table(records):
    """Markdown: one row per config, mean (std) over seeds; namesakes told apart by digest; diverged runs listed."""
    rows, groups, notes = [row("method", "seeds", "ACC", "BWT", "plasticity", "stored", "SSIM", "memorisation gap",
                               "reconstruction s", "seconds", "flagged rec."), "|---" * 11 + "|"], {}, []
    for r in [r for r in records if not r.get("diverged")]:
        groups.setdefault((run_name(r), r["digest"]), []).append(r)
    for (name, key), runs in groups.items():
        namesakes = [(k, rs[0]) for (n, k), rs in groups.items() if n == name]
        (first, old), label = namesakes[0], name if len(namesakes) == 1 else f"{name} [{key}]"
        if first != key:  # what in its settings (its own .pt data by contents too) differs from the first's
            old, new = ({**r["config"], "dataset_sha256": r.get("dataset_sha256", "")[:12]} for r in (old, runs[0]))
            changed = [f"{k} {new.get(k)}" for k in sorted(set(old) | set(new), key=str)
                       if k not in recl.NOT_IN_DIGEST and old.get(k) != new.get(k)]
            notes.append(f"\n[{key}] differs from [{first}] in: {', '.join(changed) or 'nothing recorded'}")
        quality = lambda metric: cell([mean(q[metric] for q in r["recon_quality"]) for r in runs
                                       if r.get("recon_quality") and metric in r["recon_quality"][0]], 3)
        stored = "/".join(map(str, sorted({r["stored_images"] for r in runs if "stored_images" in r})))
        made, flagged = sum(len(r["reconstructions"]) for r in runs), sum(r["failed_reconstructions"] for r in runs)
        rows.append(row(label, len(runs), cell([r["ACC"] for r in runs]), cell([r["BWT"] for r in runs]) or "n/a",
                        cell(list(map(plasticity, runs))), stored, quality("mean_ssim"), quality("memorisation_gap"),
                        cell([r["phase_seconds"]["reconstruct"] for r in runs if r["recl"]], 1),
                        f"{mean(r['seconds'] for r in runs):.1f}", f"{flagged}/{made}" if made else ""))
    return "\n".join(rows + notes + [f"\nDiverged, not averaged: {run_name(r)} [{r.get('digest', '?')}] seed "
                                     f"{r['seed']} ({r['diverged']})" for r in records if r.get("diverged")])

def tuning_table(searches):
    """Markdown: the setting each validation search chose, ready for strategies.TUNED."""
    rows = [row("dataset", "scenario", "method", "chosen (validation)", "val ACC", "trials"), "|---" * 6 + "|"]
    for r in sorted(searches, key=lambda r: (r["dataset"], r["scenario"], method_rank(r["method"].split("+")[0]))):
        best = max(r["trials"], key=lambda t: -math.inf if t["val_ACC"] is None else t["val_ACC"])
        chosen = ", ".join(f"{k} {v:g}" for k, v in best["settings"].items())
        rows.append(row(r["dataset"], r["scenario"], r["method"], chosen, "all diverged" if best["val_ACC"] is None
                        else f"{best['val_ACC']:.2f}", len(r["trials"])))
    return "\n".join(rows)

def paired(a, b):
    """a, b: {seed: value}. The n differences a - b on the seeds both have: their mean, 95% t-interval (low, high),
    how many are above 0, and n; None if n < 2. T95: Student's t by degrees of freedom; beyond 30 the normal's 1.96."""
    if len(diffs := [a[s] - b[s] for s in sorted(set(a) & set(b))]) < 2:
        return None
    middle, half = mean(diffs), T95.get(len(diffs) - 1, 1.96) * stdev(diffs) / math.sqrt(len(diffs))
    return middle, middle - half, middle + half, sum(d > 0 for d in diffs), len(diffs)

difference = lambda a, b: "" if (d := paired(a, b)) is None else (  # '+1.23 [+0.40, +2.06] 5/5', bold if it excludes 0
    "**{}**" if d[1] > 0 or d[2] < 0 else "{}").format(f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] {d[3]}/{d[4]}")

def arms_tables(records):
    """Markdown: per method, each arm's mean ACC over seeds; then +ReCL's paired differences with each other arm,
    in ACC and BWT, with 95% t-intervals and sign counts. An arm with several configs is left out (see above)."""
    naive = [r for r in records if not r.get("diverged") and tuning(r) == "naive"]
    digests = {name: {r["digest"] for r in naive if run_name(r) == name} for name in map(run_name, naive)}
    value = lambda name, key: {r["seed"]: r[key] for r in naive if run_name(r) == name and len(digests[name]) == 1}
    mean_acc = lambda name: f"{mean(accs.values()):.2f}" if (accs := value(name, "ACC")) else ""
    vs = lambda m, suffix, key="ACC": difference(value(m + "+recl", key), value(m + suffix, key))  # ReCL − the arm
    methods = sorted({r["method"] for r in records if r["method"] != "joint"}, key=method_rank)
    acc = [row("method", *(label for label, _ in ARMS), "ReCL − inversion (ACC, 95% CI, seeds above)"),
           "|---" * 8 + "|"] + [row(m, *(mean_acc(m + s) for _, s in ARMS), vs(m, "+inversion")) for m in methods]
    diff = [row("method", "metric", *(f"ReCL − {label.lstrip('+')}" for label, s in ARMS if s != "+recl")),
            "|---" * 7 + "|"] + [row(m, key, *(vs(m, s, key) for _, s in ARMS if s != "+recl")) for m in methods
                                 for key in ("ACC", "BWT")]
    return "\n".join(acc) + "\n\nPaired over seeds: mean [95% t-interval] and the seeds where +ReCL is above; " \
        "bold when the interval excludes 0.\n\n" + "\n".join(diff)

def aggregate(folder, say=lambda message: print(message, file=sys.stderr)):
    """The tables of `folder`'s records, one per (dataset, scenario, split), the validation searches' first."""
    if not Path(folder).is_dir():
        raise recl.UsageError(f"{folder} is not a folder")
    records, searches = read_results(folder, say)
    if not records and not searches:
        raise recl.UsageError(f"no finished runs (*.json) in {folder}")
    tables = [f"### Validation searches\n\n{tuning_table(searches)}\n"] if searches else []
    records.sort(key=lambda r: (method_rank(r["method"]), [*(s for _, s in ARMS), arm(r)].index(arm(r)), r["seed"]))
    table_of = lambda r: (r["dataset"], r["scenario"], bool(r["config"].get("validation")))
    for dataset, scenario, validation in sorted({table_of(r) for r in records}):
        chosen = [r for r in records if table_of(r) == (dataset, scenario, validation)]
        title = f"{dataset}, {scenario.upper()}{' (validation split)' * validation}"
        tables.append(f"### {title}\n\n{summary_table(chosen)}\n")
        if any(r["variant"] != "base" or r["config"].get("budget") for r in chosen):
            tables.append(f"#### {title}: the arms\n\n{arms_tables(chosen)}\n")
    return "\n".join(tables)

if __name__ == "__main__":
    parser = recl.Parser(prog="aggregate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder of run records (*.json)")
    recl.run_from_command_line(lambda: print(aggregate(parser.parse_args().folder)), "aggregate.py")
