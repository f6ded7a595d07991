"""Does a network's starting scale decide how much Finetune forgets in CIL?

Runs `recl.py` with the network built as usual and then re-initialised as
INIT says, a comma-separated list applied in order:

    default      PyTorch's own initialisation in every layer (gain about 1/sqrt(3))
    he           He initialisation in every layer (models.he_init)
    first=S      the first layer's weights and bias times S

    python docs/runs/models/init/probe.py INIT [recl.py flags ...]
    python docs/runs/models/init/probe.py he --scenario cil --method finetune --variant base --validation

`none` leaves the network as models.build_model makes it. docs/running.md,
"Other models", shows what it found.
"""
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import models  # noqa: E402
import recl  # noqa: E402

build_as_usual = models.build_model


def build_and_reinitialise(name, input_shape, n_classes):
    model = build_as_usual(name, input_shape, n_classes)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for step in sys.argv[1].split(","):
        key, _, value = step.partition("=")
        if key == "default":
            for layer in layers:
                layer.reset_parameters()
        elif key == "he":
            models.he_init(model)
        elif key == "first":
            with torch.no_grad():
                for p in layers[0].parameters():
                    p.mul_(float(value))
        elif key != "none":
            sys.exit(f"probe.py: unknown step {step!r} (none, default, he, first=S)")
    return models.remember_start(model)  # theta_0 is the re-initialised start


models.build_model = build_and_reinitialise
recl.main(sys.argv[2:])
