"""Copy into docs/runs/cnn-arms the CNN's existing SplitFashionMNIST records that today's code names the same way:
each method alone, +ReCL and +inversion, seeds 0-4 (CIL on the CPU, Finetune's, ER's, LwF's and GPM's variants
with Step 1 in bfloat16, as those runs were made; DIL on one H200). The new arms (alone at ReCL's budget, +real, +centroids) run beside them with run_all.sh.
Usage, from the repository root: python docs/runs/cnn-arms/gather.py"""
import glob
import os
import shutil
import sys

sys.path.insert(0, ".")
import config  # noqa: E402

found = {}
for path in glob.glob("docs/runs/networks/**/*.json", recursive=True):
    found.setdefault(os.path.basename(path), []).append(path)
EWC = {"cil": 1.0, "dil": 10.0}  # EWC's lambda on the CNN, given as a flag (docs/networks.md)
for scenario in ("cil", "dil"):
    for method in config.METHODS:
        if method == "joint":
            continue
        for variant, extra in (("base", []), ("recl", []), ("inversion", ["--replay-source", "inversion"])):
            for seed in range(5):
                for precision in ([[]] if variant == "base" else [[], ["--rec-precision", "bfloat16"]]):
                    args = config.make_parser().parse_args(["--dataset", "fashion-mnist", "--model", "cnn", "--scenario",
                                                            scenario, "--method", method, *extra, *precision])
                    args.hp = {"ewc_lambda": EWC[scenario]} if method == "ewc" else {}
                    name = config.result_path("x", config.resolve(args, seed, variant)).name
                    paths = sorted(found.get(name, []), key=lambda p: "issue48/gpu/test-dil" not in p)  # GPU's first
                    if paths:
                        shutil.copy(paths[0], f"docs/runs/cnn-arms/{name}")
                        break
                else:
                    print(f"missing: {method} {variant} {scenario} seed {seed}")
