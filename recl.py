"""ReCL: Reconstruction for Continual Learning, readable top to bottom.

Paper: "Slowing Down Forgetting in Continual Learning" (Janetzky, Schlagenhauf,
Feuerriegel). Equation numbers below are the paper's.

The idea in one breath. A homogeneous network trained by gradient descent drifts
towards a margin-maximisation point, where its weights are a non-negative
combination of the gradients of its margins at the training points (App. B):

    theta = sum_i lambda_i grad_theta Phi(theta; x_i),   lambda_i >= 0.

ReCL reads this equation backwards. Before each new task it optimises random
candidates x_i and coefficients lambda_i until the equation holds for the
current weights, which recovers look-alikes of the old training data from the
model alone (Step 1, Sec. 4.1). It then trains on those reconstructions mixed
with the new task's data (Step 2, Sec. 4.2). No stored real data, no
generator. By default each class's reconstruction, once made, is kept for
later tasks (part 1 says why, with the other choices made on validation data).
Plain model inversion (`--rec-objective inversion`) can replace Eq. 3 in the
same pipeline, as a control: docs/attribution.md compares the two.

This file has four parts:
    1. Reconstruction   (Eq. 3-6, and the inversion control), how to judge it
                        (SSIM, App. E) and tune it (Sec. 4.3)
    2. Metrics          (Eq. 1-2: ACC and BWT from the accuracy matrix R[t, i])
    3. The continual-learning loop, into which strategies.py hooks, the joint
       upper bound, and the validation search that chose each method's hyperparameters
    4. The command line, and the results files: staleness, tables, a chart
"""
import argparse
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import data
import models
import strategies

# =============================================================================
# 1. Reconstruction (Sec. 4.1, App. B)
# =============================================================================
#
# Phi(theta; x) for a multi-class network is the margin of x's label y: its
# logit minus the largest other logit. At a margin-maximisation point the
# weights satisfy the stationarity condition (App. B, Eq. 8), which Eq. 3 turns
# into a loss over candidates x_1..x_m with fixed labels and coefficients
# lambda_1..lambda_m:
#
#   L_rec    = || theta - (1/m) sum_i lambda_i grad_theta Phi(theta; x_i) ||^2   (Eq. 3)
#   L_lambda = 5 sum_i relu(lambda_min - lambda_i)^2                             (Eq. 4)
#   L_prior  = sum_{i,k} relu(|x_ik| - 1)^2                                      (Eq. 5)
#   L_full   = L_rec + L_lambda + L_prior                                        (Eq. 6)
#
# Eq. 4 and 5 are written in the paper with plain hinges; like the public
# reference code (Buzaglo et al. 2023) we square them, which keeps the loss
# smooth, and scale the gradient sum by 1/m so that lambda_min means the same for
# any m. The norm in Eq. 3 runs over every parameter tensor of the network.
#
# Five departures from the paper, each chosen on validation data
# (docs/levers.md has the numbers; each has a flag that turns it off):
#
# 1. What L_rec fits: the displacement theta - theta_0 (`--rec-target`;
#    `weights` is Eq. 3 as written). Networks trained for minutes, not days:
#
# * Eq. 3 holds in the limit of long training, when the weights have grown so
#   large that their random start theta_0 no longer matters. After 20 epochs it
#   still dominates: for the paper's MLP ||theta_0||^2 is about 334 and what
#   training added about 2, so most of L_rec is noise no candidate can explain.
# * The displacement theta - theta_0 is what gradient descent added: a sum of
#   per-example gradients. For cross-entropy each step adds, per training point,
#   sum_{j != y} p_j grad(f_y - f_j): non-negative multiples of margin
#   gradients, Eq. 3's form from the first step on (exactly so for a linearised
#   network). The model keeps theta_0 (models.remember_start); no data needed.
# * Its size depends on how long the network trained (||.||^2 from 0.01 to 47
#   in our runs), so its L_rec is divided by ||theta - theta_0||^2: the share of the
#   displacement the candidates leave unexplained, 1 at the start. One lr_x
#   then works for every training budget (default 3 instead of 1).
#
# 2. Keep what was recovered (`--freeze-old`). Before task t+1, the classes that
#    were already reconstructed before task t keep those candidates, fixed;
#    only the classes of task t start from noise. Reconstructing every class
#    afresh from a model that was itself trained on the last reconstructions
#    lets errors compound (task 1 fell from 98% to 40% over four tasks); a
#    class is best read out right after it was learned. The kept candidates
#    still enter the sum of Eq. 3, with the lambdas they were fitted with, so
#    the new ones fit only what the kept ones leave unexplained. Both fixed,
#    their share of the sum is a constant computed once, and each step
#    differentiates through the new candidates only: half the reconstruction
#    time, at the same validation ACC as re-fitting their lambdas. (Letting
#    the kept candidates move on lost: they drift again.)
#
# 3. Filter before training (`--filter`): a candidate the model itself assigns
#    to another class than its label would teach the wrong boundary, so it is
#    dropped (App. E suggests filtering; 5-15% of candidates go).
#
# 4. Replay with noise (`--replay-noise`, part 3): every time a reconstruction
#    enters a training batch it carries fresh Gaussian noise. The candidates
#    are class prototypes, while the old classes' real images scatter widely
#    around them; noise teaches the network to file that whole neighbourhood
#    under the old class, not just the prototype. Validation ACC in CIL
#    75.3 -> 81.3, BWT -19.2 -> -11.9; noise on one-step candidates still
#    collapses (26.3), so it is the reconstructions it widens that help.
#    (GPM's variant replays without it: strategies.TUNED_RECL says why.)
#
# 5. A little model inversion, in CIL only (`--ce-weight`): Eq. 6 plus 3e-4
#    times the cross-entropy of the candidates' own labels, the main term of
#    the inversion control below. On validation it added 1.3 ACC in CIL (7
#    methods, 21 seed pairs) and cost 3 in DIL (Finetune), where one label
#    stands for a class of every old task; docs/attribution.md has the study.
#
# None of this helps a network that has not fitted its tasks: ReCL reads the
# data out of the weights. So each +ReCL variant trains with its own, larger
# budget (strategies.TUNED_RECL), chosen on validation data like the methods'.


def margins(model, params, x, y):
    """Phi_y(x) - max_{j != y} Phi_j(x) for a batch, with the network's weights as `params`."""
    logits = functional_call(model, params, (x,))
    own = logits.gather(1, y[:, None]).squeeze(1)
    best_other = logits.scatter(1, y[:, None], float("-inf")).amax(1)
    return own - best_other


def weighted_gradient_sum_vmap(model, params, x, y, lam):
    """(1/m) sum_i lambda_i grad_theta Phi(theta; x_i), literally: one gradient per candidate.

    vmap(grad(...)) gives every candidate its own copy of the gradient, m x |theta|
    numbers. This is the equation as written; it is the reference the fast form
    below is tested against, but far too slow and memory-hungry to train with.
    """
    def margin_of_one(p, xi, yi):
        return margins(model, p, xi[None], yi[None])[0]

    per_candidate = vmap(grad(margin_of_one), in_dims=(None, 0, 0))(params, x, y)
    return {k: torch.tensordot(lam, g, dims=1) / len(x) for k, g in per_candidate.items()}


def weighted_gradient_sum(model, params, x, y, lam, m=None):
    """The same sum with a single backward pass (the default).

    A gradient is linear, so sum_i lambda_i grad Phi(x_i) = grad sum_i lambda_i Phi(x_i):
    differentiate the lambda-weighted sum of margins once instead of every margin
    on its own. torch.func.grad keeps the result differentiable in x and lambda,
    which is what the reconstruction optimises. Divided by m, all candidates,
    also when `x` is only some of them (default: len(x)).
    """
    def weighted_margins(p):
        return (lam * margins(model, p, x, y)).sum() / (m or len(x))

    return grad(weighted_margins)(params)


# Candidates start tiny (sigma_x 1e-3) and the gradients that move them are
# small, so at lr_x 0.1 (Haim et al.'s setting for their far longer runs) 100
# steps barely move them. For the weights target lr_x 1 gives about twice the
# random start's SSIM at the same ACC (docs/earlier-studies.md has the sweep);
# the displacement target's relative L_rec takes 3. On tiny inputs (16 pixels
# in the tests) 3 can diverge; the run then keeps the last finite candidates.
DEFAULT_LR_X = {"weights": 1.0, "displacement": 3.0}
# Model inversion (below) sums a cross-entropy per candidate, whose gradients
# are far larger: its own step size per scenario, chosen on validation
# (docs/attribution.md), so that the control is as good as it can be.
INVERSION_LR_X = {"cil": 0.003, "dil": 0.3}


