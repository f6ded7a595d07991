"""Choose a method's lr, epochs and own hyperparameters on a validation split (paper App. D.3): --draws settings
from strategies.TRAINING_GRID and the method's grid, each scored by the validation ACC of the method alone (or
with --variant recl, of its +ReCL variant) on seed --seed; every trial to OUT/NAME-tuning-DIGEST-Ndraws-seedS.json.
Usage: python tools/tune.py --method ewc --scenario cil [--draws 10] [recl.py's flags]"""
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import judging  # noqa: E402
import recl  # noqa: E402
import strategies  # noqa: E402


def tune_method(cfg, draws, log=print):
    """Random search: `draws` settings of the grids, without repetition (seeded by cfg.seed), each scored by the
    ACC of the run `cfg` describes on the validation split. Every trial, best first (a diverged one last)."""
    tasks, _, mean_image, _ = config.make_tasks(cfg)
    config.check_tasks(tasks, cfg)
    grid = {**strategies.TRAINING_GRID, **strategies.STRATEGIES[cfg.method]["grid"]}
    combos = list(itertools.product(*grid.values()))
    picks = torch.randperm(len(combos), generator=torch.Generator().manual_seed(cfg.seed))[:draws].tolist()
    candidates = [dict(zip(grid, combos[pick])) for pick in picks]
    log(f"tuning {config.variant_name(cfg.method, cfg.variant)} {cfg.scenario}: {len(picks)} of {len(combos)} settings")
    search = lambda with_cfg, old, c, log: judging.search_reconstruction(with_cfg, old, c, log, mean_image)
    def evaluate(chosen):
        own = {k: v for k, v in chosen.items() if k not in strategies.TRAINING_GRID}
        run = dataclasses.replace(cfg, lr=chosen["lr"], epochs=chosen["epochs"], hp={**cfg.hp, **own})
        r = recl.run_continual(run, tasks, lambda *a: None, search=search)
        outcome = f"diverged ({r['diverged']})" if r["diverged"] else f"validation ACC {r['ACC']:.2f}"
        log(f"  trial {candidates.index(chosen) + 1}/{len(candidates)}: {chosen} -> {outcome} ({r['seconds']:.0f}s)")
        trial = dict(settings=chosen, val_ACC=r["ACC"], val_BWT=r["BWT"], seconds=r["seconds"], diverged=r["diverged"])
        return float("-inf") if r["ACC"] is None else r["ACC"], trial, None
    return [trial for _, _, trial in judging.random_search(candidates, evaluate)[0]]


def tune():
    """Run the validation search on one variant, save every trial, print the winner."""
    parser = config.make_parser("tune.py", __doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=10, help="settings drawn from the grid (default: 10)")
    args = parser.parse_args()
    args.variant = args.variant or "base"  # so that check refuses the +ReCL flags of a base search
    config.check(args)
    gridded = [flag for flag, given in (("--lr", args.lr), ("--epochs", args.epochs)) if given is not None]
    gridded += [f"--hp {key}" for key in strategies.STRATEGIES[args.method]["grid"] if key in args.hp]
    for refused, why in [(args.variant == "both", "tune scores one variant: --variant base (the default) or recl"),
                         (args.save_images, "--save-images does not apply: tune keeps no run's reconstructions"),
                         (args.draws < 1, f"--draws must be at least 1, got {args.draws}"),
                         (gridded, f"tune chooses {', '.join(gridded)} itself; leave it out"),
                         (args.validation, "tune always scores on the validation split; --validation does not apply"),
                         (args.seeds is not None, "tune searches on one seed (--seed); --seeds does not apply")]:
        if refused:
            raise config.UsageError(why)
    variant = config.variants(args)[-1] if args.variant == "recl" else "base"
    cfg = dataclasses.replace(config.resolve(args, args.seed, variant), validation=True)
    name = config.variant_name(cfg.method, cfg.variant)
    trials = tune_method(cfg, args.draws, (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True)))
    path = Path(args.out, f"{config.run_name(cfg)}-tuning-{config.digest(cfg)}-{args.draws}draws-seed{cfg.seed}.json")
    config.write_json_atomically(path, dict(
        method=name, scenario=cfg.scenario, dataset=config.dataset_name(cfg.dataset), seed=cfg.seed, draws=args.draws,
        trials=trials, config=dataclasses.asdict(cfg), provenance=config.provenance()))
    if trials[0]["val_ACC"] is None:
        raise config.RunFailed(f"{name} {cfg.scenario}: every trial diverged ({path})")
    print(f"{name} {cfg.scenario}: best validation ACC {trials[0]['val_ACC']:.2f}, {trials[0]['settings']} -> {path}")


if __name__ == "__main__":
    config.run_from_command_line(tune, "tune.py")
