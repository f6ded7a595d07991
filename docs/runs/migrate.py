"""One-off: give the run records under docs/runs the config and file name of today's code.

Until the restructuring that wrote every default once (issue 42), a record's digest
left out a list of settings added after runs were shipped (config.ADDED_LATER), at
the value those runs used, and kept the settings of removed levers. Today the
digest covers every field of config.Config and nothing else. This script rewrites
each record once, in place of the old file:

- settings of removed levers (departures 7, 10, 12, weight decay) leave the config;
  at the value that did nothing they are dropped, otherwise kept under "retired"
  and counted in the digest, so such a run never shares a name with today's;
- fields added later get the value those runs used (CE over all classes, SGD, no
  replay batch, no backtracking; None where the variant does not use them);
- `budget` (new) names which rows lr, epochs and hp came from, by today's rule:
  "alone" with --paper and for AlexNet's +ReCL, "recl" otherwise, None alone.

Numbers (ACC, BWT, R, SSIM, seconds) are untouched; files named like a record (its
images) follow its new name. Prints old -> new digests, for the docs.

    python docs/runs/migrate.py docs/runs
"""
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli  # noqa: E402
import config  # noqa: E402

DID_NOTHING = {"bn_weight": 0.0, "stats_weight": 0.0, "tv_weight": 0.0, "jitter": 0, "rec_distance": "l2",
               "weight_decay": 0.0}
USED_BEFORE = {"ce_scope": "all", "rec_optimizer": "sgd", "replay_batch": 0, "backtrack": False}


def new_config(old):
    recl = old["variant"] != "base"
    cfg = {k: v for k, v in old.items() if k in config.FIELDS}
    retired = {k: v for k, v in old.items() if k not in config.FIELDS and v not in (None, DID_NOTHING.get(k))}
    for k, v in USED_BEFORE.items():
        cfg.setdefault(k, v if recl or k == "ce_scope" else None)
    cfg.setdefault("budget", None if not recl else "alone" if cfg.get("paper") or cfg["model"] == "alexnet"
                   else "recl")
    return config.Config(**cfg), retired


def digest(cfg, retired):
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in config.NOT_IN_DIGEST}
    settings.update({f"retired_{k}": v for k, v in retired.items()})
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def migrate(path):
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or "digest" not in record or "config" not in record:
        return None
    cfg, retired = new_config(record["config"])
    retired = {**record.get("retired", {}), **retired}
    old, key = record["digest"], digest(cfg, retired)
    record.update(config=dataclasses.asdict(cfg), digest=key)
    if retired:
        record["retired"] = retired
    new = path.with_name(path.name.replace(f"-{old}-", f"-{key}-"))
    if new.exists() and new != path:
        raise SystemExit(f"{new} exists already: {path} would overwrite it")
    cli.write_json_atomically(new, record)
    if new != path:
        path.unlink()
        for sibling in path.parent.glob(path.stem + ".*"):  # its images
            sibling.rename(sibling.with_name(sibling.name.replace(f"-{old}-", f"-{key}-")))
        for sibling in path.parent.glob(path.stem + "-*"):
            sibling.rename(sibling.with_name(sibling.name.replace(f"-{old}-", f"-{key}-")))
    return old, key


if __name__ == "__main__":
    for root in sys.argv[1:]:
        for path in sorted(Path(root).rglob("*.json")):
            moved = migrate(path)
            if moved is not None and moved[0] != moved[1]:
                print(*moved)