def default_lr_x(objective, target, scenario):
    return INVERSION_LR_X[scenario] if objective == "inversion" else DEFAULT_LR_X[target]


def reconstruction_target(params, start, target):
    """What the gradient combination should equal, and the scale of L_rec:
    theta as in Eq. 3, or the displacement theta - theta_0 measured relative to its size."""
    if target == "weights":
        return params, 1.0
    if start is None:
        raise ValueError("the displacement target needs the model's initial weights: "
                         "build it with models.build_model or call models.remember_start first")
    displacement = {k: params[k] - start[k] for k in params}
    return displacement, 1.0 / sum(v.pow(2).sum() for v in displacement.values()).clamp_min(1e-30)


def reconstruction_losses(model, params, target, scale, x, y, lam, lambda_min, m=None):
    """L_rec (times `scale`), L_lambda and L_prior of Eq. 3-5, by name, for m candidates of
    which `x` are the ones being optimised (`target` already less the fixed ones' part)."""
    combination = weighted_gradient_sum(model, params, x, y, lam, m)
    return {"rec": scale * sum((target[k] - combination[k]).pow(2).sum() for k in params),
            "lambda": 5 * F.relu(lambda_min - lam).pow(2).sum(),
            "prior": image_prior(x)}


def image_prior(x):
    """L_prior (Eq. 5): keep every pixel of the candidates inside [-1, 1]."""
    return F.relu(x.abs() - 1).pow(2).sum()


# The control: model inversion (`--rec-objective inversion`). Is it Eq. 3
# that makes the candidates useful, or would any optimisation that makes the
# model recognise them as their labels do? Model inversion (Simonyan et al.
# 2014; DeepInversion, Yin et al. 2020, without its batch-norm term, since our
# networks have none) asks only the second:
#
#   L_inv = sum_i CE(f(x_i), y_i) + L_prior
#
# over the same candidates, labels, optimiser, steps, kept candidates, filter
# and replay noise, through the same smooth-backward network; no lambdas, no
# stationarity condition, and one backward pass per step instead of a double
# one. docs/attribution.md compares the two.

def inversion_losses(model, params, x, y):
    """L_inv's two terms by name: cross-entropy of the candidates' own labels, and L_prior."""
    logits = functional_call(model, params, (x,))
    return {"ce": F.cross_entropy(logits, y, reduction="sum"), "prior": image_prior(x)}


# Departure 5 adds L_inv's cross-entropy to Eq. 6 with this weight. At lr_x 3,
# 1e-3 would move the candidates as fast as inversion alone does at its 0.003.
DEFAULT_CE_WEIGHT = {"cil": 3e-4, "dil": 0.0}


def candidate_labels(n_outputs, m_per_class, n_old_tasks, scenario):
    """Fixed labels spread evenly over the old classes (Sec. 4.2).

    CIL: m candidates for each class the head knows. DIL: every task reuses the
    labels 0..k-1, so m candidates per class *per old task*; with m = n this
    reconstructs as many samples as the old tasks had (the paper's m = sum n^t).
    """
    per_class = m_per_class * (1 if scenario == "cil" else n_old_tasks)
    return torch.arange(n_outputs).repeat_interleave(per_class)


def initial_candidates(m, input_shape, sigma_x, seed):
    """x_i ~ N(0, sigma_x^2 I) (Sec. 4.1) and lambda_i ~ U(0, 1), reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, *input_shape, generator=gen) * sigma_x, torch.rand(m, generator=gen)


def keep_earlier(x, lam, labels, earlier_x, earlier_labels, earlier_lam):
    """Put each class's earlier reconstructions, with their lambdas, into the first slots of that class.

    Returns the candidates, their lambdas and a mask of the slots that were filled:
    those stay fixed. Slots without an earlier reconstruction of their label (the
    classes of the task just learned) keep their noise and random lambdas.
    """
    x, lam, filled = x.clone(), lam.clone(), torch.zeros(len(x), dtype=torch.bool)
    for c in earlier_labels.unique():
        slots = (labels == c).nonzero().squeeze(1)
        earlier = (earlier_labels == c).nonzero().squeeze(1)
        n = min(len(slots), len(earlier))
        x[slots[:n]], lam[slots[:n]], filled[slots[:n]] = earlier_x[earlier[:n]], earlier_lam[earlier[:n]], True
    return x, lam, filled


# The number format of a step (`--rec-precision`). Under torch.autocast the
# matrix products and convolutions of Eq. 3's double backward take bfloat16
# inputs (summed in float32); the rest stays float32. The fit does not notice
# (relative L_rec 0.0724 -> 0.0723, validation ACC within seed noise for every
# method; docs/levers.md, K), and on a CPU with bfloat16 instructions
# (AVX512-BF16 or AMX) a step takes 1.6 to 2.4 times less. `auto`, the
# default, uses it only there: other CPUs would emulate it, and on a GPU it is
# unmeasured. Training is always float32.

def reconstruction_precision(choice, device):
    """'float32' or 'bfloat16' for `--rec-precision` choice ('auto' or either) on `device`."""
    if choice != "auto":
        return choice
    capabilities = torch.cpu.get_capabilities() if device.type == "cpu" else {}
    native = capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")
    return "bfloat16" if native else "float32"


def reconstruct(model, labels, input_shape, cfg, log=print, earlier=None):
    """Step 1 of ReCL: recover look-alikes of old training data from `model` alone.

    Returns the candidates, their labels, their lambdas and a small report.
    Candidates start as N(0, sigma_x^2) noise and are optimised, together with
    their lambdas, by two full-batch SGD optimisers with momentum 0.9 for n_rec
    steps (Eq. 6). With `earlier` = (x, labels, lambdas) of the reconstruction
    before the previous task, the classes it covers keep those candidates and
    lambdas, fixed (see above).
    """
    start = time.time()
    device = next(model.parameters()).device
    net = models.with_smooth_relu(model, cfg.alpha).eval()  # smooth backward, exact forward
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = reconstruction_target(params, models.start_weights(model), cfg.rec_target)
    x, lam = initial_candidates(len(labels), input_shape, cfg.sigma_x, cfg.seed)
    fixed = torch.zeros(len(x), dtype=torch.bool)
    if earlier is not None:
        x, lam, fixed = keep_earlier(x, lam, labels.cpu(), *(v.cpu() for v in earlier))
    x, lam, labels, fixed, m = x.to(device), lam.to(device), labels.to(device), fixed.to(device), len(labels)
    target_sq_norm = sum(v.pow(2).sum() for v in target.values()).item()
    if fixed.any() and cfg.rec_objective != "inversion":  # inversion sums nothing over candidates
        # The fixed candidates' share of Eq. 3's sum does not change during the
        # optimisation: compute it once, and let the new candidates fit what it
        # leaves of the target. Each step then differentiates through the new
        # candidates only (in SplitMNIST CIL 200, not up to 800 before task 5).
        fixed_part = weighted_gradient_sum(net, params, x[fixed], labels[fixed], lam[fixed], m)
        target = {k: target[k] - fixed_part[k] for k in target}
    # (Inversion has no lambdas: they keep their random start and never enter its loss.)
    new_x, new_lam, new_labels = x[~fixed].requires_grad_(), lam[~fixed].requires_grad_(), labels[~fixed]
    opt_x = torch.optim.SGD([new_x], lr=cfg.lr_x, momentum=0.9)
    opt_lam = torch.optim.SGD([new_lam], lr=cfg.lr_lambda, momentum=0.9)

    last_finite = new_x.detach().clone(), new_lam.detach().clone()
    report_every = max(1, cfg.n_rec // 4)  # a progress line at each quarter
    in_bfloat16 = reconstruction_precision(cfg.rec_precision, device) == "bfloat16"
    for step in range(cfg.n_rec):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=in_bfloat16):
            if cfg.rec_objective == "inversion":
                terms = inversion_losses(net, params, new_x, new_labels)
            else:
                terms = reconstruction_losses(net, params, target, scale, new_x, new_labels, new_lam,
                                              cfg.lambda_min, m)
                if cfg.ce_weight:  # departure 5: a little inversion, in CIL
                    terms["ce"] = cfg.ce_weight * inversion_losses(net, params, new_x, new_labels)["ce"]
        loss = sum(terms.values())
        if step == 0:
            first_loss, first_terms = loss.item(), {k: v.item() for k, v in terms.items()}
        if not torch.isfinite(loss):  # diverged: fall back to the last candidates with a finite loss
            log(f"    reconstruction stopped at step {step}: the loss is not finite")
            new_x, new_lam = last_finite
            break
        last_finite = new_x.detach().clone(), new_lam.detach().clone()
        opt_x.zero_grad()
        opt_lam.zero_grad()
        loss.backward()
        opt_x.step()
        opt_lam.step()
        if (step + 1) % report_every == 0 and step + 1 < cfg.n_rec:
            log(f"    step {step + 1}/{cfg.n_rec}: loss {loss.item():.4g} ({time.time() - start:.1f}s)")

    x[~fixed], lam[~fixed] = new_x.detach(), new_lam.detach()
    finite = torch.isfinite(x.flatten(1)).all(1)  # never hand NaNs to training
    report = {"candidates": m, "optimised": int((~fixed).sum()), "kept": int(finite.sum()), "steps": step + 1,
              "first_loss": first_loss, "last_loss": loss.item(),
              "first_terms": first_terms, "last_terms": {k: v.item() for k, v in terms.items()},
              "target_sq_norm": target_sq_norm,
              "seconds": round(time.time() - start, 2)}
    return x[finite], labels[finite], lam[finite], report


# -----------------------------------------------------------------------------
# 1b. How good are the reconstructions? (App. E)
# -----------------------------------------------------------------------------
# Reporting only: training never sees these real images. App. E in three steps:
#   1. standardise both sets (each image minus its set's mean image, over the
#      set's spread) and match each real image to its nearest candidate by L2;
#   2. add the training mean image back and stretch each image to [0, 1];
#   3. SSIM of each pair. Haim et al. (2022) count SSIM > 0.4 as recovered.
# One change to step 2: the paper adds the mean to the *standardised*
# candidates, which have lost their set's mean image and have unit spread, so
# even exact copies of the real images score well below 1. We first give the
# standardised candidates the real set's mean image and spread. The score then
# ignores only the candidates' overall scale and offset: a perfect copy at any
# scale scores 1, and random candidates get exactly the same help. (Without any
# rescaling, small reconstructions vanish under the mean image and score like
# the mean image itself, however good they are; test_recl.py checks both.)

def ssim(a, b, window=11, sigma=1.5):
    """Mean SSIM (Wang et al. 2004) of each image pair in [0, 1]; Gaussian window, valid borders."""
    channels, size = a.shape[1], min(window, a.shape[-2], a.shape[-1])
    g = torch.exp(-(torch.arange(size, dtype=a.dtype, device=a.device) - (size - 1) / 2) ** 2 / (2 * sigma ** 2))
    kernel = (torch.outer(g, g) / g.sum() ** 2).expand(channels, 1, size, size)
    blur = lambda t: F.conv2d(t, kernel, groups=channels)
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    index = (2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return index.flatten(1).mean(1)


def standardise(images):
    """Each image minus the set's mean image, divided by the set's spread around it."""
    centred = images - images.mean(0)
    return centred / centred.std().clamp_min(1e-12)


def nearest_candidates(reference, candidates):
    """Index of the nearest candidate for each reference image, each set standardised on its own."""
    return torch.cdist(standardise(reference).flatten(1), standardise(candidates).flatten(1)).argmin(1)


def on_reference_scale(candidates, reference):
    """Standardised candidates with the reference set's mean image and spread."""
    centred = reference - reference.mean(0)
    return standardise(candidates) * centred.std() + reference.mean(0)


