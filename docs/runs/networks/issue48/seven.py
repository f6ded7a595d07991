"""The CNN's test table with all seven methods (networks.md, seventh round): per scenario and method, ACC
mean (std) alone, +ReCL and +inversion over the seeds each has, on how many paired seeds +ReCL beats alone
and +inversion, SSIM of +ReCL and +inversion, and the share Eq. 3 leaves (mean over reconstructions and
seeds). Diverged records are counted, never averaged. Records are read from the folders in order; a later
folder's record replaces an earlier one of the same scenario, run and seed (cnn-v3-er's ER in CIL).

    python docs/runs/networks/issue48/seven.py docs/runs/networks/cnn-v2 docs/runs/networks/cnn-v3-er docs/runs/networks/cnn-seven \
        docs/runs/networks/cnn-seven-ewc1
"""
import glob
import json
import statistics
import sys

METHODS = ["finetune", "er", "ewc", "upgd", "agem", "lwf", "gpm"]
records = {}
for folder in sys.argv[1:]:
    for path in sorted(glob.glob(f"{folder}/*.json")):
        r = json.load(open(path))
        if r["method"] in METHODS:
            records[(r["scenario"], r["method"], r["variant"], r["seed"])] = r


def cell(values, digits=2):
    if not values:
        return ""
    return f"{statistics.mean(values):.{digits}f}" + (f" ({statistics.stdev(values):.{digits}f})" if len(values) > 1 else "")


for scenario in ("cil", "dil"):
    if not any(sc == scenario for sc, *_ in records):  # a scenario with no records: no table
        continue
    print(f"\n**{scenario.upper()}**\n")
    print("| method | seeds | alone | +ReCL | +inversion | +ReCL above alone / +inversion | SSIM +ReCL / +inversion | "
          "share left (+ReCL) |")
    print("|---|---|---|---|---|---|---|---|")
    leads, gains = [], []
    for method in METHODS:
        runs = {v: {s: r for (sc, m, vv, s), r in records.items() if (sc, m, vv) == (scenario, method, v)}
                for v in ("base", "recl", "inversion")}
        ok = {v: {s: r["ACC"] for s, r in rs.items() if not r["diverged"]} for v, rs in runs.items()}
        div = {v: len(rs) - len(ok[v]) for v, rs in runs.items()}
        both = lambda a, b: sorted(set(ok[a]) & set(ok[b]))
        above = lambda a, b: f"{sum(ok['recl'][s] > ok[b][s] for s in both(a, b))} of {len(both(a, b))}"
        ssim = {v: [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs[v].values()
                    if r["recon_quality"] and not r["diverged"]] for v in ("recl", "inversion")}
        share = [statistics.mean(x["kept_terms"]["rec"] for x in r["reconstructions"]) for r in runs["recl"].values()
                 if not r["diverged"] and r["reconstructions"]]
        seeds = sorted(set().union(*[set(rs) for rs in runs.values()]))
        acc = {v: cell(list(ok[v].values())) + (f", {div[v]} diverged" if div[v] else "") for v in ok}
        print(f"| {method} | {len(seeds)} | {acc['base']} | {acc['recl']} | {acc['inversion']} | "
              f"{above('recl', 'base')} / {above('recl', 'inversion')} | {cell(ssim['recl'], 3)} / "
              f"{cell(ssim['inversion'], 3)} | {f'{statistics.mean(share):.0%}' if share else ''} |")
        if ok["recl"] and ok["inversion"]:
            leads.append(statistics.mean(ok["recl"].values()) - statistics.mean(ok["inversion"].values()))
        if ok["recl"] and ok["base"]:
            gains.append(statistics.mean(ok["recl"].values()) - statistics.mean(ok["base"].values()))
    print(f"\n{scenario.upper()}: +ReCL - +inversion, mean over methods {statistics.mean(leads):+.2f} "
          f"({' '.join(f'{x:+.2f}' for x in leads)}); +ReCL - alone {statistics.mean(gains):+.2f} "
          f"({' '.join(f'{x:+.2f}' for x in gains)})")
