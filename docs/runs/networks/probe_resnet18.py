"""Why ResNet18's reconstructions diverge: one reconstruction before task 2, at several settings.

ResNet18 is fitted to task 1 of SplitFashionMNIST's validation split (DIL, 20 images per
class, Finetune+ReCL's training budget), then Step 1 runs 15 steps with 10 candidates per
class from the same start at each setting. Prints each report. About 10 minutes on one CPU core.

    PYTHONPATH=. python docs/runs/networks/probe_resnet18.py

Run at commit 2fa0308, where --rec-optimizer adam stepped only the candidates with Adam; from
4b5e4bd on it steps the lambdas with Adam too (probe_lambdas.py), so today's code gives other rows.
"""
import dataclasses

import torch

import config
import models
import recl

args = config.make_parser().parse_args("--dataset fashion-mnist --model resnet18 --validation --scenario dil "
                                       "--method finetune --n-per-class 20 --m 10 --n-rec 15 "
                                       "--rec-optimizer adam --lr-x 0.01".split())
config.check(args, probe_out=False)
cfg = config.resolve(args, 0, "recl")
tasks, *_ = recl.make_tasks(cfg)
torch.manual_seed(0)
model = models.build_model("resnet18", (1, 28, 28), 2)
recl.train_task(model, tasks[0].x_train, tasks[0].y_train, {}, {}, cfg)
model.eval()
settings = {"Adam 0.01, lambdas SGD 0.1": {}, "Adam 0.01, lambdas SGD 0.01": {"lr_lambda": 0.01},
            "Adam 0.01, lambdas fixed": {"lr_lambda": 1e-12}, "Adam 0.001, lambdas SGD 0.1": {"lr_x": 1e-3},
            "Adam 0.0001, lambdas SGD 0.1": {"lr_x": 1e-4},
            "Adam 0.001, lambdas fixed": {"lr_x": 1e-3, "lr_lambda": 1e-12},
            "Adam 0.001, lambdas SGD 0.1, bn 0.001": {"lr_x": 1e-3, "bn_weight": 1e-3}}
for name, changes in settings.items():
    run = dataclasses.replace(cfg, **changes)
    x, y, lam, report = recl.reconstruct_old_data(model, tasks[:1], run, lambda *a: None)
    print(f"{name}: loss {report['first_loss']:.4g} -> kept {report['kept_loss']:.4g}, last step "
          f"{report['last_step_loss']:.4g}, {report['failed'] or 'not flagged'}", flush=True)