def as_picture(x, mean_image):
    """Undo the mean subtraction and stretch each image to [0, 1]."""
    x = x + mean_image
    low = x.flatten(1).min(1).values.view(-1, *[1] * (x.dim() - 1))
    high = x.flatten(1).max(1).values.view(-1, *[1] * (x.dim() - 1))
    return (x - low) / (high - low).clamp_min(1e-12)


def reconstruction_quality(reference, candidates, mean_image):
    """SSIM of every reference image with its nearest candidate, and those candidates' indices."""
    nearest = nearest_candidates(reference, candidates)
    shown = on_reference_scale(candidates, reference)[nearest]
    return ssim(as_picture(reference, mean_image), as_picture(shown, mean_image)), nearest


def save_pairs(path, reference, candidates, nearest, mean_image, n=32):
    """PNG grid: rows of real images, each row followed by the nearest reconstructions."""
    from torchvision.utils import save_image
    pick = torch.linspace(0, len(reference) - 1, min(n, len(reference))).long()  # spread over old classes
    real = as_picture(reference[pick], mean_image)
    found = as_picture(on_reference_scale(candidates, reference)[nearest[pick]], mean_image)
    rows = [t for pair in zip(real.split(16), found.split(16)) for t in pair]
    save_image(torch.cat(rows).cpu(), path, nrow=16, padding=1, pad_value=1.0)


# -----------------------------------------------------------------------------
# 1c. Tuning the reconstruction during training (Sec. 4.3)
# -----------------------------------------------------------------------------
# naive: the defaults. unsup: random search, keeping the trial with the lowest
# final L_full; it needs no old data. sup: the same search scored by SSIM
# against a small buffer of real old images (an ablation: it stores data).
# Both searches try the defaults first, so they never end below them by their
# own score (the paper's Optuna search does not say; this is our choice).
#
# Where we depart from the paper's Table 9: its ranges (lr_x in [1e-5, 1],
# ...) were set for Eq. 3 on the weights. Our default lr_x is 3 for the
# relative L_rec of the displacement (and 0.003 or 0.3 for inversion), above
# that range, so no draw could beat the defaults. Each draw is therefore
# log-uniform within a factor of the run's own value, the same rule for every
# objective and scenario: x10 either way for the step sizes and sigma_x, x3
# for lambda_min and alpha. (Chosen on validation against a narrower space, a
# space without lr_x, and a local search around the best trial so far;
# docs/reconstruction-quality.md has the numbers.)
SEARCH_SPACE = {"sigma_x": 10.0, "lr_x": 10.0, "lr_lambda": 10.0, "lambda_min": 3.0, "alpha": 3.0}


def sample_hyperparameters(gen, centre):
    """One draw: each hyperparameter log-uniform in [centre / factor, centre * factor]."""
    return {name: centre[name] * factor ** (2 * torch.rand(1, generator=gen).item() - 1)
            for name, factor in SEARCH_SPACE.items()}


def search_reconstruction(model, labels, input_shape, cfg, score, seed, log=print, earlier=None):
    """Random search: run `cfg.trials` reconstructions, return the one `score` rates highest.
    Trial 1 uses the flag values (the naive strategy's), so the search can only
    keep the defaults or find something its score rates higher."""
    gen = torch.Generator().manual_seed(seed)
    best, defaults = None, {k: getattr(cfg, k) for k in SEARCH_SPACE}
    for trial in range(cfg.trials):
        hp = defaults if trial == 0 else sample_hyperparameters(gen, defaults)
        x, y, lam, report = reconstruct(model, labels, input_shape, argparse.Namespace(**{**vars(cfg), **hp}), log,
                                        earlier)
        value = score(x, report) if math.isfinite(report["last_loss"]) and len(x) else -math.inf
        log(f"    trial {trial + 1}/{cfg.trials}: " + " ".join(f"{k} {v:.3g}" for k, v in hp.items())
            + f" -> score {value:.4g}")
        if best is None or value > best[0]:
            best = (value, x, y, lam, {**report, "hyperparameters": hp, "score": value})
    return best[1:]


# =============================================================================
# 2. Metrics (Sec. 3)
# =============================================================================
# R[t][i] is the test accuracy (percent) on task i after training on task t.

