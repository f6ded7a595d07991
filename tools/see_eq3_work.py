"""See Eq. 3 work: read training images back out of a network's weights, in the regime its theory is about.

    python tools/see_eq3_work.py [--seed 0] [--out results/see-eq3-work.png]   # about a minute on one CPU core

The regime of Haim et al. 2022 and Buzaglo et al. 2023: few images, a homogeneous ReLU MLP started small, full-batch
gradient descent until the loss is tiny. The weights then near a KKT point of margin maximisation, where theta =
sum_i lambda_i grad_theta Phi(theta; x_i), lambda_i >= 0 (App. B.2, Eq. 9-10); Eq. 3-6 (Step 1) read that backwards.
"""
import argparse, copy, sys  # noqa: E401
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules, from any folder
import data, models, recl  # noqa: E401, E402


HIDDEN, TRAIN_LR = 500, 0.1  # 784-500-500-2: the paper's MLP, narrower than its 1000 for speed; plain gradient descent
# Eq. 3-6: Haim et al.'s 2 candidates per image and MNIST alpha 150; lr_x 1; sigma_x, lr_lambda, lambda_min: recl.py's
PER_IMAGE, ALPHA, LR_X, SIGMA_X, LR_LAMBDA, LAMBDA_MIN, RECOVERED = 2, 150.0, 1.0, 1e-3, 0.1, 0.05, 0.4
FULL, QUICK = dict(per_digit=2, train_steps=4000, rec_steps=3000), dict(per_digit=1, train_steps=500, rec_steps=200)


