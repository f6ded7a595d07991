"""See Eq. 3 work: read training images back out of a trained network's weights, in the regime
where the theory says it should work, and check that what comes out are those images.

    python tools/see_eq3_work.py            # about a minute on one CPU core
    python tools/see_eq3_work.py --quick    # a few seconds, a weaker version (the test runs it)

What it does, top to bottom:
  1. Takes a small set of real MNIST images from the shipped subset (data/mnist_5k.csv.gz):
     `--per-digit` images of each of the 10 digits, in 2 classes, even digits against odd digits
     (Haim et al. 2022's MNIST task), 20 images by default.
  2. Trains the repo's MLP (models.MLP) on them with full-batch gradient descent for a long time,
     until the training loss is tiny. A homogeneous ReLU network trained this way drifts towards a
     KKT point of margin maximisation, where its weights are a non-negative combination of the
     gradients of its margins at the training images (App. B.2, Eq. 9 and 10):
         theta = sum_i lambda_i grad_theta Phi(theta; x_i),   lambda_i >= 0.
  3. Reads that equation backwards with the paper's L_full (Eq. 3-6, recl.stationarity_loss):
     random candidates x_i and coefficients lambda_i are optimised until the combination of their
     margin gradients matches the weights theta (recl.reconstruct, Step 1 of Sec. 4.1).
  4. Scores the candidates the way the literature does (judging.py, App. D.5): for every training
     image, the SSIM with its nearest candidate; SSIM > 0.4 counts as recovered. Two controls,
     scored the same way: (a) the same reconstruction, same candidates' start, same steps, from the
     same network before training; (b) held-out real images of the same digits in place of the
     candidates: a look-alike of each training image, not a copy of it.
  5. Saves a PNG: rows of training images, each row followed by their nearest candidates.

Where this departs from ReCL's continual default (recl.py, config.py), and why:
  - Eq. 3's target is the weights theta, as the paper prints it, not the displacement
    theta - theta_0 (departure 1 in recl.py). Here training runs long enough for theta to reach
    the KKT point that Eq. 3 describes; in a continual run it does not.
  - Training is full-batch gradient descent for thousands of steps on 20 images, not mini-batch SGD
    for a few epochs on hundreds per class: the theory (Lyu & Li 2020) is about gradient flow run
    until the loss is tiny.
  - Small initialisation as Haim et al.'s reference code has it: the first layer (and its bias, the
    only bias) starts at N(0, 1e-4^2), which is models.MLP's default (`first_init_scale`); the
    other two layers keep PyTorch's default start. The network is homogeneous in its weights (the
    bias sees a constant input), so App. B's conditions apply to every parameter.
  - Two classes. For two classes the repo's margin (own logit minus the best other) is the only
    margin, so one lambda per image is the whole of App. B.2's Eq. 9; with more classes Eq. 9 has a
    lambda for every other class, and one lambda per image leaves much of theta unexplained.
  - Eq. 3-6's settings (recl.py's defaults in brackets): 2 candidates per training image, as Haim
    et al. (m per old class); 3000 steps (100); lr_x 1, the repo's step size for the weights target
    (3, for the displacement); alpha 150, the value of Haim et al.'s MNIST reconstruction (100).
    sigma_x 1e-3, lr_lambda 0.1, lambda_min 0.05 and SGD with momentum 0.9 are recl.py's own.

Nothing here is new code for the method: the loss, the optimisation loop, the smooth ReLU, the
start, the model and the scoring are the repo's functions, called as recl.step1 calls them.
Fixed seeds and one thread: the same numbers on every run. docs/see-eq3-work.md has the numbers.
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402
import judging  # noqa: E402
import models  # noqa: E402
import recl  # noqa: E402

# ==== The settings ====================================================================================================
# The network: the paper's MLP shape (784-H-H-C), narrower than its 1000 to keep the run short.
HIDDEN = 500
# Training: full-batch gradient descent on cross-entropy, plain (no momentum, no weight decay).
TRAIN_LR = 0.1
# Step 1 (Eq. 3-6): see the docstring for where each value comes from.
CANDIDATES_PER_IMAGE = 2
SIGMA_X = 1e-3
LR_X = 1.0
LR_LAMBDA = 0.1
LAMBDA_MIN = 0.05
ALPHA = 150.0
# The literature's threshold (Haim et al. 2022): a training image with a candidate this close is recovered.
RECOVERED = 0.4
# The shipped MNIST subset holds 500 images of each digit: enough for the training images and
# CANDIDATES_PER_IMAGE held-out look-alikes for each.
MAX_PER_DIGIT = data.MNIST_SUBSET_PER_CLASS // (1 + CANDIDATES_PER_IMAGE)

FULL = {"per_digit": 2, "train_steps": 4000, "rec_steps": 3000}
QUICK = {"per_digit": 1, "train_steps": 500, "rec_steps": 200}


# ==== 1. The images ===================================================================================================

def images(per_digit, seed):
    """`per_digit` training images of each digit, labelled 0 (even) or 1 (odd), and the rest of
    the shipped subset as held-out images, labelled the same way. Pixels in [0, 1] less the
    training mean image (data.make_tasks), which is handed back to turn them into pictures."""
    # make_tasks draws per_digit images of every digit for training and keeps the rest for testing;
    # its tasks (2 digits each) are only a way to get them: we pool them again.
    tasks, _, mean_image, _ = data.make_tasks("mnist", seed, n_per_class=per_digit)
    digit = torch.tensor([c for task in tasks for c in task.classes])  # CIL label -> the digit
    pool = lambda part: torch.cat([getattr(task, part) for task in tasks])
    x, y = pool("x_train"), digit[pool("y_train")] % 2
    x_held, y_held = pool("x_test"), digit[pool("y_test")] % 2
    order = y.argsort(stable=True)  # even digits first: the picture reads better
    return x[order], y[order], x_held, y_held, mean_image


def look_alikes(x_held, y_held, per_class, seed):
    """`per_class` held-out images of each class, drawn at random: the control (b) set."""
    gen = torch.Generator().manual_seed(seed)
    picks = [torch.nonzero(y_held == c).squeeze(1) for c in (0, 1)]
    return torch.cat([x_held[p[torch.randperm(len(p), generator=gen)[:per_class]]] for p in picks])


# ==== 2. Training to (near) the KKT point =============================================================================

def train(model, x, y, steps, log):
    """Full-batch gradient descent on cross-entropy for `steps` steps. With the loss near zero the
    direction of theta keeps converging (slowly) to the KKT point of max_theta min_i margin_i /
    |theta|^3 (Lyu & Li 2020); App. B.2's Eq. 9-10 hold there."""
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    for step in range(steps + 1):
        loss = F.cross_entropy(model(x), y)
        if step % max(1, steps // 4) == 0 or step == steps:
            with torch.no_grad():
                margin = recl.margins(model, dict(model.named_parameters()), x, y).min().item()
            log(f"    step {step}/{steps}: loss {loss.item():.2e}, smallest margin {margin:.2f}")
        if step == steps:
            return loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# ==== 3. Eq. 3-6 on the weights =======================================================================================

def read_out(model, n, input_shape, steps, seed, log):
    """Step 1 (Sec. 4.1) with Eq. 3's target theta itself: n candidates, half per class, from the
    same random start for every network. Returns the kept candidates and Eq. 3's leftover per layer."""
    # The smooth ReLU (Haim et al. 2022): forward unchanged, backward sigmoid(alpha z), so that Eq. 3,
    # which holds gradients of the network, has a gradient in x. A copy; `model` keeps its ReLUs.
    net = models.with_smooth_relu(model, ALPHA).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}  # theta, fixed
    labels = torch.arange(2).repeat_interleave(n // 2)  # fixed labels, evenly split (Sec. 4.1)
    # L_full = L_rec + L_lambda + L_prior (Eq. 6), with
    #   L_rec    = |theta - (1/n) sum_i lambda_i grad_theta Phi(theta; x_i)|^2   (Eq. 3; target = theta)
    #   L_lambda = 5 sum_i relu(lambda_min - lambda_i)^2                         (Eq. 4: lambda_i >= 0, App. B Eq. 10)
    #   L_prior  = sum relu(|x| - 1)^2                                           (Eq. 5: pixels in [-1, 1])
    L_full = recl.stationarity_loss(net, params, labels, params, LAMBDA_MIN, n)
    x, lam = recl.random_start(n, input_shape, SIGMA_X, seed)  # x_i ~ N(0, sigma_x^2), lambda_i ~ U(0, 1)
    x.requires_grad_()
    lam.requires_grad_()
    optimizers = [torch.optim.SGD([x], lr=LR_X, momentum=0.9), torch.optim.SGD([lam], lr=LR_LAMBDA, momentum=0.9)]
    x, lam, report = recl.reconstruct(L_full, x, lam, optimizers, steps, log)
    # How much of each layer the kept candidates explain: Eq. 3's sum, layer by layer.
    with torch.no_grad():
        combination = recl.weighted_gradient_sum(net, params, x, labels, lam)
    left = {k: ((params[k] - combination[k]).pow(2).sum() / params[k].pow(2).sum()).item() for k in params}
    return x, left, report


def scored(reference, candidates, mean_image):
    """judging.reconstruction_quality (App. D.5): each reference image's SSIM with its nearest
    candidate (L2 after standardising each set), as a summary and the per-image numbers."""
    ssim, nearest = judging.reconstruction_quality(reference, candidates, mean_image)
    return {"mean_ssim": ssim.mean().item(), "recovered": (ssim > RECOVERED).float().mean().item(),
            "ssim": ssim, "nearest": nearest}


# ==== 4. The whole demonstration ======================================================================================

def demonstrate(per_digit, train_steps, rec_steps, seed, log=print):
    """Train, read out, score both controls. Returns a dict of the three scores (and what the PNG needs)."""
    torch.manual_seed(seed)
    x, y, x_held, y_held, mean_image = images(per_digit, seed)
    n = CANDIDATES_PER_IMAGE * len(x)
    log(f"{len(x)} training images ({per_digit} of each digit; class 0 even, class 1 odd), {n} candidates")

    model = models.MLP(x[0].numel(), 2, hidden=HIDDEN)  # first layer and its bias ~ N(0, 1e-4^2)
    untrained = copy.deepcopy(model)  # control (a): the same network, as it started
    log(f"training {x[0].numel()}-{HIDDEN}-{HIDDEN}-2 by full-batch gradient descent, lr {TRAIN_LR}:")
    loss = train(model, x, y, train_steps, log)

    results = {"n_train": len(x), "n_candidates": n, "train_loss": loss, "mean_image": mean_image, "x": x}
    for name, net in (("trained", model), ("untrained", untrained)):
        log(f"Eq. 3-6 on the {name} network's weights, {rec_steps} steps:")
        candidates, left, report = read_out(net, n, x.shape[1:], rec_steps, seed, log)
        results[name] = {**scored(x, candidates, mean_image), "candidates": candidates, "left": left,
                         "first_loss": report["first_loss"], "kept_loss": report["kept_loss"]}
        # The second layer keeps most of its random start, which no candidate can explain: L_full stays
        # near its |W|^2. The first layer, started near zero, is training's work: the images are read there.
        log(f"    L_full {report['first_loss']:.4g} -> {report['kept_loss']:.4g}; share of each layer Eq. 3 leaves "
            f"unexplained: " + ", ".join(f"{k} {v:.1%}" for k, v in left.items()))
    # Control (b): held-out real images of the same digits in the candidates' place, as many.
    held = look_alikes(x_held, y_held, n // 2, seed)
    results["held_out"] = scored(x, held, mean_image)
    return results


def verdict(r):
    """A few lines: the three scores, and whether the trained network's candidates beat both controls."""
    line = lambda s: f"{s['recovered']:.0%} recovered, mean SSIM {s['mean_ssim']:.2f}"
    t, u, h = r["trained"], r["untrained"], r["held_out"]
    clear = t["mean_ssim"] > max(u["mean_ssim"], h["mean_ssim"]) + 0.05 and t["recovered"] > max(
        u["recovered"], h["recovered"])
    return "\n".join([
        f"trained network:      {line(t)} ({r['n_train']} training images, SSIM > {RECOVERED} with the nearest "
        f"of {r['n_candidates']} candidates; first layer {1 - t['left']['fc1.weight']:.0%} explained by Eq. 3)",
        f"untrained network:    {line(u)} (same reconstruction from the network before training)",
        f"held-out look-alikes: {line(h)} ({r['n_candidates']} unseen images of the same digits in the "
        f"candidates' place)",
        "verdict: " + ("Eq. 3 read training images out of the trained weights: its candidates beat both controls."
                       if clear else "Eq. 3's candidates did NOT clearly beat both controls here.")])


# ==== 5. The command line =============================================================================================

def count(low, high):
    """An argparse type: an integer in [low, high]."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value
    return parse


def make_parser():
    parser = config.Parser(prog="see_eq3_work.py",  # the repo's parser: an error is one line, not usage + line
                           description="Show Eq. 3 reading training images out of a network trained long on a few "
                                       "MNIST images (docs/see-eq3-work.md).")
    parser.add_argument("--per-digit", type=count(1, MAX_PER_DIGIT),
                        help=f"training images of each digit; 2 classes (even, odd), so 5x this per class "
                             f"(default {FULL['per_digit']}; recovery falls as it grows)")
    parser.add_argument("--train-steps", type=count(1, 10 ** 7),
                        help=f"full-batch gradient descent steps (default {FULL['train_steps']})")
    parser.add_argument("--rec-steps", type=count(1, 10 ** 7),
                        help=f"reconstruction steps on Eq. 3-6, for each network (default {FULL['rec_steps']})")
    parser.add_argument("--seed", type=count(0, 2 ** 31 - 1), default=0,
                        help="seed of the images drawn, the network's start and the candidates' start (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small and fast: {QUICK['per_digit']} image per digit, {QUICK['train_steps']} and "
                             f"{QUICK['rec_steps']} steps (the flags above still win)")
    parser.add_argument("--out", default="results/see-eq3-work.png",
                        help="the PNG of training images over their nearest candidates (default %(default)s)")
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.suffix.lower() != ".png" or out.is_dir():
        parser.error(f"--out {out} must name a .png file")
    if any(p.exists() and not p.is_dir() for p in out.parents):
        parser.error(f"--out {out}: {next(p for p in out.parents if p.exists() and not p.is_dir())} is a file, "
                     f"not a folder")
    settings = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k]
                for k in FULL}
    torch.set_num_threads(1)  # small matrices: one thread is as fast, and the numbers are the same every run
    started = time.time()
    log = lambda *a: print(*a, flush=True)
    results = demonstrate(**settings, seed=args.seed, log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = results["trained"]
    judging.save_pairs(out, results["x"], t["candidates"], t["nearest"], results["mean_image"], n=len(results["x"]))
    print(verdict(results))
    print(f"{time.time() - started:.0f} s; training images over their nearest candidates (trained network): {out}")


if __name__ == "__main__":
    try:
        main()
    except (config.UsageError, data.DataError) as err:  # bad flags, a missing or corrupt MNIST file: one line
        sys.exit(f"see_eq3_work.py: error: {err}")