def acc_and_bwt(R):
    """ACC = mean_i R[T, i] (Eq. 1); BWT = mean_{i<T} R[T, i] - R[i, i] (Eq. 2)."""
    T = len(R)
    acc = sum(R[T - 1][i] for i in range(T)) / T
    bwt = sum(R[T - 1][i] - R[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else 0.0
    return acc, bwt


@torch.no_grad()
def accuracy(model, x, y, batch_size=1000):
    model.eval()
    correct = sum((model(xb).argmax(1) == yb).sum().item()
                  for xb, yb in zip(x.split(batch_size), y.split(batch_size)))
    return 100.0 * correct / len(x)


# =============================================================================
# 3. The continual-learning loop
# =============================================================================

class Diverged(Exception):
    """Training produced a non-finite loss; the run's numbers would be meaningless."""


def train_task(model, x, y, hooks, state, cfg, n_replayed=0):
    """Plain SGD on cross-entropy; the strategy's hooks add a loss term or edit gradients.

    The last `n_replayed` rows of x are ReCL's reconstructions. Each time one
    of them is drawn into a batch it gets fresh noise N(0, s^2), with s
    cfg.replay_noise times the pixel std of the task's own images (departure 4
    in part 1). Noise drawn once and kept does not help (docs/levers.md, H):
    it is a new draw each time that covers the neighbourhood.
    """
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    first_replayed = len(x) - n_replayed
    # a Python float, so the batch loop never waits on the device to compare it
    noise_std = (cfg.replay_noise * x[:first_replayed].std()).item() if n_replayed else 0.0
    noise_gen = torch.Generator(device=x.device).manual_seed(cfg.seed)
    batches = data.loader(torch.arange(len(x), device=x.device), y, cfg.batch_size, seed=cfg.seed)  # row numbers
    for epoch in range(cfg.epochs):
        total = 0.0
        for rows, yb in batches:
            xb = x[rows]
            if noise_std > 0:
                replayed = (rows >= first_replayed).view(-1, *[1] * (x.dim() - 1))
                xb = xb + replayed * noise_std * torch.randn(xb.shape, generator=noise_gen, device=x.device)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            if "extra_loss" in hooks:
                loss = loss + hooks["extra_loss"](model, xb, yb, logits, state)
            optimizer.zero_grad()
            loss.backward()
            if "after_backward" in hooks:
                hooks["after_backward"](model, state)
            optimizer.step()
            value = loss.item()
            if not math.isfinite(value):  # nothing useful can follow: stop here and say where
                raise Diverged(f"training loss {value} in epoch {epoch + 1}")
            total += value * len(xb)
    return total / len(x)  # mean loss of the last epoch


def reference_buffer(old_tasks, fraction, seed):
    """A few real images of each old task: only the supervised search and reporting use them."""
    gen = torch.Generator().manual_seed(seed)
    picks = [t.x_train[torch.randperm(len(t.x_train), generator=gen)[:max(1, round(fraction * len(t.x_train)))]]
             for t in old_tasks]
    return torch.cat(picks)


@torch.no_grad()
def classified_as_labelled(model, x, y):
    """Which candidates the model assigns to their own label (App. E's filtering idea):
    a candidate the model files under another class teaches the wrong thing."""
    model.eval()
    return model(x).argmax(1) == y


def reconstruct_old_data(model, old_tasks, cfg, mean_image, seed, log=print, earlier=None):
    """Step 1 before a new task: reconstruct with the chosen tuning strategy (Sec. 4.3)."""
    input_shape = old_tasks[0].x_train.shape[1:]
    labels = candidate_labels(model.head.out_features, cfg.m, len(old_tasks), cfg.scenario)
    if cfg.tuning == "naive":
        return reconstruct(model, labels, input_shape, cfg, log, earlier)
    if cfg.tuning == "unsup":
        score = lambda x, report: -report["last_loss"]
    else:
        buffer = reference_buffer(old_tasks, 0.1, seed)
        score = lambda x, report: reconstruction_quality(buffer, x, mean_image)[0].mean().item()
    return search_reconstruction(model, labels, input_shape, cfg, score, seed, log, earlier)


def judge_reconstruction(old_tasks, x_rec, cfg, mean_image):
    """Reporting only: SSIM of the old real images with their nearest reconstructions, and
    for comparison with two other sets of as many images: the random candidates the
    reconstruction started from (a floor) and held-out real images of the old classes
    (what a perfect look-alike of the data, not a copy, would score)."""
    real = torch.cat([t.x_train for t in old_tasks])
    start, _ = initial_candidates(len(x_rec), real.shape[1:], cfg.sigma_x, cfg.seed)
    held_out = torch.cat([t.x_test for t in old_tasks])
    pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(cfg.seed))[:len(x_rec)]
    found, nearest = reconstruction_quality(real, x_rec, mean_image)
    floor, _ = reconstruction_quality(real, start.to(real.device), mean_image)
    ceiling, _ = reconstruction_quality(real, held_out[pick.to(held_out.device)], mean_image)
    quality = {}
    for prefix, scores in (("", found), ("init_", floor), ("real_", ceiling)):
        quality[prefix + "mean_ssim"] = scores.mean().item()
        quality[prefix + "frac_ssim_above_0_4"] = (scores > 0.4).float().mean().item()
    return quality, real, nearest


def report_reconstruction(name, old_tasks, x_rec, cfg, mean_image, log=print):
    """Log how close the reconstructions made before task len(old_tasks) + 1 are, and save
    their image grid if asked; returns the figures for the run's JSON."""
    task = len(old_tasks) + 1
    quality, real, nearest = judge_reconstruction(old_tasks, x_rec, cfg, mean_image)
    log(f"  [{name}] task {task}: SSIM to nearest real image {quality['mean_ssim']:.3f} "
        f"(random candidates {quality['init_mean_ssim']:.3f}, held-out real {quality['real_mean_ssim']:.3f}), "
        f"{100 * quality['frac_ssim_above_0_4']:.0f}% above 0.4")
    if cfg.save_images:
        run = result_path(cfg.out, cfg, cfg.method, True, cfg.seed)  # named like the run's JSON
        path = run.with_name(f"{run.stem}-task{task}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_pairs(path, real, x_rec, nearest, mean_image)
        torch.save(x_rec.cpu(), path.with_suffix(".pt"))  # the candidates themselves, for other figures
    return {"task": task, **quality}


def variant_name(method, use_recl, objective="stationarity"):
    """'gpm', 'gpm+recl', or 'gpm+inversion' for ReCL's pipeline with the inversion control."""
    return method + ({"stationarity": "+recl", "inversion": "+inversion"}[objective] if use_recl else "")


def run_continual(cfg, tasks, method, use_recl, log=print, mean_image=None):
    """Train one model through all tasks (ReCL optional); return the run's record."""
    if method == "joint":  # the upper bound has no stream of tasks: see run_jointly
        return run_jointly(cfg, tasks, log)
    start = time.time()
    torch.manual_seed(cfg.seed)  # the same init and shuffles for both variants
    device = torch.device(cfg.device)
    tasks = [data.Task(t.classes, *(v.to(device) for v in t[1:])) for t in tasks]
    mean_image = torch.zeros(tasks[0].x_train.shape[1:]) if mean_image is None else mean_image
    mean_image = mean_image.to(device)
    per_task = len(tasks[0].classes)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], per_task).to(device)
    hooks, state = strategies.STRATEGIES[method], strategies.new_state(method, **cfg.hp)
    name = variant_name(method, use_recl, cfg.rec_objective)
    R = [[None] * len(tasks) for _ in tasks]
    reconstructions, recon_quality, earlier, diverged = [], [], None, None
    phases = dict.fromkeys(["reconstruct", "quality_report", "train", "evaluate"], 0.0)  # where the time goes
    clock = time.time()

    def lap(phase):  # charge the time since the last lap to `phase`
        nonlocal clock
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.time()
        phases[phase] += now - clock
        clock = now

    for t, task in enumerate(tasks):
        task_start = time.time()
        x, y = task.x_train, task.y_train
        if use_recl and t > 0:
            # Step 1: reconstruct old data from the model as it is after task t-1.
            x_rec, y_rec, lam_rec, report = reconstruct_old_data(model, tasks[:t], cfg, mean_image,
                                                                 cfg.seed * 100 + t, log, earlier)
            if cfg.freeze_old:
                earlier = (x_rec, y_rec, lam_rec)  # kept whole: the filter below judges them again each time
            if cfg.filter:
                keep = classified_as_labelled(model, x_rec, y_rec)
                x_rec, y_rec, report["kept"] = x_rec[keep], y_rec[keep], int(keep.sum())
            reconstructions.append({"task": t + 1, **report})
            log(f"  [{name}] task {t + 1}: reconstructed {report['kept']}/{report['candidates']} "
                f"in {report['seconds']}s, loss {report['first_loss']:.4g} -> {report['last_loss']:.4g}")
            lap("reconstruct")
            if len(x_rec):
                recon_quality.append(report_reconstruction(name, tasks[:t], x_rec, cfg, mean_image, log))
            lap("quality_report")
            # Step 2: train on new data and reconstructions together (the
            # reconstructions last, so train_task knows which rows to add noise to).
            x, y = torch.cat([x, x_rec]), torch.cat([y, y_rec])
        if cfg.scenario == "cil":
            models.grow_head(model, per_task * (t + 1))
        try:
            loss = train_task(model, x, y, hooks, state, cfg, len(x) - len(task.x_train))
        except Diverged as err:  # the record says so and has no ACC or BWT to average
            diverged = f"{err} of task {t + 1}"
            log(f"  [{name}] task {t + 1}: diverged, {err}")
            break
        model.eval()  # strategies look at the trained model (fixed batch-norm statistics, no dropout)
        if "after_task" in hooks:
            hooks["after_task"](model, task, state)
        lap("train")
        R[t][:t + 1] = [accuracy(model, old.x_test, old.y_test) for old in tasks[:t + 1]]
        lap("evaluate")
        log(f"  [{name}] task {t + 1}/{len(tasks)} classes {task.classes}: loss {loss:.3f}, "
            f"acc {' '.join(f'{a:.1f}' for a in R[t][:t + 1])} ({time.time() - task_start:.1f}s)")

    acc, bwt = acc_and_bwt(R) if diverged is None else (None, None)
    return {"method": method, "recl": use_recl, "scenario": cfg.scenario, "dataset": dataset_name(cfg.dataset),
            "seed": cfg.seed, "acc_matrix": R, "ACC": acc, "BWT": bwt, "diverged": diverged,
            "seconds": round(time.time() - start, 2), "reconstructions": reconstructions,
            "recon_quality": recon_quality, "phase_seconds": {k: round(v, 2) for k, v in phases.items()}}


