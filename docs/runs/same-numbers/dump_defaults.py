"""Dump every resolved default: method x scenario x model x variant x {plain, --paper} and a few flag combos."""
import dataclasses, json, sys, itertools
sys.path.insert(0, ".")
import config
import cli
rows = {}
extras = [[], ["--paper"], ["--tuning", "unsup"], ["--rec-optimizer", "sgd"], ["--rec-optimizer", "adam"],
          ["--n-per-class", "all"], ["--paper", "--rec-optimizer", "adam"], ["--validation"]]
for scenario, method, model, extra in itertools.product(["cil", "dil"], config.METHODS, ["mlp", "cnn", "alexnet", "resnet18"], extras):
    for variant in ["base", "recl", "inversion"]:
        if method == "joint" and variant != "base":
            continue
        argv = ["--scenario", scenario, "--method", method, "--model", model]
        if variant == "base":
            argv += ["--variant", "base"]
            if extra and extra[0] != "--validation" and extra != ["--n-per-class", "all"]:
                continue
        elif variant == "recl":
            argv += ["--variant", "recl"]
        else:
            argv += ["--variant", "recl", "--rec-objective", "inversion"]
        argv += extra
        if method == "joint":
            argv = [a for a in argv if a not in ("--variant", "base")]
        args = cli.make_parser().parse_args(argv)
        try:
            cli.check(args, probe_out=False)
        except cli.UsageError as e:
            rows[" ".join(argv)] = {"refused": str(e)}
            continue
        cfg = config.resolve(args, 0, variant)
        rows[" ".join(argv)] = {"config": dataclasses.asdict(cfg), "digest": config.digest(cfg),
                                "header": config.describe(cfg)}
json.dump(rows, open(sys.argv[1], "w"), indent=0, sort_keys=True)
print(len(rows), sum("refused" in r for r in rows.values()))
