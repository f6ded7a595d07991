"""Print docs/attribution.md's test-set tables from the runs' JSON files:
the attribution ladder, and method / +ReCL / +inversion for every method.

    python docs/runs/attribution/tables.py
"""
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import experiments
import config  # noqa: E402
import recl  # noqa: E402

LADDER = ROOT / "docs/runs/attribution/ladder"
TABLE = ROOT / "docs/runs/table-bf16"
RUNGS = [("0-paper", "the paper as written (`--paper`)"),
         ("1-displacement", "+ L_rec fits theta - theta_0 (`--rec-target displacement`)"),
         ("2-kept", "+ kept candidates (`--freeze-old`)"),
         ("3-filter", "+ filter (`--filter`)"),
         ("4-budget", "+ the +ReCL training budget (`--lr 0.1 --epochs 20`, DIL `--lr 0.05`)"),
         ("5-noise", "+ replay noise (`--replay-noise 2.5`); DIL: today's defaults"),
         ("6-ce", "+ 3e-4 x inversion's cross-entropy (`--ce-weight 3e-4`): CIL's defaults")]


def load(folder, scenario, name):
    runs = [json.loads(p.read_text()) for p in sorted(Path(folder).glob(f"mnist-{scenario}-*.json"))]
    return [r for r in runs if experiments.run_name(r) == name and not r.get("diverged")]


def cell(runs, key, digits=2):
    values = [key(r) for r in runs]
    if not values:
        return "-"
    mean, std = experiments.mean_std(values)
    return f"{mean:.{digits}f} ({std:.{digits}f})"


def ssim(r):
    return statistics.mean(q["mean_ssim"] for q in r["recon_quality"])


def ladder(scenario):
    print(f"\n**{scenario.upper()}**, Finetune, seeds 0-4, test set: ACC, BWT, SSIM, reconstruction seconds\n")
    print("| rung | stationarity ACC | BWT | SSIM | rec. s | inversion ACC | BWT | SSIM | rec. s | `--n-rec 1` ACC |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rung, label in RUNGS:
        if rung == "6-ce" and scenario == "dil":
            continue
        last = rung == "6-ce" or (rung == "5-noise" and scenario == "dil")  # today's defaults
        folder = TABLE if last else LADDER / rung
        inv_folder = {"1-displacement": LADDER / "0-paper", "5-noise": TABLE, "6-ce": TABLE}.get(rung, folder)
        stat = load(folder, scenario, "finetune+recl")
        inv = load(inv_folder, scenario, "finetune+inversion")
        control = load(LADDER / f"{rung}-n-rec-1", scenario, "finetune+recl")
        cols = []
        for runs in (stat, inv):
            cols += [cell(runs, lambda r: r["ACC"]), cell(runs, lambda r: r["BWT"]), cell(runs, ssim, 3),
                     cell(runs, lambda r: r["phase_seconds"]["reconstruct"], 1)]
        print(f"| {label} | " + " | ".join(cols) + f" | {cell(control, lambda r: r['ACC'])} |")


def methods(scenario):
    print(f"\n**{scenario.upper()}**, seeds 0-4, test set: ACC (BWT)\n")
    print("| method | alone | +ReCL | +inversion | +ReCL - +inversion |")
    print("|---|---|---|---|---|")
    for method in config.METHODS:
        if method == "joint":
            continue
        rows = [load(TABLE, scenario, method + suffix) for suffix in ("", "+recl", "+inversion")]
        cells = [f"{cell(r, lambda x: x['ACC'])}, BWT {cell(r, lambda x: x['BWT'])}" for r in rows]
        paired = {r["seed"]: r["ACC"] for r in rows[2]}
        diffs = [r["ACC"] - paired[r["seed"]] for r in rows[1] if r["seed"] in paired]
        diff = f"{statistics.mean(diffs):+.2f}" if diffs else "-"
        print(f"| {method} | " + " | ".join(cells) + f" | {diff} |")
    joint = load(TABLE, scenario, "joint")
    print(f"| joint (upper bound) | {cell(joint, lambda x: x['ACC'])} | | | |")


for s in ("cil", "dil"):
    methods(s)
for s in ("cil", "dil"):
    ladder(s)