def read_out(name, model, n, shape, steps, seed, log):
    """Step 1, Eq. 3's target theta itself (not ReCL's theta - theta_0): n candidates, half per class, same start."""
    log(f"Eq. 3-6 on the {name} network's weights, {steps} steps:")
    net = recl.with_smooth_relu(model, ALPHA).eval()  # a copy, backward sigmoid(alpha z): Eq. 3 has a gradient in x
    theta = {k: v.detach() for k, v in net.named_parameters()}
    labels = recl.candidate_labels(2, n // 2, 1, "cil")  # fixed labels, n/2 per class
    L_full = recl.stationarity_loss(net, theta, labels, theta, LAMBDA_MIN, n)  # Eq. 6 = Eq. 3 + Eq. 4 + Eq. 5
    x, lam = (v.requires_grad_() for v in recl.random_start(n, shape, SIGMA_X, seed))  # N(0, sigma_x^2), U(0, 1)
    optimizers = [torch.optim.SGD([x], lr=LR_X, momentum=0.9), torch.optim.SGD([lam], lr=LR_LAMBDA, momentum=0.9)]
    x, lam, report = recl.reconstruct(L_full, x, lam, optimizers, steps, log)
    combination = recl.weighted_gradient_sum(net, theta, x, labels, lam)  # fc1, trained from near zero, is explained
    left = {k: ((theta[k] - combination[k]).pow(2).sum() / theta[k].pow(2).sum()).item() for k in theta}
    log(f"    L_full {report['first_loss']:.4g} -> {report['kept_loss']:.4g}; share of each layer Eq. 3 leaves "
        "unexplained: " + ", ".join(f"{k} {v:.1%}" for k, v in left.items()))
    return x, left


def demonstrate(per_digit, train_steps, rec_steps, seed, log=print):
    """Phases 1-4; returns the scores of the trained and untrained network's candidates and of the look-alikes."""
    torch.manual_seed(seed)
    # 1. per_digit MNIST images of each digit, even (class 0) against odd (1), Haim et al.'s task: with two classes one
    # lambda per image is all of Eq. 9. make_tasks draws them (in 5 tasks, pooled here) less their mean image.
    tasks, class_order, mean_image, _ = data.make_tasks("mnist", seed, n_per_class=per_digit)
    odd = torch.tensor(class_order) % 2  # a label is its digit's place in class_order (make_tasks' CIL labels)
    pool = lambda part: torch.cat([getattr(task, part) for task in tasks])
    x, y, x_held, y_held = pool("x_train"), odd[pool("y_train")], pool("x_test"), odd[pool("y_test")]
    x, y, n = x[y.argsort(stable=True)], y.sort(stable=True).values, PER_IMAGE * len(x)  # even first: a tidier PNG
    log(f"{len(x)} training images ({per_digit} of each digit; class 0 even, class 1 odd), {n} candidates")
    # 2. Full-batch gradient descent until the loss is tiny: theta keeps turning towards the KKT point (Lyu & Li 2020).
    model = models.MLP(x[0].numel(), 2, hidden=HIDDEN)  # fc1 and its bias (the only one) ~ N(0, 1e-4^2): small
    untrained, optimizer = copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    log(f"training {x[0].numel()}-{HIDDEN}-{HIDDEN}-2 by full-batch gradient descent, lr {TRAIN_LR}:")
    for step in range(train_steps + 1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step % max(1, train_steps // 4) == 0 or step == train_steps:
            margin = recl.margins(model, dict(model.named_parameters()), x, y).min().item()
            log(f"    step {step}/{train_steps}: loss {loss.item():.2e}, smallest margin {margin:.2f}")
        if step < train_steps:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    # 3. Eq. 3-6 on the trained weights; control (a), the same read-out before training: do the images come from it?
    found = {name: read_out(name, net, n, x.shape[1:], rec_steps, seed, log)
             for name, net in (("trained", model), ("untrained", untrained))}
    # Control (b): n/2 random held-out images per class in the candidates' place: copies, or only look-alikes?
    gen, picks = torch.Generator().manual_seed(seed), [torch.nonzero(y_held == c).squeeze(1) for c in (0, 1)]
    found["held_out"] = torch.cat([x_held[p[torch.randperm(len(p), generator=gen)[:n // 2]]] for p in picks]), {}
    # 4. Each training image's SSIM with its nearest candidate (App. D.5); above 0.4 it counts as recovered.
    r = {"x": x, "mean_image": mean_image}
    for name, (candidates, left) in found.items():
        ssim, nearest = recl.reconstruction_quality(x, candidates, mean_image)
        r[name] = {"mean_ssim": ssim.mean().item(), "recovered": (ssim > RECOVERED).float().mean().item(),
                   "nearest": nearest, "candidates": candidates, "left": left}
    return r


if __name__ == "__main__":
    parser = argparse.ArgumentParser(usage=argparse.SUPPRESS, description=__doc__.splitlines()[0])  # errors: 1 line
    parser.add_argument("--seed", type=int, default=0, help="of the images drawn and of both starts (default 0)")
    parser.add_argument("--out", type=Path, default=Path("results/see-eq3-work.png"), help="the PNG (%(default)s)")
    args = parser.parse_args()
    if not 0 <= args.seed < 2 ** 31 or args.out.suffix != ".png" or any(p.is_file() for p in args.out.parents):
        parser.error(f"want --seed in 0..{2 ** 31 - 1} and --out a .png file in a folder; got {args.seed}, {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the minute of work, so that a bad --out fails at once
    torch.set_num_threads(1)  # small matrices: as fast, and the same numbers on every run
    r = demonstrate(**FULL, seed=args.seed, log=lambda *a: print(*a, flush=True))
    t, u, h, n = r["trained"], r["untrained"], r["held_out"], len(r["held_out"]["candidates"])
    recl.save_pairs(args.out, r["x"], t["candidates"], t["nearest"], r["mean_image"])  # 5. the PNG
    line = lambda s: f"{s['recovered']:.0%} recovered, mean SSIM {s['mean_ssim']:.2f}"
    print(f"trained network:      {line(t)} ({len(r['x'])} training images, SSIM > {RECOVERED} with the nearest of {n} "
          f"candidates; first layer {1 - t['left']['fc1.weight']:.0%} explained by Eq. 3)")
    print(f"untrained network:    {line(u)} (same reconstruction from the network before training)")
    print(f"held-out look-alikes: {line(h)} ({n} unseen images of the same digits in the candidates' place)")
    beats = all(t[k] > max(u[k], h[k]) + (0.05 if k == "mean_ssim" else 0) for k in ("mean_ssim", "recovered"))
    print("verdict: " + ("Eq. 3 read training images out of the trained weights: its candidates beat both controls."
                         if beats else "Eq. 3's candidates did NOT clearly beat both controls here."))
    print(f"training images over their nearest candidates (trained network): {args.out}")
