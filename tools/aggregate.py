"""The tables of the run records in a folder: one row per config, mean (std) over seeds; per method, each arm and
+ReCL's paired differences with their 95% intervals; the validation searches' choices. Usage: aggregate.py DIR"""
import json, math, sys  # noqa: E401
from pathlib import Path
from statistics import mean, stdev
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules, from any folder
import data, recl  # noqa: E401, E402

RUN_KEYS = ("method", "variant", "scenario", "dataset", "seed", "ACC", "BWT", "acc_matrix", "config", "digest",
            "recl", "seconds", "reconstructions", "failed_reconstructions", "phase_seconds")
ARMS = {"": "alone", "@recl-budget": "alone at ReCL's budget", "+recl": "+ReCL", "+inversion": "+inversion",
        "+centroids": "+centroids", "+real": "+real"}  # a run's name's suffix: its column, in the tables' order
T95 = dict(enumerate(map(float, "12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262 2.228 2.201 2.179 2.16 2.145 "
    "2.131 2.12 2.11 2.101 2.093 2.086 2.08 2.074 2.069 2.064 2.06 2.056 2.052 2.048 2.045 2.042".split()), 1))
method_rank = lambda method: [*recl.strategies.STRATEGIES, method].index(method)  # STRATEGIES' order, others last
arm = lambda r: data.variant_name("", r["variant"], r["config"].get("budget"))  # its name's suffix, as in ARMS
run_name = lambda r: r["method"] + arm(r) + {"naive": ""}.get(t := r["config"].get("tuning") or "naive", f" ({t})")
plasticity = lambda r: None if r["method"] == "joint" else mean(a[t] for t, a in enumerate(r["acc_matrix"]))  # R[t, t]
cell = lambda v, d=2: "" if not v or None in v else f"{mean(v):.{d}f}" + (len(v) > 1 and f" ({stdev(v):.{d}f})" or "")
row = lambda *cells: "| " + " | ".join(map(str, cells)) + " |"
table = lambda head, rows: "\n".join([row(*head), "|---" * len(head) + "|", *rows])  # Markdown
ok = lambda r, k: type(r[k]) in (int, float) and math.isfinite(r[k]) or (k, r[k], r["method"]) == ("BWT", None, "joint")
def paired(a, b):
    """a, b: {seed: value}. The n differences a - b on the seeds both have: their mean, 95% t-interval (low, high),
    how many are above 0, and n; None if n < 2. T95: Student's t by degrees of freedom; beyond 30 the normal's 1.96."""
    if len(diffs := [a[s] - b[s] for s in sorted(set(a) & set(b))]) < 2:
        return None
    middle, half = mean(diffs), T95.get(len(diffs) - 1, 1.96) * stdev(diffs) / math.sqrt(len(diffs))
    return middle, middle - half, middle + half, sum(d > 0 for d in diffs), len(diffs)
difference = lambda a, b: "" if (d := paired(a, b)) is None else (  # '+1.23 [+0.40, +2.06] 5/5', bold if it excludes 0
    "**{}**" if d[1] > 0 or d[2] < 0 else "{}").format(f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] {d[3]}/{d[4]}")