def run_jointly(cfg, tasks, log=print):
    """The upper bound (`--method joint`): one model trained on every task's training images
    at once, as if nothing were ever forgotten. Its record has one row of test accuracies,
    one per task; BWT does not apply (no task came first), and neither does ReCL."""
    start = time.time()
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    tasks = [data.Task(t.classes, *(v.to(device) for v in t[1:])) for t in tasks]
    n_outputs = len(tasks[0].classes) * (len(tasks) if cfg.scenario == "cil" else 1)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], n_outputs).to(device)
    x, y = torch.cat([t.x_train for t in tasks]), torch.cat([t.y_train for t in tasks])
    acc, row, diverged = None, None, None
    try:
        loss = train_task(model, x, y, {}, {}, cfg)
        row = [accuracy(model, t.x_test, t.y_test) for t in tasks]
        acc = sum(row) / len(row)
        log(f"  [joint] all {len(tasks)} tasks at once: loss {loss:.3f}, acc {' '.join(f'{a:.1f}' for a in row)}")
    except Diverged as err:
        diverged = str(err)
        log(f"  [joint] diverged, {err}")
    return {"method": "joint", "recl": False, "scenario": cfg.scenario, "dataset": dataset_name(cfg.dataset),
            "seed": cfg.seed, "acc_matrix": [row], "ACC": acc, "BWT": None, "diverged": diverged,
            "seconds": round(time.time() - start, 2), "reconstructions": [], "recon_quality": []}


# -----------------------------------------------------------------------------
# 3b. Choosing a method's hyperparameters (paper App. F: on validation data)
# -----------------------------------------------------------------------------

def tune_method(cfg, log=print):
    """Choose lr, epochs and the method's own hyperparameters on validation data.

    Random search over strategies.TRAINING_GRID and SEARCH_GRID (cfg.trials
    draws, seeded), each draw scored by the ACC of the method (with ReCL if
    cfg.variant is "recl") on a split held out from the training images of seed
    cfg.seed. The test images are never loaded into the tasks this sees.
    Returns every trial, best first.
    """
    use_recl = cfg.variant == "recl"
    tasks, _, mean_image = data.make_tasks(cfg.dataset, cfg.seed, cfg.n_per_class, cfg.scenario,
                                           cfg.classes_per_task, cfg.data_root)
    tasks = data.validation_split(tasks, 0.2, cfg.seed)
    grid = {**strategies.TRAINING_GRID, **strategies.SEARCH_GRID[cfg.method]}
    combos = list(itertools.product(*grid.values()))
    picks = torch.randperm(len(combos), generator=torch.Generator().manual_seed(cfg.seed))[:cfg.trials]
    log(f"tuning {variant_name(cfg.method, use_recl, cfg.rec_objective)} | {cfg.scenario} | {cfg.dataset} | "
        f"seed {cfg.seed}: {len(picks)} of {len(combos)} settings, scored on validation data")
    trials = []
    for number, pick in enumerate(picks.tolist()):
        chosen = dict(zip(grid, combos[pick]))
        own = {k: v for k, v in chosen.items() if k not in strategies.TRAINING_GRID}
        run_cfg = argparse.Namespace(**{**vars(run_config(cfg, cfg.seed, use_recl)), "lr": chosen["lr"],
                                        "epochs": chosen["epochs"], "hp": {**cfg.hp, **own}})
        record = run_continual(run_cfg, tasks, cfg.method, use_recl, lambda *a: None, mean_image)
        trials.append({"settings": chosen, "val_ACC": record["ACC"], "val_BWT": record["BWT"],
                       "seconds": record["seconds"], "diverged": record["diverged"]})
        outcome = (f"diverged ({record['diverged']})" if record["diverged"]
                   else f"validation ACC {record['ACC']:.2f}")
        log(f"  trial {number + 1}/{len(picks)}: " + " ".join(f"{k} {v:g}" for k, v in chosen.items())
            + f" -> {outcome} ({record['seconds']:.0f}s)")
    return sorted(trials, key=trial_score, reverse=True)  # a diverged trial is a failed one: last


def trial_score(trial):
    return -math.inf if trial["val_ACC"] is None else trial["val_ACC"]


# =============================================================================
# 4. The command line
# =============================================================================

METHODS = list(strategies.STRATEGIES) + ["joint"]
MNIST_SUBSET_PER_CLASS = 500


def images_per_class(text):
    return None if text == "all" else int(text)


class UsageError(Exception):
    """Bad command-line input; printed as one line."""


class RunFailed(Exception):
    """A run finished without usable numbers (it diverged); printed as one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


class HelpWithDefaults(argparse.HelpFormatter):
    """Add "(default: ...)" to a flag's help unless the help already says what happens without it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def method_hyperparameter(text):
    key, sep, value = text.partition("=")
    try:
        return key, float(value) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None


