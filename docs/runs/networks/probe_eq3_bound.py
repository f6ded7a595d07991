"""How far can Eq. 3 hold at all? The best fit with the real training images as the candidates.

For each network: fit it to task 1 of SplitFashionMNIST's validation split (DIL, 100 images
per class, 80 of them for training, the +ReCL variant's training budget), then take the
160 real training images as the x_i of Eq. 3, with their labels, and solve for the best
non-negative lambdas exactly: non-negative least squares on the Gram matrix of the margin
gradients (as Step 1 sees them: eval mode, smooth ReLU backward). What is left of the target
is the least share of it that any reconstruction of these 160 points could leave; ReCL's
candidates, from noise, can do no better than the data itself unless they find other points.

Prints, per network, the share of theta - theta_0 (ReCL's target, departure 1) and of theta
(Eq. 3 as written) left unexplained with lambda >= 0 and with free lambdas, and, for a
reconstruction from noise at the network's settings, its kept L_rec (the same share).
For ResNet18 also the share of the displacement along each conv filter (each output channel's
weights, whose scale the batch norm after it ignores), and the share left when the gradients'
parts along the filters are removed.

    PYTHONPATH=. python docs/runs/networks/probe_eq3_bound.py [mlp cnn alexnet resnet18]
    PYTHONPATH=. python docs/runs/networks/probe_eq3_bound.py resnet18:200   # task 1 trained 200 epochs

About 10 minutes on one CPU core for the four networks at their budgets (most of it
ResNet18), and 8 GB of memory for ResNet18's 160 gradients; at 200 epochs ResNet18's
training alone takes about 15 minutes more. Set OMP_NUM_THREADS to share the cores.
"""
import sys

import torch
from torch.func import functional_call, grad, vmap

import config
import models
import recl


def flat(d):
    return torch.cat([v.reshape(-1) for v in d.values()])


def margin_gradients(net, params, x, y, chunk=16):
    """One row per point: grad_theta Phi(theta; x_i), flattened."""
    def margin_of_one(p, xi, yi):
        return recl.margins(net, p, xi[None], yi[None])[0]
    rows = []
    for xc, yc in zip(x.split(chunk), y.split(chunk)):
        g = vmap(grad(margin_of_one), in_dims=(None, 0, 0))(params, xc, yc)
        rows.append(torch.cat([g[k].reshape(len(xc), -1) for k in params], 1))
    return torch.cat(rows)


def gram(J, targets, chunk=1_000_000):
    """G = J J^T and b = J v for each target v, summed in float64 a slice of weights at a time
    (the shares are small differences of large sums; J itself stays float32)."""
    G = torch.zeros(len(J), len(J), dtype=torch.float64)
    bs = {k: torch.zeros(len(J), dtype=torch.float64) for k in targets}
    for i in range(0, J.shape[1], chunk):
        Jc = J[:, i:i + chunk].double()
        G += Jc @ Jc.T
        for k, v in targets.items():
            bs[k] += Jc @ v[i:i + chunk].double()
    return G, bs


def nnls_share(G, b, vv, iters=20000):
    """min over lambda >= 0 of |v - J^T lambda|^2 / |v|^2, with G = J J^T, b = J v, vv = |v|^2
    (accelerated projected gradient; the problem is convex and 160-dimensional)."""
    G, b = G.double(), b.double()
    step = 1.0 / torch.linalg.eigvalsh(G)[-1]
    lam = torch.zeros_like(b)
    z, t = lam.clone(), 1.0
    for _ in range(iters):
        new = (z - step * (G @ z - b)).clamp_min(0)
        t_new = (1 + (1 + 4 * t * t) ** 0.5) / 2
        z = new + (t - 1) / t_new * (new - lam)
        lam, t = new, t_new
    return float((vv - 2 * lam @ b + lam @ G @ lam) / vv), int((lam > 0).sum())


def free_share(G, b, vv):
    """The same with lambdas of any sign: least squares (the full quadratic, so that an
    inexact solve can only overstate what is left, never understate it)."""
    G, b = G.double(), b.double()
    lam = torch.linalg.lstsq(G, b[:, None], rcond=None).solution[:, 0]
    return float((vv - 2 * lam @ b + lam @ G @ lam) / vv)


def probe(model_name, epochs=None):
    args = config.make_parser().parse_args(f"--dataset fashion-mnist --model {model_name} --validation "
                                           "--scenario dil --method finetune --device cpu".split()
                                           + (["--epochs", str(epochs)] if epochs else []))
    config.check(args, probe_out=False)
    cfg = config.resolve(args, 0, "recl")
    tasks, *_ = recl.make_tasks(cfg)
    torch.manual_seed(0)
    model = models.build_model(model_name, tuple(tasks[0].x_train.shape[1:]), 2)
    recl.train_task(model, tasks[0].x_train, tasks[0].y_train, {}, {}, cfg)
    model.eval()
    x, y = tasks[0].x_train, tasks[0].y_train
    net = models.with_smooth_relu(model, cfg.alpha).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    start = models.start_weights(model)
    J = margin_gradients(net, params, x, y)
    targets = {"displacement": flat({k: params[k] - start[k] for k in params}), "weights": flat(params)}
    G, bs = gram(J, targets)
    out = {}
    for name, v in targets.items():
        vv = float(v.double() @ v.double())
        nonneg, used = nnls_share(G, bs[name], vv)
        out[name] = (nonneg, used, free_share(G, bs[name], vv))
    line = (f"{model_name}, {cfg.epochs} epochs at lr {cfg.lr}: {len(x)} real points, {J.shape[1]:,} weights; theta - theta_0 left unexplained "
            f"{out['displacement'][0]:.1%} (lambda >= 0, {out['displacement'][1]} lambdas above 0), "
            f"{out['displacement'][2]:.1%} (free); theta left {out['weights'][0]:.1%} / {out['weights'][2]:.1%}")
    if model_name == "resnet18":  # each conv filter feeds a batch-norm channel, which ignores its scale:
        # how much of d lies along the filters themselves, and what is left when the gradients'
        # parts along them are removed
        d = targets["displacement"]
        along, offset = 0.0, 0
        for k, p in params.items():
            if k.endswith(".weight") and p.dim() == 4:
                filters = p.reshape(len(p), -1)
                unit = filters / filters.norm(dim=1, keepdim=True)
                along += float(((d[offset:offset + p.numel()].reshape(len(p), -1) * unit).sum(1) ** 2).sum())
                block = J[:, offset:offset + p.numel()].view(len(J), len(p), -1)  # a view: edits J
                block -= (block * unit[None]).sum(2, keepdim=True) * unit[None]
            offset += p.numel()
        line += f"; share of theta - theta_0 along the conv filters themselves {along / float(d @ d):.1%}"
        G, bs = gram(J, {"displacement": d})
        line += (f"; with those parts of the gradients removed, theta - theta_0 left "
                 f"{nnls_share(G, bs['displacement'], float(d.double() @ d.double()))[0]:.1%} (lambda >= 0)")
    del J, G
    x_rec, y_rec, lam, report = recl.reconstruct_old_data(model, tasks[:1], cfg, lambda *a: None)
    line += (f"; a reconstruction from noise ({cfg.m} per class, {cfg.n_rec} steps) leaves "
             f"{report['kept_terms']['rec']:.1%}")
    print(line, flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["mlp", "cnn", "alexnet", "resnet18"]:
        probe(*name.split(":"))  # NAME or NAME:EPOCHS
