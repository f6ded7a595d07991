"""What ReCL costs: one reconstruction step, and a whole run against its base method.

    python benchmark.py                    # CPU or CUDA (auto), about 2 minutes on 2 CPU cores
    python benchmark.py --no-runs          # only the step table (seconds)
    python benchmark.py --compile          # also the MLP step under torch.compile
    python benchmark.py --out bench.json   # where the JSON goes (default: results/benchmark-DEVICE.json)

Three measurements, printed as tables and written as one JSON file:

1. The machine's practical peak: GFLOP/s of a plain 2000 x 2000 matrix product,
   in float32 and in bfloat16.
2. One reconstruction step (the losses of Eq. 3-5 and their backward, what
   recl.reconstruct repeats n_rec times) for the MLP on MNIST-shaped input and
   the CNN on CIFAR10-shaped input, at m = 200 and 800 candidates, in float32 and
   under bfloat16 autocast (--rec-precision): seconds, the floating-point work
   of its matrix products and convolutions (forward, backward and double
   backward, by torch.utils.flop_counter's formulas), and the rate achieved,
   also as a share of the float32 peak in (1).
3. End to end: `python recl.py --scenario cil --method finetune` (SplitMNIST,
   seed 0, the shipped defaults) for Finetune and Finetune+ReCL, their seconds,
   the ratio, and where the +ReCL run spent its time (recl.run_continual's phases).

A benchmark, not a test: nothing here passes or fails.
"""
import argparse
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import data
import models
import recl