def make_parser():
    p = Parser(description="Train a continual-learning method with and without ReCL (reconstruction of old "
                           "data from the model) on a stream of tasks, and report ACC and BWT. "
                           "Default: SplitMNIST from the shipped MNIST subset.",
               formatter_class=HelpWithDefaults)
    p.add_argument("--scenario", choices=["cil", "dil"], default="cil",
                   help="class-incremental (a growing head) or domain-incremental (the same labels every task)")
    p.add_argument("--method", choices=METHODS, default="finetune", help="the continual-learning method")
    p.add_argument("--variant", choices=["both", "base", "recl"], default="both",
                   help="the method alone, with ReCL, or both on the same seeds")
    p.add_argument("--dataset", default="mnist",
                   help=f"one of {', '.join(data.DATASETS)}, or a .pt file (see docs/running.md)")
    p.add_argument("--data-root", default="data", help="where mnist-full, cifar10, tinyimagenet live")
    p.add_argument("--classes-per-task", type=int, default=None,
                   help="classes per task (default: 2; 20 for tinyimagenet, as in the paper)")
    p.add_argument("--model", choices=models.MODELS, default="mlp",
                   help="the paper's homogeneous MLP or CNN, or a non-homogeneous AlexNet/ResNet18")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds, each its own class order and init")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=None,
                   help="epochs per task (default: the variant's tuned value, strategies.settings; "
                        "the method's own with --paper)")
    g.add_argument("--lr", type=float, default=None,
                   help="SGD learning rate (default: the variant's tuned value, strategies.settings; "
                        "the method's own with --paper)")
    g.add_argument("--batch-size", type=int, default=64, help="training batch size")
    g.add_argument("--n-per-class", type=images_per_class, default=100,
                   help="training images per class, or 'all'")
    g.add_argument("--validation", action="store_true",
                   help="hold out 20%% of each task's training images and score on them instead of the test "
                        "set: for choosing settings")
    g = p.add_argument_group("reconstruction")
    g.add_argument("--m", type=int, default=None,
                   help="candidates per old class (default: --n-per-class; in DIL per class and old task)")
    g.add_argument("--n-rec", type=int, default=100, help="reconstruction steps before each task")
    g.add_argument("--sigma-x", type=float, default=1e-3, help="std of the initial random candidates")
    g.add_argument("--rec-objective", choices=["stationarity", "inversion"], default="stationarity",
                   help="what the candidates minimise: Eq. 3-6, or plain model inversion (cross-entropy of "
                        "their labels and Eq. 5; a control, see recl.py, part 1)")
    g.add_argument("--ce-weight", type=float, default=None,
                   help="add this weight times the inversion's cross-entropy to Eq. 6 (default: 3e-4 in CIL, "
                        "0 in DIL and with --paper; see recl.py, part 1)")
    g.add_argument("--lr-x", type=float, default=None,
                   help="step size for the candidates (default: 3 for the displacement target, 1 for weights, "
                        "0.003 (CIL) and 0.3 (DIL) for inversion)")
    g.add_argument("--rec-target", choices=["weights", "displacement"], default=None,
                   help="fit theta - theta_0 or theta itself, as Eq. 3 is written (see recl.py, part 1) "
                        "(default: displacement; weights with --paper)")
    g.add_argument("--freeze-old", action=argparse.BooleanOptionalAction, default=None,
                   help="classes reconstructed before keep those candidates, fixed; only the classes "
                        "of the task just learned start from noise (default: on; off with --paper)")
    g.add_argument("--filter", action=argparse.BooleanOptionalAction, default=None,
                   help="train only on candidates the model classifies as their label "
                        "(default: on; off with --paper)")
    g.add_argument("--paper", action="store_true",
                   help="switch off this project's departures from the paper (recl.py, part 1): Eq. 3 on "
                        "the weights, every class reconstructed afresh, no filter, no replay noise, no "
                        "cross-entropy term, and the +ReCL variant trains with the method's own settings "
                        "(strategies.TUNED, not TUNED_RECL); flags given explicitly still win")
    g.add_argument("--replay-noise", type=float, default=None,
                   help="std of the fresh noise on replayed reconstructions, in units of the task's pixel std "
                        f"(0: none; default {strategies.DEFAULT_REPLAY_NOISE}, 0 for GPM: strategies.TUNED_RECL; "
                        "0 with --paper)")
    g.add_argument("--rec-precision", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="number format of the reconstruction's matrix products (auto: bfloat16 on a CPU "
                        "with bfloat16 instructions, else float32; see recl.py, part 1)")
    g.add_argument("--lr-lambda", type=float, default=0.1, help="step size for the coefficients lambda_i")
    g.add_argument("--lambda-min", type=float, default=0.05, help="Eq. 4 pushes each lambda_i above this")
    g.add_argument("--alpha", type=float, default=100.0, help="sharpness of the smooth ReLU backward")
    g.add_argument("--tuning", choices=["naive", "unsup", "sup"], default="naive",
                   help="reconstruction hyperparameters: fixed, or a random search per task scored by the "
                        "final loss (unsup) or by SSIM to a few stored real images (sup) (Sec. 4.3)")
    g.add_argument("--trials", type=int, default=10, help="random-search trials (per task for --tuning)")
    g.add_argument("--save-images", action="store_true",
                   help="per task, a PNG grid of real images over their nearest reconstructions, and the "
                        "reconstructions as a .pt tensor")
    p.add_argument("--hp", type=method_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
                   help="a method hyperparameter, e.g. --hp ewc_lambda=1000 (default: the tuned values; "
                        "see strategies.HYPERPARAMETERS)")
    p.add_argument("--tune", action="store_true",
                   help="search the method's lr, epochs and hyperparameters on validation data and exit "
                        "(with ReCL if --variant recl)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when a GPU is present")
    p.add_argument("--out", default="results", help="folder for one JSON file per run")
    p.add_argument("--quiet", action="store_true", help="print only one line per finished run")
    p.add_argument("--aggregate", metavar="DIR",
                   help="print the results table of the runs in DIR, write DIR/chart-DATASET.svg, and exit")
    p.add_argument("--pending", action="store_true",
                   help="read recl.py command lines on stdin and print those whose result is missing or stale "
                        "(run_all.sh uses this), then exit")
    p.add_argument("--queue", metavar="DIR",
                   help="run the recl.py command lines in DIR/commands one after another in this process, "
                        "skipping those another --queue process on DIR has claimed (run_all.sh starts JOBS "
                        "of these), then exit")
    return p


def check_args(cfg):
    """Reject values that make no sense before any work starts."""
    positive = {"batch-size": cfg.batch_size, "n-rec": cfg.n_rec, "sigma-x": cfg.sigma_x,
                "lr-lambda": cfg.lr_lambda, "lambda-min": cfg.lambda_min,
                "alpha": cfg.alpha, "seeds": cfg.seeds, "trials": cfg.trials}
    optional = {"epochs": cfg.epochs, "lr": cfg.lr, "lr-x": cfg.lr_x, "m": cfg.m, "n-per-class": cfg.n_per_class,
                "classes-per-task": cfg.classes_per_task}
    for flag, value in optional.items():
        if value is not None:
            positive[flag] = value
    for flag, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{flag} must be a positive finite number, got {value}")
    known = strategies.HYPERPARAMETERS[cfg.method]
    for key, value in cfg.hp:
        if key not in known:
            raise UsageError(f"--hp {key}: {cfg.method} has {', '.join(known) or 'no hyperparameters'}")
        if value is None or not math.isfinite(value):
            raise UsageError(f"--hp {key} needs a finite number, like --hp {key}={known[key]}")
    cfg.hp = {key: type(known[key])(value) for key, value in cfg.hp}
    if cfg.tune and (cfg.lr is not None or cfg.epochs is not None):
        raise UsageError("--tune chooses --lr and --epochs itself; leave them out")
    if cfg.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {cfg.seed}")
    for flag, value in (("replay-noise", cfg.replay_noise), ("ce-weight", cfg.ce_weight)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{flag} must be a finite number >= 0, got {value}")
    if cfg.ce_weight and cfg.rec_objective == "inversion":
        raise UsageError("--ce-weight adds inversion's cross-entropy to Eq. 6; with --rec-objective inversion "
                         "it would do nothing")
    if cfg.dataset not in data.DATASETS and not cfg.dataset.endswith(".pt"):
        raise UsageError(f"--dataset must be one of {', '.join(data.DATASETS)} or a .pt file, got {cfg.dataset!r}")
    most = MNIST_SUBSET_PER_CLASS - 1  # keep at least one test image
    if cfg.dataset == "mnist" and (cfg.n_per_class or most + 1) > most:
        raise UsageError(f"--n-per-class {cfg.n_per_class or 'all'} is more than mnist allows "
                         f"({most}; it holds {most + 1} images per class and needs some to test on)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available")


# --paper switches off every departure of part 1 whose flag is not given:
# these three here, the cross-entropy term (departure 5) below, and in
# run_config the replay noise and the +ReCL variant's own training settings.
DEPARTURE_DEFAULTS = {"rec_target": "displacement", "freeze_old": True, "filter": True}
PAPER_PRESET = {"rec_target": "weights", "freeze_old": False, "filter": False}


def resolve_defaults(cfg):
    """Fill in what depends on other flags or on the machine (after check_args)."""
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.m = cfg.m or cfg.n_per_class or 100
    for key, value in (PAPER_PRESET if cfg.paper else DEPARTURE_DEFAULTS).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    if cfg.ce_weight is None:
        cfg.ce_weight = 0.0 if cfg.paper or cfg.rec_objective == "inversion" else DEFAULT_CE_WEIGHT[cfg.scenario]
    cfg.lr_x = cfg.lr_x or default_lr_x(cfg.rec_objective, cfg.rec_target, cfg.scenario)
    cfg.rec_precision = reconstruction_precision(cfg.rec_precision, torch.device(cfg.device))
    cfg.classes_per_task = cfg.classes_per_task or (20 if cfg.dataset == "tinyimagenet" else 2)
    if cfg.method == "joint":  # one model on all tasks at once: nothing to reconstruct
        cfg.variant = "base"
    return cfg


def run_config(cfg, seed, use_recl):
    """The settings one run uses, as its JSON records them: what the command line left open
    filled in from the method's settings (strategies.settings), which differ for the method
    and its +ReCL variant."""
    chosen = strategies.settings(cfg.method, cfg.scenario, use_recl and not cfg.paper)
    # a reconstruction setting: both variants record the value the +ReCL variant uses
    noise = 0.0 if cfg.paper else strategies.settings(cfg.method, cfg.scenario, recl=True)["replay_noise"]
    return argparse.Namespace(**{**vars(cfg), "seed": seed, "lr": chosen["lr"] if cfg.lr is None else cfg.lr,
                                 "epochs": chosen["epochs"] if cfg.epochs is None else cfg.epochs,
                                 "replay_noise": noise if cfg.replay_noise is None else cfg.replay_noise,
                                 "hp": {**{k: chosen[k] for k in strategies.HYPERPARAMETERS[cfg.method]}, **cfg.hp}})


def provenance():
    """What made a result, beyond its config: code version, library, machine."""
    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(commit) and bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                     cwd=here, capture_output=True, text=True,
                                                     timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"commit": commit, "uncommitted_changes": dirty, "torch": torch.__version__, "device": device,
            "threads": torch.get_num_threads(), "python": sys.version.split()[0]}


def dataset_name(dataset):
    return Path(dataset).stem if dataset.endswith(".pt") else dataset


def result_path(out, cfg, method, use_recl, seed):
    variant = variant_name("", use_recl, cfg.rec_objective) + ("" if cfg.tuning == "naive" or not use_recl
                                                                else f"-{cfg.tuning}")
    split = "-validation" if cfg.validation else ""
    return Path(out) / f"{dataset_name(cfg.dataset)}-{cfg.scenario}-{method}{variant}{split}-seed{seed}.json"


