"""The smooth ReLU two ways, one reconstruction step each, interleaved.

    python docs/runs/cost-probes/smooth_relu_forms.py     # from the repository root, 2 threads

"softplus": relu(z).detach() + softplus(z) - softplus(z).detach() (models.py until
commit edea89c); "function": the autograd.Function models.py has now (copied here so
the probe runs at any commit). MLP and CNN at m = 200, float32 and bfloat16: both
forms built, each warmed up twice, then 8 rounds that alternate which form goes
first; median seconds per step, and the relative difference of the candidates'
gradients. (Timing one form after the other in one process favours the second:
the first pays for warming the allocator and the oneDNN kernels.)
"""
import sys, time, statistics, torch
sys.path.insert(0, '.')
import torch.nn as nn
import models, recl, benchmark
torch.set_num_threads(2)

class Fn(torch.autograd.Function):
    generate_vmap_rule = True
    @staticmethod
    def forward(z, alpha):
        return z.clamp_min(0)
    @staticmethod
    def setup_context(ctx, inputs, output):
        z, ctx.alpha = inputs
        ctx.save_for_backward(z)
    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * torch.sigmoid(ctx.alpha * z), None

class FnReLU(nn.Module):
    def __init__(self, alpha):
        super().__init__(); self.alpha = alpha
    def forward(self, z):
        return Fn.apply(z, self.alpha)

def make_step(name, shape, m, form, prec):
    model = benchmark.trained_looking(name, shape, 10, torch.device("cpu"))
    net = models.with_smooth_relu(model, 100.).eval()
    if form == "function":
        for parent in net.modules():
            for n, child in parent.named_children():
                if isinstance(child, models.SmoothBackwardReLU):
                    setattr(parent, n, FnReLU(100.))
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
    labels = torch.arange(10).repeat_interleave(m // 10)
    x = (1e-3 * torch.randn(len(labels), *shape, generator=torch.Generator().manual_seed(1))).requires_grad_()
    lam = torch.rand(len(labels), generator=torch.Generator().manual_seed(2)).requires_grad_()
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bfloat16"):
            l = recl.reconstruction_losses(net, params, target, scale, x, labels, lam, 0.05)
        sum(l).backward(); g = x.grad.clone(); x.grad = lam.grad = None; return g
    return step

for name, shape in (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
    for prec in ("float32", "bfloat16"):
        steps = {f: make_step(name, shape, 200, f, prec) for f in ("softplus", "function")}
        grads = {f: s() for f, s in steps.items()}
        for s in steps.values(): s(); s()
        times = {f: [] for f in steps}
        for r in range(8):
            for f, s in (steps.items() if r % 2 == 0 else reversed(list(steps.items()))):
                t = time.perf_counter(); s(); times[f].append(time.perf_counter() - t)
        diff = ((grads["function"] - grads["softplus"]).norm() / grads["softplus"].norm()).item()
        print(name, prec, " ".join(f"{f} {statistics.median(v):.4f}s" for f, v in times.items()), f"grad rel diff {diff:.1e}", flush=True)