def synchronise(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    synchronise(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronise(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_peak(device, dtype=torch.float32, n=2000, repeats=10):
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats)
    return {"size": n, "seconds": seconds, "gflops": 2 * n ** 3 / seconds / 1e9}


class CountFlops(TorchDispatchMode):
    """Counts the floating-point operations of every matrix product and convolution run
    inside it, forward and backward, with the formulas of torch.utils.flop_counter.

    Why not the usual tools: torch.profiler's with_flops leaves out
    convolution_backward, so it counted the CNN step at 0.37 of its real work (this
    benchmark used it before and so put the CNN step at 0.1-0.2 of the matmul rate;
    docs/cost.md); FlopCounterMode tracks modules with hooks that torch.func.grad breaks.
    """

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def trained_looking(name, input_shape, n_classes, device, seed=0):
    """A network whose weights moved away from their start, as after training."""
    torch.manual_seed(seed)
    model = models.build_model(name, input_shape, n_classes).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def reconstruction_problem(name, input_shape, m, device):
    """What one step of recl.reconstruct works on, for m candidates over 10 classes: the
    smooth-ReLU copy of a trained-looking network, its parameters, the displacement
    target and its scale, the candidates, their labels and lambdas (also for the
    probes in docs/runs/cost-probes/)."""
    model = trained_looking(name, input_shape, 10, device)
    net = models.with_smooth_relu(model, 100.0).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
    labels = torch.arange(10, device=device).repeat_interleave(m // 10)
    x = (1e-3 * torch.randn(len(labels), *input_shape, device=device)).requires_grad_()
    lam = torch.rand(len(labels), device=device).requires_grad_()
    return net, params, target, scale, x, labels, lam


def reconstruction_step(name, input_shape, m, device, repeats, precision="float32", compiled=False):
    """Time and count one step of recl.reconstruct's loop for m candidates over 10 classes, its
    products in `precision` (with `compiled`, of torch.compile(recl.reconstruction_losses),
    its first call timed apart)."""
    net, params, target, scale, x, labels, lam = reconstruction_problem(name, input_shape, m, device)
    lambda_min = 0.05

    compute = torch.compile(recl.reconstruction_losses) if compiled else recl.reconstruction_losses

    def losses_fn(*args):  # as recl.reconstruct calls it
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            return compute(*args)

    def step():
        losses = losses_fn(net, params, target, scale, x, labels, lam, lambda_min)
        sum(losses.values()).backward()
        x.grad = lam.grad = None

    first = time.perf_counter()
    step()  # a compiled function compiles here
    synchronise(device)
    first = time.perf_counter() - first
    with CountFlops() as counter:  # the same work in either format; counted uncompiled
        sum(recl.reconstruction_losses(net, params, target, scale, x, labels, lam, lambda_min).values()).backward()
    x.grad = lam.grad = None
    flops = counter.flops
    seconds = timed(step, device, repeats)
    return {"model": name, "m": m, "precision": precision, "compiled": compiled, "first_call_seconds": first,
            "seconds": seconds,
            "gflop": flops / 1e9, "gflops": flops / seconds / 1e9}


def end_to_end(device):
    """Finetune and Finetune+ReCL, SplitMNIST CIL, seed 0, as the command line runs them."""
    cfg = recl.resolve_defaults(recl.make_parser().parse_args(["--device", device.type]))
    recl.check_args(cfg)
    tasks, _, mean_image = data.make_tasks(cfg.dataset, 0, cfg.n_per_class, cfg.scenario, cfg.classes_per_task,
                                           cfg.data_root)
    runs = {}
    for use_recl in (False, True):
        record = recl.run_continual(recl.run_config(cfg, 0, use_recl), tasks, cfg.method, use_recl,
                                    lambda *a: None, mean_image)
        runs["finetune+recl" if use_recl else "finetune"] = {
            "seconds": record["seconds"], "ACC": record["ACC"], "phase_seconds": record["phase_seconds"]}
    runs["rec_precision"] = cfg.rec_precision
    runs["ratio"] = runs["finetune+recl"]["seconds"] / runs["finetune"]["seconds"]
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per step (median)")
    p.add_argument("--no-runs", action="store_true", help="skip the end-to-end runs")
    p.add_argument("--compile", action="store_true",
                   help="also time the MLP step under torch.compile (compiling takes seconds to a minute)")
    p.add_argument("--out", default=None, help="JSON file (default: results/benchmark-DEVICE.json)")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    machine = recl.provenance()
    print(f"device {machine['device']}, {machine['threads']} threads, torch {machine['torch']}", flush=True)

    peak, peak_bf16 = matmul_peak(device), matmul_peak(device, torch.bfloat16)
    print(f"matrix product {peak['size']}x{peak['size']}: {peak['gflops']:.0f} GFLOP/s in float32, "
          f"{peak_bf16['gflops']:.0f} in bfloat16", flush=True)
    steps = []
    print("| model | m | products in | seconds per step | GFLOP per step | GFLOP/s | share of float32 matmul rate |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
        for m in (200, 800):
            for precision in ("float32", "bfloat16"):
                row = reconstruction_step(name, shape, m, device, args.repeats, precision)
                row["share_of_matmul"] = row["gflops"] / peak["gflops"]
                steps.append(row)
                print(f"| {name} | {m} | {precision} | {row['seconds']:.3f} | {row['gflop']:.1f} | "
                      f"{row['gflops']:.0f} | {row['share_of_matmul']:.2f} |", flush=True)
    if args.compile:
        print("\n| torch.compile | m | seconds per step | eager | first call (compiling) |\n|---|---|---|---|---|")
        for m in (200, 800):
            row = reconstruction_step("mlp", (1, 28, 28), m, device, args.repeats, compiled=True)
            eager = next(r["seconds"] for r in steps
                         if r["model"] == "mlp" and r["m"] == m and r["precision"] == "float32")
            steps.append(row)
            print(f"| mlp | {m} | {row['seconds']:.4f} | {eager:.4f} | {row['first_call_seconds']:.1f} |", flush=True)
    result = {"machine": machine, "matmul": peak, "matmul_bfloat16": peak_bf16, "steps": steps}
    if not args.no_runs:
        runs = end_to_end(device)
        result["runs"] = runs
        print("\n| SplitMNIST CIL, seed 0 | seconds | ACC | reconstruct | quality report | train | evaluate |")
        print("|---|---|---|---|---|---|---|")
        for name in ("finetune", "finetune+recl"):
            r, ph = runs[name], runs[name]["phase_seconds"]
            print(f"| {name} | {r['seconds']:.1f} | {r['ACC']:.2f} | {ph['reconstruct']:.1f} "
                  f"| {ph['quality_report']:.1f} | {ph['train']:.1f} | {ph['evaluate']:.1f} |")
        print(f"Finetune+ReCL / Finetune: {runs['ratio']:.1f}x (reconstruction in {runs['rec_precision']})")
    out = Path(args.out or f"results/benchmark-{device.type}.json")
    recl.write_json_atomically(out, result)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