def tuning_path(cfg):
    name = variant_name(cfg.method, cfg.variant == "recl", cfg.rec_objective)
    return Path(cfg.out) / f"{dataset_name(cfg.dataset)}-{cfg.scenario}-{name}-tuning-seed{cfg.seed}.json"


def write_atomically(path, text):
    """Write to a temporary name, then rename: a killed run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomically(path, record):
    write_atomically(path, json.dumps(record, indent=1))


# -----------------------------------------------------------------------------
# 4b. For run_all.sh: is a finished run still what would run now? And workers that run the rest
# -----------------------------------------------------------------------------
# A result counts only if its recorded config equals what the same command would
# use today, so a change of a default (or of strategies.TUNED) reruns the runs it
# affects instead of mixing old and new settings in one table. Flags that do not
# change the numbers are left out of the comparison; so is the machine (CPU and
# GPU give the same results up to seed noise, and the JSON's "provenance" says
# which made it). A change of code without a change of settings is not detected:
# the provenance's commit records it. A setting added after a run was made
# counts as what the code did before it existed (ADDED_LATER).

ADDED_LATER = {"rec_objective": "stationarity", "ce_weight": 0.0, "paper": False}
NOT_SETTINGS = {"device", "out", "quiet", "seeds", "variant", "data_root", "aggregate", "pending", "queue",
                "save_images", "tune"}


def settings_of(config):
    """The part of a run's config that decides its numbers, JSON-normalised."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_SETTINGS}))


def differences(old, new):
    keys = sorted(set(old) | set(new), key=str)
    return ", ".join(f"{k} {old.get(k, 'unset')} -> {new.get(k, 'unset')}" for k in keys if old.get(k) != new.get(k))


def command_args(line):
    """The arguments after `recl.py` in a shell command line; None if it does not run recl.py."""
    words = shlex.split(line)
    at = next((i for i, w in enumerate(words) if w.endswith("recl.py")), None)
    return None if at is None else words[at + 1:]


def pending_runs(lines, report=print):
    """The command lines (each `... recl.py ARGS`, one run) whose result is missing or stale."""
    todo = []
    for line in lines:
        args = command_args(line)
        if args is None:
            continue
        try:
            cfg = make_parser().parse_args(args)
            check_args(cfg)
        except UsageError:  # let the run itself say what is wrong
            todo.append(line)
            continue
        cfg = resolve_defaults(cfg)
        if cfg.tune:
            if not tuning_path(cfg).exists():
                todo.append(line)
            continue
        use_recl = cfg.variant == "recl"
        path = result_path(cfg.out, cfg, cfg.method, use_recl, cfg.seed)
        if not path.exists():
            todo.append(line)
            continue
        try:
            recorded = settings_of(json.loads(path.read_text()).get("config", {}))
        except (OSError, ValueError):
            recorded = {}
        wanted = settings_of(vars(run_config(cfg, cfg.seed, use_recl)))
        if recorded:  # a setting added after the run was made: the run had what the code did before
            recorded = {**ADDED_LATER, **recorded}
        if recorded != wanted:
            report(f"stale: {path} ({differences(recorded, wanted) or 'no settings recorded'})")
            todo.append(line)
    return todo


