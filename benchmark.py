"""What ReCL costs: one reconstruction step, and a whole run against its base method.

    python benchmark.py                    # CPU or CUDA (auto), about 2 minutes on 2 CPU cores
    python benchmark.py --no-runs          # only the step table (seconds)
    python benchmark.py --compile          # also the MLP step under torch.compile
    python benchmark.py --out bench.json   # where the JSON goes (default: results/benchmark-DEVICE.json)

Three measurements, printed as tables and written as one JSON file:

1. The machine's practical peak: GFLOP/s of a plain 2000 x 2000 float32 matrix product.
2. One reconstruction step (the losses of Eq. 3-5 and their backward, what
   recl.reconstruct repeats n_rec times) for the MLP on MNIST-shaped input and
   the CNN on CIFAR10-shaped input, at m = 200 and 800 candidates: seconds, the
   floating-point work counted by torch.profiler (matrix products and
   convolutions, forward and backward), and the rate achieved, also as a share of (1).
3. End to end: `python recl.py --scenario cil --method finetune` (SplitMNIST,
   seed 0, the shipped defaults) for Finetune and Finetune+ReCL, their seconds,
   the ratio, and where the +ReCL run spent its time (recl.run_continual's phases).

A benchmark, not a test: nothing here passes or fails.
"""
import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

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


def matmul_peak(device, n=2000, repeats=10):
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    seconds = timed(lambda: a @ b, device, repeats)
    return {"size": n, "seconds": seconds, "gflops": 2 * n ** 3 / seconds / 1e9}


@contextlib.contextmanager
def quiet_stderr():
    """The profiler's C++ side logs to file descriptor 2 on start and stop; hide that."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def trained_looking(name, input_shape, n_classes, device, seed=0):
    """A network whose weights moved away from their start, as after training."""
    torch.manual_seed(seed)
    model = models.build_model(name, input_shape, n_classes).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def reconstruction_step(name, input_shape, m, device, repeats, compiled=False):
    """Time and count one step of recl.reconstruct's loop for m candidates over 10 classes
    (with `compiled`, of torch.compile(recl.reconstruction_losses), its first call timed apart)."""
    model = trained_looking(name, input_shape, 10, device)
    cfg = argparse.Namespace(alpha=100.0, lambda_min=0.05)
    net = models.with_smooth_relu(model, cfg.alpha).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
    labels = torch.arange(10, device=device).repeat_interleave(m // 10)
    x = (1e-3 * torch.randn(len(labels), *input_shape, device=device)).requires_grad_()
    lam = torch.rand(len(labels), device=device).requires_grad_()

    losses_fn = torch.compile(recl.reconstruction_losses) if compiled else recl.reconstruction_losses

    def step():
        losses = losses_fn(net, params, target, scale, x, labels, lam, cfg.lambda_min)
        sum(losses).backward()
        x.grad = lam.grad = None

    first = time.perf_counter()
    step()  # a compiled function compiles here
    synchronise(device)
    first = time.perf_counter() - first
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        recl.reconstruction_losses(net, params, target, scale, x, labels, lam, cfg.lambda_min)[0].backward()
    x.grad = lam.grad = None
    flops = sum(event.flops for event in prof.key_averages())
    seconds = timed(step, device, repeats)
    return {"model": name, "m": m, "compiled": compiled, "first_call_seconds": first, "seconds": seconds,
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

    peak = matmul_peak(device)
    print(f"matrix product {peak['size']}x{peak['size']}: {peak['gflops']:.0f} GFLOP/s", flush=True)
    steps = []
    print("| model | m | seconds per step | GFLOP per step | GFLOP/s | share of matmul rate |")
    print("|---|---|---|---|---|---|")
    for name, shape in (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
        for m in (200, 800):
            row = reconstruction_step(name, shape, m, device, args.repeats)
            row["share_of_matmul"] = row["gflops"] / peak["gflops"]
            steps.append(row)
            print(f"| {name} | {m} | {row['seconds']:.3f} | {row['gflop']:.1f} | {row['gflops']:.0f} "
                  f"| {row['share_of_matmul']:.2f} |", flush=True)
    if args.compile:
        print("\n| torch.compile | m | seconds per step | eager | first call (compiling) |\n|---|---|---|---|---|")
        for m in (200, 800):
            row = reconstruction_step("mlp", (1, 28, 28), m, device, args.repeats, compiled=True)
            eager = next(r["seconds"] for r in steps if r["model"] == "mlp" and r["m"] == m)
            steps.append(row)
            print(f"| mlp | {m} | {row['seconds']:.4f} | {eager:.4f} | {row['first_call_seconds']:.1f} |", flush=True)
    result = {"machine": machine, "matmul": peak, "steps": steps}
    if not args.no_runs:
        runs = end_to_end(device)
        result["runs"] = runs
        print("\n| SplitMNIST CIL, seed 0 | seconds | ACC | reconstruct | quality report | train | evaluate |")
        print("|---|---|---|---|---|---|---|")
        for name in ("finetune", "finetune+recl"):
            r, ph = runs[name], runs[name]["phase_seconds"]
            print(f"| {name} | {r['seconds']:.1f} | {r['ACC']:.2f} | {ph['reconstruct']:.1f} "
                  f"| {ph['quality_report']:.1f} | {ph['train']:.1f} | {ph['evaluate']:.1f} |")
        print(f"Finetune+ReCL / Finetune: {runs['ratio']:.1f}x")
    out = Path(args.out or f"results/benchmark-{device.type}.json")
    recl.write_json_atomically(out, result)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
