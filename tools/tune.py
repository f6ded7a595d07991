"""Choose a method's lr, epochs and own hyperparameters by validation ACC (App. D.3): --draws settings of its grids."""
import dataclasses, itertools, sys  # noqa: E401
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules, from any folder
import data, recl, strategies, torch  # noqa: E401, E402

def tune():  # a random search without repetition, seeded by --seed; saves every trial, best first; prints the best
    parser = recl.make_parser("tune.py", __doc__)
    parser.add_argument("--draws", type=int, default=10, help="settings drawn from the grid (default: 10)")
    args = parser.parse_args()
    args.variant = args.variant or "base"  # so that check refuses the +ReCL flags of a base search
    recl.check(args)  # then tune's own refusals, each in one line
    grid = {**strategies.TRAINING_GRID, **strategies.STRATEGIES[args.method]["grid"]}  # lr, epochs, the method's own
    gridded = [f"--{k}" for k in grid if vars(args).get(k) is not None] + [f"--hp {k}" for k in grid if k in args.hp]
    for refused, why in [(args.variant == "both", "tune scores one variant: --variant base (the default) or recl"),
                         (args.save_images, "--save-images does not apply: tune keeps no run's reconstructions"),
                         (args.draws < 1, f"--draws must be at least 1, got {args.draws}"),
                         (gridded, f"tune chooses {', '.join(gridded)} itself; leave it out"),
                         (args.seeds is not None, "tune searches on one seed (--seed); --seeds does not apply")]:
        if refused:
            raise recl.UsageError(why)
    cfg = dataclasses.replace(recl.resolve(args, args.seed, recl.variants(args)[-1]), validation=True)
    name, log = data.variant_name(cfg.method, cfg.variant), lambda *a: args.quiet or print(*a, flush=True)
    (tasks, _, mean_image, _), combos = data.tasks_of(cfg), list(itertools.product(*grid.values()))
    recl.check_network(tasks, cfg)
    picks = torch.randperm(len(combos), generator=torch.Generator().manual_seed(cfg.seed))[:args.draws].tolist()
    log(f"tuning {name} {cfg.scenario}: {len(picks)} of {len(combos)} settings")
    def evaluate(i, chosen):  # the i-th pick's trial
        r = recl.run_continual(dataclasses.replace(cfg, lr=chosen["lr"], epochs=chosen["epochs"], hp={**cfg.hp, **{
            k: v for k, v in chosen.items() if k not in strategies.TRAINING_GRID}}), tasks, lambda *a: None, mean_image)
        outcome = f"diverged ({r['diverged']})" if r["diverged"] else f"validation ACC {r['ACC']:.2f}"
        log(f"  trial {i}/{len(picks)}: {chosen} -> {outcome} ({r['seconds']:.0f}s)")
        return dict(settings=chosen, val_ACC=r["ACC"], val_BWT=r["BWT"], seconds=r["seconds"], diverged=r["diverged"])
    trials = sorted((evaluate(i, dict(zip(grid, combos[pick]))) for i, pick in enumerate(picks, 1)),
                    key=lambda t: float("inf") if t["val_ACC"] is None else -t["val_ACC"])  # best first; ties: in order
    out = Path(args.out, f"{data.run_name(cfg)}-tuning-{data.digest(cfg)}-{args.draws}draws-seed{cfg.seed}.json")
    data.write_json_atomically(out, dict(method=name, scenario=cfg.scenario, dataset=Path(cfg.dataset).stem,
        seed=cfg.seed, draws=args.draws, trials=trials, config=dataclasses.asdict(cfg), provenance=data.provenance()))
    if trials[0]["val_ACC"] is None:
        raise recl.RunFailed(f"{name} {cfg.scenario}: every trial diverged ({out})")
    print(f"{name} {cfg.scenario}: best validation ACC {trials[0]['val_ACC']:.2f}, {trials[0]['settings']} -> {out}")

if __name__ == "__main__":
    recl.run_from_command_line(tune, "tune.py")