def work_through_queue(folder):
    """--queue: run the command lines in FOLDER/commands in this process, each one that no
    other worker on FOLDER has claimed.

    Why: starting a process costs about 4 s here (importing torch, then
    torch._dynamo, which torch.func and torch.optim load on first use, then
    parsing the MNIST CSV), as long as a whole Finetune run. run_all.sh
    therefore starts JOBS workers on one list instead of one process per run.
    A worker claims run i by creating FOLDER/claimed-i, which succeeds for one
    process only, so runs are handed out one at a time and the workers finish
    together. Every run seeds itself (run_continual), so it gives what it
    would give alone; a run that fails says so in one line and the rest still run.
    """
    if not (Path(folder) / "commands").is_file():
        raise UsageError(f"--queue {folder}: there is no file {Path(folder) / 'commands'}")
    lines = (Path(folder) / "commands").read_text().splitlines()
    failed = []
    for number, line in enumerate(lines):
        args = command_args(line)
        if args is None:
            continue
        try:
            os.close(os.open(Path(folder) / f"claimed-{number}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue  # another worker has it
        try:
            if "--queue" in args:
                raise UsageError("a queued command cannot itself be --queue")
            main(args)
        except (UsageError, RunFailed, data.DataError) as err:
            print(f"recl.py: error: {err} ({line})", file=sys.stderr, flush=True)
            failed.append(line)
    if failed:
        raise RunFailed(f"{len(failed)} queued run(s) failed, each named above")


# -----------------------------------------------------------------------------
# 4c. Tables and a chart from the results files
# -----------------------------------------------------------------------------

def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_name(record):
    tuning = record.get("config", {}).get("tuning", "naive")
    objective = record.get("config", {}).get("rec_objective", "stationarity")
    name = variant_name(record["method"], record["recl"], objective)
    return name + ("" if tuning == "naive" or not record["recl"] else f" ({tuning})")


def summary_table(records):
    """Markdown: one row per method variant, mean(std) over seeds as in the paper's tables,
    with the reconstructions' mean nearest-pair SSIM and seconds for the variants that make
    them. Diverged runs are listed under the table and never averaged."""
    rows = ["| method | seeds | ACC | BWT | SSIM | reconstruction s | seconds |", "|---|---|---|---|---|---|---|"]
    finished = [r for r in records if not r.get("diverged")]

    def cell(values, digits=2):
        return "" if not values or None in values else "{:.{d}f} ({:.{d}f})".format(*mean_std(values), d=digits)

    for name in dict.fromkeys(run_name(r) for r in finished):
        runs = [r for r in finished if run_name(r) == name]
        ssim_ = [statistics.mean(q["mean_ssim"] for q in r["recon_quality"]) for r in runs if r.get("recon_quality")]
        rec_s = [r["phase_seconds"]["reconstruct"] for r in runs if r["recl"] and "phase_seconds" in r]
        seconds = statistics.mean(r["seconds"] for r in runs)
        rows.append(f"| {name} | {len(runs)} | {cell([r['ACC'] for r in runs])} | "
                    f"{cell([r['BWT'] for r in runs]) or 'n/a'} | {cell(ssim_, 3)} | {cell(rec_s, 1)} | "
                    f"{seconds:.1f} |")
    rows += [f"\nDiverged, not averaged: {run_name(r)} seed {r['seed']} ({r['diverged']})"
             for r in records if r.get("diverged")]
    return "\n".join(rows)


def tuning_table(searches):
    """Markdown: the setting each validation search chose, ready for strategies.TUNED."""
    rows = ["| dataset | scenario | method | chosen (validation) | val ACC | trials |", "|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(METHODS)}
    for r in sorted(searches, key=lambda r: (r["dataset"], r["scenario"], order.get(r["method"], len(order)))):
        best = max(r["trials"], key=trial_score)
        chosen = ", ".join(f"{k} {v:g}" for k, v in best["settings"].items())
        score = "all diverged" if best["val_ACC"] is None else f"{best['val_ACC']:.2f}"
        rows.append(f"| {r['dataset']} | {r['scenario']} | {r['method']} | {chosen} | {score} | {len(r['trials'])} |")
    return "\n".join(rows)


def mixed_settings(records):
    """Warnings for table rows whose seeds were run with different settings."""
    warnings, groups = [], {}
    for r in records:
        if "config" in r:
            groups.setdefault((r["dataset"], r["scenario"], run_name(r)), []).append(r)
    for (dataset, scenario, name), runs in groups.items():
        seen = [settings_of({k: v for k, v in r["config"].items() if k != "seed"}) for r in runs]
        if any(s != seen[0] for s in seen):
            other = next(s for s in seen if s != seen[0])
            warnings.append(f"warning: {dataset} {scenario} {name} mixes runs made with different settings "
                            f"({differences(seen[0], other)}); rerun them with run_all.sh")
    return warnings


# The paper's ACC for SplitMNIST (Tables 1 and 2), marked on the chart.
PAPER_ACC = {
    "cil": {"finetune": (50.34, 73.18), "ewc": (40.67, 68.13), "er": (68.59, 71.94), "upgd": (29.10, 70.10),
            "agem": (37.03, 63.31), "lwf": (50.56, 57.15), "gpm": (18.48, 39.25)},
    "dil": {"finetune": (82.23, 83.80), "ewc": (82.91, 84.48), "er": (84.00, 85.44), "upgd": (83.19, 82.95),
            "agem": (83.46, 84.00), "lwf": (83.62, 84.67), "gpm": (73.48, 75.29)},
}


CHART_VARIANTS = (("", "#9e9e9e", "method"), ("+recl", "#1f77b4", "+ReCL"), ("+inversion", "#ff7f0e", "+inversion"))


def chart_svg(records, dataset):
    """An SVG bar chart, written by hand: mean ACC per method alone (grey), with ReCL (blue)
    and with the inversion control (orange), one panel per scenario, whiskers of one std,
    and the paper's value as a black tick."""
    from xml.sax.saxutils import escape
    finished = [r for r in records if not r.get("diverged") and r["dataset"] == dataset
                and r.get("config", {}).get("tuning", "naive") == "naive"]
    scenarios = [s for s in ("cil", "dil") if any(r["scenario"] == s for r in finished)]
    order = {m: i for i, m in enumerate(METHODS)}
    panel_w, top, plot_h, bar_w = 430, 70, 240, 14
    y = lambda acc: top + plot_h * (1 - acc / 100)
    legend = "".join(f'<rect x="{10 + 90 * i}" y="28" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{24 + 90 * i}" y="37">{label}</text>' for i, (_, colour, label) in enumerate(CHART_VARIANTS))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel_w * len(scenarios) + 20}" height="{top + plot_h + 30}"'
             ' font-family="sans-serif" font-size="11">',
             f'<text x="10" y="18" font-size="14">{escape(dataset)}: mean ACC over seeds</text>', legend,
             '<line x1="280" y1="33" x2="294" y2="33" stroke="black" stroke-width="3"/>'
             '<text x="298" y="37">the paper (Tables 1, 2)</text><text x="440" y="37">whiskers: one std</text>']
    for p, scenario in enumerate(scenarios):
        x0 = 20 + 30 + p * panel_w
        runs = [r for r in finished if r["scenario"] == scenario]
        methods = sorted({r["method"] for r in runs}, key=lambda m: order.get(m, len(order)))
        group_w = (panel_w - 50) / max(1, len(methods))
        parts.append(f'<text x="{x0}" y="{top - 12}" font-weight="bold">{scenario.upper()}</text>')
        for tick in range(0, 101, 20):
            parts.append(f'<line x1="{x0 - 4}" y1="{y(tick):.1f}" x2="{x0 + panel_w - 50}" y2="{y(tick):.1f}" '
                         f'stroke="#ddd"/><text x="{x0 - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick}</text>')
        for i, method in enumerate(methods):
            gx = x0 + i * group_w + (group_w - len(CHART_VARIANTS) * bar_w) / 2
            for v, (suffix, colour, _) in enumerate(CHART_VARIANTS):
                name = method + suffix
                accs = [r["ACC"] for r in runs if run_name(r) == name]
                bx = gx + v * bar_w
                if accs:
                    mean, std = mean_std(accs)
                    parts.append(f'<rect class="bar" data-method="{name}" data-scenario="{scenario}" x="{bx:.1f}" '
                                 f'y="{y(mean):.1f}" width="{bar_w - 2}" height="{y(0) - y(mean):.1f}" '
                                 f'fill="{colour}"><title>{name} {scenario.upper()}: '
                                 f'{mean:.2f} ({std:.2f}), {len(accs)} seeds</title></rect>')
                    cx = bx + (bar_w - 2) / 2
                    parts.append(f'<line x1="{cx:.1f}" y1="{y(min(100, mean + std)):.1f}" x2="{cx:.1f}" '
                                 f'y2="{y(max(0, mean - std)):.1f}" stroke="#333"/>')
                paper = PAPER_ACC.get(scenario, {}).get(method) if dataset == "mnist" and v < 2 else None
                if paper:  # drawn last, over the bar
                    parts.append(f'<line class="paper" x1="{bx - 2:.1f}" y1="{y(paper[v]):.1f}" x2="{bx + bar_w:.1f}" '
                                 f'y2="{y(paper[v]):.1f}" stroke="black" stroke-width="3"/>')
            parts.append(f'<text x="{gx + 1.5 * bar_w:.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
                         f'{escape(method)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def aggregate(folder):
    """One table per (dataset, scenario) from every finished run's JSON in `folder`,
    and a chart per dataset, DIR/chart-DATASET.svg."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):  # temporary files start with "." and are skipped
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            print(f"skipping unreadable {path}: {err}", file=sys.stderr)
    if not records:
        raise UsageError(f"no finished runs (*.json) in {folder}")
    searches = [r for r in records if "trials" in r]  # --tune results
    if searches:
        return tuning_table(searches)
    for warning in mixed_settings(records):
        print(warning, file=sys.stderr)
    order = {m: i for i, m in enumerate(METHODS)}
    records.sort(key=lambda r: (order.get(r["method"], len(order)), r["recl"],
                                r.get("config", {}).get("rec_objective") == "inversion", r["seed"]))
    tables = []
    for dataset, scenario in sorted({(r["dataset"], r["scenario"]) for r in records}):
        chosen = [r for r in records if (r["dataset"], r["scenario"]) == (dataset, scenario)]
        tables.append(f"### {dataset}, {scenario.upper()}\n\n{summary_table(chosen)}\n")
    for dataset in sorted({r["dataset"] for r in records}):
        path = Path(folder) / f"chart-{dataset}.svg"
        write_atomically(path, chart_svg(records, dataset))
        print(f"chart: {path}", file=sys.stderr)
    return "\n".join(tables)


def tune_and_report(cfg, log):
    """--tune: run the validation search, save every trial, print the winner."""
    trials = tune_method(cfg, log)
    name = variant_name(cfg.method, cfg.variant == "recl", cfg.rec_objective)
    path = tuning_path(cfg)
    write_json_atomically(path, {"method": name, "scenario": cfg.scenario, "dataset": dataset_name(cfg.dataset),
                                 "seed": cfg.seed, "trials": trials, "config": vars(cfg),
                                 "provenance": provenance()})
    best = trials[0]
    if best["val_ACC"] is None:
        raise RunFailed(f"{name} {cfg.scenario}: every trial diverged ({path})")
    print(f"{name} {cfg.scenario}: best validation ACC {best['val_ACC']:.2f} with {best['settings']} -> {path}")


def main(argv=None):
    cfg = make_parser().parse_args(argv)
    if cfg.aggregate:
        print(aggregate(cfg.aggregate))
        return
    if cfg.pending:
        print("\n".join(pending_runs(sys.stdin.read().splitlines(), lambda m: print(m, file=sys.stderr))))
        return
    if cfg.queue:
        return work_through_queue(cfg.queue)
    check_args(cfg)
    cfg = resolve_defaults(cfg)
    log = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    if cfg.tune:
        return tune_and_report(cfg, log)
    variants = {"both": [False, True], "base": [False], "recl": [True]}[cfg.variant]
    records, failed = [], []
    for seed in range(cfg.seed, cfg.seed + cfg.seeds):
        tasks, class_order, mean_image = data.make_tasks(cfg.dataset, seed, cfg.n_per_class, cfg.scenario,
                                                         cfg.classes_per_task, cfg.data_root)
        if cfg.validation:
            tasks = data.validation_split(tasks, 0.2, seed)
        for use_recl in variants:
            run_cfg = run_config(cfg, seed, use_recl)
            name = variant_name(cfg.method, use_recl, cfg.rec_objective)
            log(f"{name} | {cfg.scenario} | {cfg.dataset} | seed {seed} | class order {class_order}")
            record = run_continual(run_cfg, tasks, cfg.method, use_recl, log, mean_image)
            record.update(class_order=class_order, config=vars(run_cfg), provenance=provenance())
            path = result_path(cfg.out, cfg, cfg.method, use_recl, seed)
            write_json_atomically(path, record)
            if record["diverged"]:
                failed.append(f"{name} {cfg.scenario} seed {seed} diverged: {record['diverged']} "
                              f"(lr {run_cfg.lr:g}); marked so in {path}, never averaged")
                continue
            bwt = "n/a" if record["BWT"] is None else f"{record['BWT']:.2f}"
            print(f"{name} {cfg.scenario} seed {seed}: ACC {record['ACC']:.2f} BWT {bwt} "
                  f"in {record['seconds']:.0f}s -> {path}", flush=True)
            records.append(record)
    if records and not cfg.quiet:
        print(summary_table(records))
    if failed:
        raise RunFailed("; ".join(failed))


if __name__ == "__main__":
    try:
        main()
    except (UsageError, RunFailed, data.DataError) as err:
        sys.exit(f"recl.py: error: {err}")
    except KeyboardInterrupt:
        sys.exit("recl.py: interrupted; finished runs are saved, rerun to redo the rest")
