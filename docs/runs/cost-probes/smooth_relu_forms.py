"""The smooth ReLU two ways, one reconstruction step each, interleaved.

    python docs/runs/cost-probes/smooth_relu_forms.py     # from the repository root, 2 threads

"function": models.SmoothBackwardReLU, an autograd.Function since commit f240c32;
"softplus": relu(z).detach() + softplus(z) - softplus(z).detach() (models.py before
that), swapped into the same network here. MLP and CNN at m = 200, float32 and
bfloat16: both forms built, each warmed up twice, then 8 rounds that alternate
which form goes first; median seconds per step, and the relative difference of the
candidates' gradients. (Timing one form after the other in one process favours the
second: the first pays for warming the allocator and the oneDNN kernels.)
"""
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, '.')
import models, recl  # noqa: E402
import experiments as benchmark  # noqa: E402  (benchmark.py until the reorganisation)

torch.set_num_threads(2)


class SoftplusReLU(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, z):
        smooth = F.softplus(z, beta=self.alpha)
        return torch.relu(z).detach() + smooth - smooth.detach()


def make_step(name, shape, form, prec):
    net, params, target, scale, x, labels, lam = benchmark.reconstruction_problem(name, shape, 200, torch.device("cpu"))
    if form == "softplus":
        for parent in net.modules():
            for child_name, child in parent.named_children():
                if isinstance(child, models.SmoothBackwardReLU):
                    setattr(parent, child_name, SoftplusReLU(child.alpha))
    with torch.no_grad():  # the same candidates and lambdas for both forms
        x.copy_(1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)))
        lam.copy_(torch.rand(lam.shape, generator=torch.Generator().manual_seed(2)))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bfloat16"):
            l = benchmark.eq6_losses(net, params, target, scale, x, labels, lam, 0.05)
        sum(l.values()).backward(); g = x.grad.clone(); x.grad = lam.grad = None; return g
    return step


for name, shape in (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
    for prec in ("float32", "bfloat16"):
        steps = {f: make_step(name, shape, f, prec) for f in ("softplus", "function")}
        grads = {f: s() for f, s in steps.items()}
        for s in steps.values(): s(); s()
        times = {f: [] for f in steps}
        for r in range(8):
            for f, s in (steps.items() if r % 2 == 0 else reversed(list(steps.items()))):
                t = time.perf_counter(); s(); times[f].append(time.perf_counter() - t)
        diff = ((grads["function"] - grads["softplus"]).norm() / grads["softplus"].norm()).item()
        print(name, prec, " ".join(f"{f} {statistics.median(v):.4f}s" for f, v in times.items()), f"grad rel diff {diff:.1e}", flush=True)
