# Probe (docs/cost.md), run from the repository root at e57c1a2: python docs/runs/cost-probes/profile_cnn_step.py
import sys, time, torch
sys.path.insert(0, '.')
import models, recl, benchmark
from torch.profiler import profile, ProfilerActivity
m = 200
model = benchmark.trained_looking("cnn", (3, 32, 32), 10, torch.device("cpu"))
net = models.with_smooth_relu(model, 100.).eval()
params = {k: v.detach() for k, v in net.named_parameters()}
target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
labels = torch.arange(10).repeat_interleave(m // 10)
x = (1e-3 * torch.randn(len(labels), 3, 32, 32)).requires_grad_()
lam = torch.rand(len(labels)).requires_grad_()
def step():
    l = recl.reconstruction_losses(net, params, target, scale, x, labels, lam, 0.05)
    sum(l).backward(); x.grad = lam.grad = None
step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
    step()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30))
