"""Issue 48's tables: for each folder of run records, one row per (scenario, run name): seeds, ACC and BWT
mean (std), SSIM (mean over a run's reconstructions, then over seeds), and the kept L_rec share of each
reconstruction (Eq. 3's share left of its target, mean over seeds), then their mean.

    python docs/runs/networks/issue48/table.py FOLDER [FOLDER ...]
    SEEDS=0 python docs/runs/networks/issue48/table.py FOLDER ...    # only the records of these seeds
"""
import glob
import json
import os
import statistics
import sys


def cell(values, digits=2):
    if not values:
        return ""
    mean = statistics.mean(values)
    return f"{mean:.{digits}f}" + (f" ({statistics.stdev(values):.{digits}f})" if len(values) > 1 else "")


print("| folder | scenario | run | seeds | ACC | BWT | SSIM | share left, each reconstruction | mean share left |")
print("|---|---|---|---|---|---|---|---|---|")
for folder in sys.argv[1:]:
    groups = {}
    for path in sorted(glob.glob(f"{folder}/*.json")):
        r = json.load(open(path))
        if os.environ.get("SEEDS") and str(r["seed"]) not in os.environ["SEEDS"].split():
            continue
        groups.setdefault((r["scenario"], r["method"] + ("" if r["variant"] == "base" else "+" + r["variant"])),
                          []).append(r)
    for (scenario, name), runs in sorted(groups.items()):
        ssim = [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs if r["recon_quality"]]
        shares = [[rec["kept_terms"]["rec"] for rec in r["reconstructions"]] for r in runs
                  if r["reconstructions"] and "rec" in r["reconstructions"][0]["kept_terms"]]
        each = " / ".join(f"{statistics.mean(s):.0%}" for s in zip(*shares)) if shares else ""
        mean_left = cell([statistics.mean(s) for s in shares], 2) if shares else ""
        print(f"| {folder.split('issue48/')[-1]} | {scenario} | {name} | {len(runs)} | {cell([r['ACC'] for r in runs])} | "
              f"{cell([r['BWT'] for r in runs])} | {cell(ssim, 3)} | {each} | {mean_left} |")
# PAIRS=1: one row per folder and scenario, +ReCL beside +inversion (the grid's form); SEEDS as above
if os.environ.get("PAIRS"):
    print("\n| folder | scenario | seeds | ACC +ReCL / +inversion | SSIM +ReCL / +inversion | share left, each reconstruction |")
    print("|---|---|---|---|---|---|")
    for folder in sys.argv[1:]:
        runs = [json.load(open(p)) for p in sorted(glob.glob(f"{folder}/*.json"))]
        runs = [r for r in runs if not os.environ.get("SEEDS") or str(r["seed"]) in os.environ["SEEDS"].split()]
        for scenario in ("cil", "dil"):
            by = {v: [r for r in runs if r["scenario"] == scenario and r["variant"] == v] for v in ("recl", "inversion")}
            if not by["recl"]:
                continue
            acc = " / ".join(cell([r["ACC"] for r in by[v]]) or "-" for v in ("recl", "inversion"))
            ssim = " / ".join(cell([statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in by[v]], 3)
                              or "-" for v in ("recl", "inversion"))
            shares = [[rec["kept_terms"]["rec"] for rec in r["reconstructions"]] for r in by["recl"]]
            print(f"| {folder.split('issue48/')[-1]} | {scenario} | {len(by['recl'])} | {acc} | {ssim} | "
                  f"{' / '.join(f'{statistics.mean(s):.0%}' for s in zip(*shares))} |")