def config_tables(records, title):
    """A row per config, mean (std) over seeds, diverged runs listed apart; with arms, per method each arm's ACC and
    +ReCL's paired differences with the others."""
    kept, config = [r for r in records if not r.get("diverged")], lambda r: (run_name(r), r["digest"])
    groups = {c: [r for r in kept if config(r) == c] for c in dict.fromkeys(map(config, kept))}  # in the records' order
    names, rows = [name for name, _ in groups], []  # a name of two configs: told apart by digest, given no arms
    for (name, key), runs in groups.items():
        of = lambda key: [r[key] for r in runs if key in r]
        quality = lambda m: cell([mean(q[m] for q in qs) for qs in of("recon_quality") if m in (qs or [{}])[0]], 3)
        made, rec = sum(map(len, of("reconstructions"))), [r["phase_seconds"]["reconstruct"] for r in runs if r["recl"]]
        rows.append(row(name + f" [{key}]" * (names.count(name) > 1), len(runs), cell(of("ACC")), cell(of("BWT")) or
                        "n/a", cell(list(map(plasticity, runs))), "/".join(map(str, sorted(set(of("stored_images"))))),
                        quality("mean_ssim"), quality("memorisation_gap"), cell(rec, 1), f"{mean(of('seconds')):.1f}",
                        f"{sum(of('failed_reconstructions'))}/{made}" if made else ""))
    tables = [f"### {title}\n\n" + table(("method", "seeds", "ACC", "BWT", "plasticity", "stored", "SSIM",
        "memorisation gap", "reconstruction s", "seconds", "flagged rec."), rows + [f"\nDiverged, not averaged: "
        f"{run_name(r)} [{r['digest']}] seed {r['seed']} ({r['diverged']})" for r in records if r.get("diverged")])]
    if not any(r["variant"] != "base" or r["config"].get("budget") for r in records):  # no arms
        return tables
    value = lambda name, key: {r["seed"]: r[key] for r in kept if run_name(r) == name} if names.count(name) == 1 else {}
    vs = lambda m, suffix, key="ACC": difference(value(m + "+recl", key), value(m + suffix, key))  # ReCL − the arm
    methods = sorted({r["method"] for r in records} - {"joint"}, key=method_rank)
    acc = table(["method", *ARMS.values(), "ReCL − inversion (ACC, 95% CI, seeds above)"], [row(m, *(f"{mean(v):.2f}"
        if (v := value(m + s, "ACC").values()) else "" for s in ARMS), vs(m, "+inversion")) for m in methods])
    diff = table(["method", "metric", *(f"ReCL − {label.lstrip('+')}" for s, label in ARMS.items() if s != "+recl")],
        [row(m, key, *(vs(m, s, key) for s in ARMS if s != "+recl")) for m in methods for key in ("ACC", "BWT")])
    return tables + [f"#### {title}: the arms\n\n{acc}\n\nPaired over seeds: mean [95% t-interval] and the seeds where "
                     f"+ReCL is above; bold when the interval excludes 0.\n\n{diff}"]

def tuning_table(searches):
    """The setting each validation search (tools/tune.py) chose, ready for strategies.TUNED."""
    best = lambda r: max(r["trials"], key=lambda t: -math.inf if t["val_ACC"] is None else t["val_ACC"])
    order = lambda r: (r["dataset"], r["scenario"], method_rank(r["method"].split("+")[0]))
    rows = [row(r["dataset"], r["scenario"], r["method"], ", ".join(f"{k} {v:g}" for k, v in t["settings"].items()),
                "all diverged" if t["val_ACC"] is None else f"{t['val_ACC']:.2f}", len(r["trials"]))
            for r, t in [(r, best(r)) for r in sorted(searches, key=order)]]
    return "### Validation searches\n\n" + table(("dataset", "scenario", "method", "chosen (validation)", "val ACC",
                                                   "trials"), rows)

def aggregate(folder, say=lambda message: print(message, file=sys.stderr)):
    """The tables of `folder`'s records, one per dataset, scenario and split."""
    if not Path(folder).is_dir():
        raise recl.UsageError(f"{folder} is not a folder")
    records, searches = [], []
    for path in sorted(Path(folder).glob("*.json")):  # any other JSON file is named in one line and skipped
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            say(f"skipping {path}: unreadable ({err})")
            continue
        if isinstance(r, dict) and {"trials", "draws"} <= set(r):  # a validation search's record
            searches.append(r)
        elif missing := [k for k in RUN_KEYS if k not in r] if isinstance(r, dict) else ["a JSON object"]:
            say(f"skipping {path}: not a run record (no {', '.join(missing[:3])})")
        elif bad := [k for k in ("ACC", "BWT") if not r.get("diverged") and not ok(r, k)]:
            say(f"skipping {path}: {bad[0]} is not a number ({r[bad[0]]!r})")
        else:
            records.append(r)
    if not records and not searches:
        raise recl.UsageError(f"no finished runs (*.json) in {folder}")
    records.sort(key=lambda r: (method_rank(r["method"]), [*ARMS, arm(r)].index(arm(r)), r["seed"]))
    table_of = lambda r: (r["dataset"], r["scenario"], bool(r["config"].get("validation")))
    blocks = [block for dataset, scenario, validation in sorted({table_of(r) for r in records}) for block in
              config_tables([r for r in records if table_of(r) == (dataset, scenario, validation)],
                            f"{dataset}, {scenario.upper()}{' (validation split)' * validation}")]
    return "\n\n".join([tuning_table(searches)] * bool(searches) + blocks) + "\n"

if __name__ == "__main__":
    parser = recl.Parser(prog="aggregate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder of run records (*.json)")
    recl.run_from_command_line(lambda: print(aggregate(parser.parse_args().folder)), "aggregate.py")
