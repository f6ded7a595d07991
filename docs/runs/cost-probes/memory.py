"""Peak memory per reconstruction candidate and per training row, against the
numbers one input's forward pass produces in the network's layers (docs/cost.md).

    PYTHONPATH=. python docs/runs/cost-probes/memory.py rec cnn 100     # then 400: the slope is per candidate
    PYTHONPATH=. python docs/runs/cost-probes/memory.py train cnn 500   # then 2000: the slope is per row
Run each in a fresh process: ru_maxrss only grows."""
import resource
import sys

import torch
import torch.nn.functional as F

import experiments
import models

torch.set_num_threads(2)
what, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
shape = {"mlp": (1, 28, 28), "cnn": (3, 32, 32)}[name]
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if what == "rec":  # one step of recl.reconstruct's loop for n candidates, as the benchmark times it
    experiments.reconstruction_step(name, shape, n, torch.device("cpu"), repeats=1)
else:  # one SGD step on a batch of n rows
    model = models.build_model(name, shape, 10)
    F.cross_entropy(model(torch.randn(n, *shape)), torch.randint(0, 10, (n,))).backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sizes = []
model = models.build_model(name, shape, 10)
for module in model.modules():
    if not list(module.children()):
        module.register_forward_hook(lambda m, i, out: sizes.append(out.numel()))
with torch.no_grad():
    model(torch.zeros(1, *shape))
print(f"{what} {name} n={n}: peak {(peak - start) / 1024:.0f} MB above the start; one input: {sum(sizes):,} numbers "
      f"in the layers, {torch.zeros(shape).numel():,} in the input")
