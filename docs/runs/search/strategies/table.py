"""The strategy table of docs/reconstruction-quality.md, from the runs in this folder,
beside the paper's (its appendix tables "varying number of reconstruction samples m").

    python docs/runs/search/strategies/table.py
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the paper's Finetune+ReCL, ACC and BWT mean (std), 5 seeds: naive, unsup, sup
PAPER = {
    "cil": {25: ["58.16 / -38.58", "60.54 / -38.07", "56.32 / -46.04"],
            50: ["63.83 / -31.91", "61.39 / -34.13", "59.37 / -39.15"],
            100: ["71.76 / -21.82", "66.99 / -20.64", "67.45 / -23.49"]},
    "dil": {25: ["81.58 / -7.74", "81.39 / -7.67", "80.98 / -9.48"],
            50: ["81.75 / -7.64", "81.18 / -7.91", "80.91 / -10.23"],
            100: ["83.80 / -4.91", "81.36 / -5.69", "80.84 / -10.33"]},
}


def cell(values, digits=2):
    if not values:
        return "not run"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ({std:.{digits}f})"


for scenario in ("cil", "dil"):
    print(f"\n**{scenario.upper()}**\n")
    print("| m | strategy | seeds | ACC | BWT | SSIM | reconstruction s per run | paper ACC / BWT |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (25, 50, 100):
        for i, strategy in enumerate(("naive", "unsup", "sup")):
            runs = [json.loads(p.read_text()) for p in
                    sorted((HERE / f"m-{m}").glob(f"mnist-{scenario}-finetune+recl-*seed*.json"))]
            runs = [r for r in runs if not r.get("diverged") and (r["config"]["tuning"] or "naive") == strategy]
            ssim = [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs if r["recon_quality"]]
            print(f"| {m} | {strategy} | {len(runs)} | {cell([r['ACC'] for r in runs])} | "
                  f"{cell([r['BWT'] for r in runs])} | {cell(ssim, 3)} | "
                  f"{cell([r['phase_seconds']['reconstruct'] for r in runs], 0)} | {PAPER[scenario][m][i]} |")
