"""One-off: give the run records under docs/runs the config and file name of today's recl.py.

Until commit b6d5d3d a run's JSON held its command line's namespace as its config
and was named without one, so runs with different settings could share a file or
a table row. Today a record holds a config.Config and its digest, and its file
is named by both (config.result_path). This script rewrites each old record in
place of the old file: the settings it ran with, written as a Config (fields a
variant does not use become None; flags that no longer exist are kept under
"retired" and counted in the digest), and each reconstruction's report gains
"failed" by today's rule. The numbers (ACC, BWT, R, SSIM, seconds) are untouched.

    python docs/runs/migrate.py docs/runs        # prints old -> new names
"""
import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import config  # noqa: E402

NOT_A_SETTING = {"out", "quiet", "seeds", "variant", "save_images", "aggregate", "pending", "queue", "tune",
                 "rec_objective"}
BEFORE_THEIR_FLAG = {"ce_weight": 0.0, "paper": False}  # what the code did before these flags existed


def failed(report):
    """Today's rule, on what an old report recorded: the old loop kept its last candidates."""
    if report.get("diverged") or report.get("finite", report.get("candidates")) != report.get("candidates"):
        return f"diverged at step {report.get('steps', '?')}"
    first, last = report.get("first_loss"), report.get("last_loss")
    if first is None or last is None or not math.isfinite(last):
        return None
    return f"climbed from {first:.4g} to {last:.4g}" if last > first else (
        "no step lowered the loss" if last == first else None)


def new_config(record):
    old = {**BEFORE_THEIR_FLAG, **record["config"]}
    variant = "base" if not record["recl"] else (
        "inversion" if old.get("rec_objective") == "inversion" else "recl")
    fields = {f.name for f in dataclasses.fields(config.Config)}
    cfg = {k: v for k, v in old.items() if k in fields}
    cfg.update(variant=variant, method=record["method"], scenario=record["scenario"], seed=record["seed"])
    recl_fields = [f for f in config.RECL_FLAGS if f in fields]
    if variant == "base":
        cfg.update({k: None for k in recl_fields}, paper=False)
    else:
        if (cfg.get("tuning") or "naive") == "naive":
            cfg["trials"] = None
        if variant == "inversion":
            cfg.update({k: None for k in config.NOT_FOR_INVERSION})
    retired = {k: v for k, v in old.items() if k not in fields and k not in NOT_A_SETTING}
    return config.Config(**cfg), retired


def digest(cfg, retired):
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in config.NOT_IN_DIGEST}
    settings.update({f"retired_{k}": v for k, v in retired.items()})
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def migrate(path):
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or "digest" in record or "trials" in record or "config" not in record \
            or "method" not in record:
        return None
    cfg, retired = new_config(record)
    key = digest(cfg, retired)
    for report in record.get("reconstructions", []):
        report["failed"] = failed(report)
    record.update(variant=cfg.variant, config=dataclasses.asdict(cfg), digest=key,
                  dataset=record.get("dataset", config.dataset_name(cfg.dataset)),
                  failed_reconstructions=sum(bool(r["failed"]) for r in record.get("reconstructions", [])))
    record.setdefault("phase_seconds", {"reconstruct": 0.0})
    if retired:
        record["retired"] = retired
    new = path.with_name(f"{config.run_name(cfg)}-{key}-seed{cfg.seed}.json")
    if new.exists() and new != path:
        raise SystemExit(f"{new} exists already: {path} would overwrite it")
    config.write_json_atomically(new, record)
    if new != path:
        path.unlink()
    return new


if __name__ == "__main__":
    for root in sys.argv[1:]:
        for path in sorted(Path(root).rglob("*.json")):
            new = migrate(path)
            if new is not None:
                print(f"{path} -> {new.name}")
