"""Match before/after records by the old config fields and compare acc_matrix, ACC, BWT exactly."""
import json, sys
from pathlib import Path
def load(folder):
    out = []
    for p in sorted(Path(folder).glob("*.json")):
        r = json.loads(p.read_text()); out.append((p.name, r))
    return out
before, after = load(sys.argv[1]), load(sys.argv[2])
skip = {"budget", "device", "rec_precision"}
for name_a, a in after:
    ca = {k: v for k, v in a["config"].items() if k not in skip}
    match = [(n, b) for n, b in before if all(b["config"].get(k) == v for k, v in ca.items() if k in b["config"])]
    if len(match) != 1:
        print("NO UNIQUE MATCH", name_a, len(match)); continue
    n, b = match[0]
    same = b["acc_matrix"] == a["acc_matrix"] and b["ACC"] == a["ACC"] and b["BWT"] == a["BWT"]
    kl = [r.get("kept_loss") for r in b["reconstructions"]] == [r.get("kept_loss") for r in a["reconstructions"]]
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"
    print(f"{'SAME' if same and kl else 'DIFF'} | {a['method']}+{a['variant']} {a['scenario']} {a['config']['model']} paper={a['config']['paper']} | before ACC {fmt(b['ACC'])} BWT {fmt(b['BWT'])} | after ACC {fmt(a['ACC'])} BWT {fmt(a['BWT'])} | kept losses equal: {kl} | {n} -> {name_a}")
