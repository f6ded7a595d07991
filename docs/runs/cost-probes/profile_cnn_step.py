# Probe (docs/cost.md), first run from the repository root at e57c1a2: python docs/runs/cost-probes/profile_cnn_step.py
# (float32; its setup is benchmark.reconstruction_problem since 2026-11-23, the same network and candidates)
import sys, torch
sys.path.insert(0, '.')
import recl
import experiments as benchmark  # benchmark.py until the reorganisation
from torch.profiler import profile, ProfilerActivity
net, params, target, scale, x, labels, lam = benchmark.reconstruction_problem("cnn", (3, 32, 32), 200, torch.device("cpu"))
def step():
    l = benchmark.eq6_losses(net, params, target, scale, x, labels, lam, 0.05)
    sum(l.values()).backward(); x.grad = lam.grad = None
step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
    step()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30))
