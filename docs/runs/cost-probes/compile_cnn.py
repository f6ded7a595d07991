"""torch.compile of one CNN reconstruction step (m = 200, CIFAR10-shaped, products in bfloat16)
against eager: the first call (compiling) and the best of 3 steps after it.

    python docs/runs/cost-probes/compile_cnn.py      # from the repository root; 2 threads
"""
import sys, time, torch
sys.path.insert(0, '.')
import recl
import experiments as benchmark  # benchmark.py until the reorganisation
torch.set_num_threads(2)
net, params, target, scale, x, labels, lam = benchmark.reconstruction_problem("cnn", (3, 32, 32), 200, torch.device("cpu"))
compiled = torch.compile(benchmark.eq6_losses)
for name, fn in (("eager", benchmark.eq6_losses), ("compiled", compiled)):
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            l = fn(net, params, target, scale, x, labels, lam, 0.05)
        sum(l.values()).backward(); g = x.grad.clone(); x.grad = lam.grad = None; return l["rec"].item(), g
    t = time.perf_counter(); l, g = step(); first = time.perf_counter() - t
    ts = []
    for _ in range(3):
        t = time.perf_counter(); l, g = step(); ts.append(time.perf_counter() - t)
    print(name, f"first {first:.1f}s, step {min(ts):.3f}s, L_rec {l:.6f}, |g| {g.norm():.4e}", flush=True)
