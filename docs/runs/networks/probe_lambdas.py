"""The lambdas' step on ResNet18 and AlexNet: one reconstruction before task 2, at several settings.

Like probe_resnet18.py (task 1 of SplitFashionMNIST's validation split, DIL, 20 images per class,
m 10), with 30 steps. Run at commit 2fa0308, where departure 6 stepped only the candidates
with Adam and the lambdas with SGD: the lambdas' optimiser is chosen here by replacing
torch.optim.SGD for the reconstruction (the model trains first). From 4b5e4bd on, departure 6
steps the lambdas with Adam itself, so the "lam SGD" rows need 2fa0308.
Output: probe_lambdas-resnet18.txt (17 minutes) and probe_lambdas-alexnet.txt (2 minutes), one
core each.

    git checkout 2fa0308 && PYTHONPATH=. python docs/runs/networks/probe_lambdas.py resnet18
"""
import dataclasses
import sys
import time

import torch

import config
import models
import recl

net_name = sys.argv[1]
args = config.make_parser().parse_args(f"--dataset fashion-mnist --model {net_name} --validation --scenario dil "
        "--method finetune --n-per-class 20 --m 10 --n-rec 30 --rec-optimizer adam --lr-x 0.01".split())
config.check(args, probe_out=False)
cfg = config.resolve(args, 0, "recl")
tasks, *_ = recl.make_tasks(cfg)
torch.manual_seed(0)
model = models.build_model(net_name, (1, 28, 28), 2)
recl.train_task(model, tasks[0].x_train, tasks[0].y_train, {}, {}, cfg)
model.eval()
LAMBDA_ADAM = None
orig_sgd = torch.optim.SGD
settings = [("x Adam 0.001, lam SGD 0.1", dict(lr_x=1e-3), None),
            ("x Adam 0.001, lam Adam 0.01", dict(lr_x=1e-3), 0.01),
            ("x Adam 0.001, lam Adam 0.1", dict(lr_x=1e-3), 0.1),
            ("x Adam 0.01, lam Adam 0.01", dict(lr_x=1e-2), 0.01),
            ("x Adam 0.01, lam Adam 0.1", dict(lr_x=1e-2), 0.1)]
if net_name == "resnet18":
    settings.append(("x Adam 0.001, lam Adam 0.01, bn 1e-3", dict(lr_x=1e-3, bn_weight=1e-3), 0.01))
for name, changes, lam_adam in settings:
    def patched(params, lr, momentum=0, **kw):
        if lam_adam is not None:
            return torch.optim.Adam(params, lr=lam_adam, betas=(0.5, 0.9))
        return orig_sgd(params, lr=lr, momentum=momentum, **kw)
    recl.torch.optim.SGD = patched
    t = time.time()
    run = dataclasses.replace(cfg, **changes)
    x, y, lam, report = recl.reconstruct_old_data(model, tasks[:1], run, lambda *a: None)
    print(f"{net_name} {name}: loss {report['first_loss']:.4g} -> kept {report['kept_loss']:.4g}, last "
          f"{report['last_step_loss']:.4g}, {report['failed'] or 'ok'}, lam {lam.min():.3g}-{lam.max():.3g}, {time.time()-t:.0f}s", flush=True)
recl.torch.optim.SGD = orig_sgd
