"""One CNN reconstruction step (m = 200, CIFAR10-shaped) in float32 and under bfloat16
autocast, each in the default and the channels-last memory layout.

    python docs/runs/cost-probes/cnn_bfloat16.py     # 2 threads, best of 5 after a warm-up

Prints seconds per step and the relative difference of the candidates' gradient
from float32's (docs/cost.md has the table).
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import experiments as benchmark  # noqa: E402  (benchmark.py until the reorganisation)
import models  # noqa: E402
import recl  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
model = benchmark.trained_looking("cnn", (3, 32, 32), 10, torch.device("cpu"))
labels = torch.arange(10).repeat_interleave(20)
x0 = 1e-3 * torch.randn(200, 3, 32, 32)
lam = torch.rand(200).requires_grad_()
reference = None
for layout in (torch.contiguous_format, torch.channels_last):
    net = models.with_smooth_relu(model, 100.0).eval().to(memory_format=layout)
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
    x = x0.clone().to(memory_format=layout).requires_grad_()
    for precision in ("float32", "bfloat16"):
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
                losses = benchmark.eq6_losses(net, params, target, scale, x, labels, lam, 0.05)
            sum(losses.values()).backward()
            g = x.grad.clone()
            x.grad = lam.grad = None
            return g
        step()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            g = step()
            times.append(time.perf_counter() - start)
        reference = g if reference is None else reference
        diff = ((g - reference).norm() / reference.norm()).item()
        name = "channels last" if layout is torch.channels_last else "default"
        print(f"{name:13s} {precision:8s} {min(times):.3f} s  gradient vs float32 default: {diff:.2e}", flush=True)
