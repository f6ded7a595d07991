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
with the new task's data (Step 2, Sec. 4.2). No stored real data, no generator.

Reading order: 1. the reconstruction, Eq. 3-6 whole as the paper writes them,
then each departure from it and the inversion control; 2. the metrics, Eq. 1-2;
3. the one training loop, into which strategies.py hooks and to which ReCL only
adds data; 4. the in-training searches of Sec. 4.3; 5. main. config.py holds
every default of a run in one table, judging.py the SSIM of App. D.5, and
experiments.py what produces this project's tables.
"""
import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import config
import data
import judging
import models
import strategies
from config import RunFailed, UsageError

# =============================================================================
# 1. Reconstruction (Sec. 4.1, App. B)
# =============================================================================
#
# Phi(theta; x) for a multi-class network is the margin of x's label y: its
# logit minus the largest other logit. At a margin-maximisation point the
# weights satisfy the stationarity condition (App. B.2, Eq. 9), which Eq. 3 turns
# into a loss over candidates x_1..x_m with fixed labels and coefficients
# lambda_1..lambda_m:
#
#   L_rec    = || theta - (1/m) sum_i lambda_i grad_theta Phi(theta; x_i) ||^2   (Eq. 3)
#   L_lambda = 5 sum_i relu(lambda_min - lambda_i)^2                             (Eq. 4)
#   L_prior  = sum_{i,k} relu(|x_ik| - 1)^2                                      (Eq. 5)
#   L_full   = L_rec + L_lambda + L_prior                                        (Eq. 6)
#
# Three details of the form, the same in every run (with --paper too): the paper
# prints Eq. 4 as sum_i max(-lambda_i, -lambda_min) and Eq. 5 with plain hinges;
# like the public reference code (Buzaglo et al. 2023) we use squared hinges,
# which keep the loss smooth, with this code's weight 5 on Eq. 4; and we scale the
# gradient sum by 1/m so that lambda_min means the same for any m. The norm in
# Eq. 3 runs over every parameter tensor of the network.

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


def image_prior(x):
    """L_prior (Eq. 5): keep every pixel of the candidates inside [-1, 1]."""
    return F.relu(x.abs() - 1).pow(2).sum()


def stationarity_loss(model, params, labels, target, lambda_min, m=None, scale=1.0):
    """L_full (Eq. 6) as a function of the candidates x and their lambdas: Eq. 3-5 by name.
    `target` is theta in Eq. 3; departures 1 and 2 below pass another."""
    def loss(x, lam):
        combination = weighted_gradient_sum(model, params, x, labels, lam, m)
        return {"rec": scale * sum((target[k] - combination[k]).pow(2).sum() for k in params),  # Eq. 3
                "lambda": 5 * F.relu(lambda_min - lam).pow(2).sum(),                             # Eq. 4
                "prior": image_prior(x)}                                                          # Eq. 5
    return loss


def paper_objective(net, params, labels, cfg):
    """Eq. 6 as the paper states it (in the form above): Eq. 3 fits the weights theta themselves."""
    return stationarity_loss(net, params, labels, params, cfg.lambda_min)


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


def reconstruct(model, labels, input_shape, cfg, log=print, objective=paper_objective, start=None):
    """Step 1 of ReCL (Sec. 4.1): recover look-alikes of old training data from `model` alone.

    Random candidates and lambdas (or `start`), two full-batch SGD optimisers with
    momentum 0.9 (Adam with departure 6), n_rec steps on L_full; with departure 11 a
    step that raised the loss is undone, and that pass takes no step.
    `objective(net, params, labels, cfg)` gives L_full; the departures below pass
    their own. Returns the candidates and lambdas with the lowest loss seen, the
    last step's included, and a report.
    """
    device = next(model.parameters()).device
    net = models.with_smooth_relu(model, cfg.alpha).eval()  # smooth backward, exact forward (Haim et al.)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, lam = start if start is not None else initial_candidates(len(labels), input_shape, cfg.sigma_x, cfg.seed)
    x, lam = x.to(device).requires_grad_(), lam.to(device).requires_grad_()
    L_full = objective(net, params, labels.to(device), cfg)
    if cfg.rec_optimizer == "adam":  # departure 6, for the conv nets (betas of DeepInversion)
        optimizer = lambda v, lr: torch.optim.Adam([v], lr=lr, betas=(0.5, 0.9))
    else:
        optimizer = lambda v, lr: torch.optim.SGD([v], lr=lr, momentum=0.9)
    opt_x, opt_lam = optimizer(x, cfg.lr_x), optimizer(lam, cfg.lr_lambda or 0.0)  # inversion has no lambdas
    losses, best, undone, backtracks = [], None, False, 0
    for step in range(cfg.n_rec + 1):  # the extra pass only scores the last step's candidates
        with torch.set_grad_enabled(step < cfg.n_rec):
            terms = L_full(x, lam)
            loss = sum(terms.values())
        losses.append(loss.item())
        if step == 0:
            first_terms = {k: v.detach() for k, v in terms.items()}
        # departure 11: undo a step that raised the loss (the pass after an undo only rescores
        # the restored state, which a GPU may not repeat bit for bit, so it is not judged)
        undone = cfg.backtrack and best is not None and not undone and not losses[-1] <= best[0]
        if undone:
            with torch.no_grad():  # back to the best state, without the momentum that left it,
                x.copy_(best[1])
                lam.copy_(best[2])
            for opt in (opt_x, opt_lam):  # and half as long steps from here on
                opt.state.clear()
                opt.param_groups[0]["lr"] /= 2
            losses[-1], backtracks = best[0], backtracks + 1  # the state held is the best one
        if step and step % max(1, cfg.n_rec // 4) == 0 and step < cfg.n_rec:  # progress at each quarter
            log(f"    step {step}/{cfg.n_rec}: loss {losses[-1]:.4g}")
        if undone:
            continue  # the next pass takes the restored state's gradient
        if not math.isfinite(losses[-1]):
            break
        if best is None or losses[-1] < best[0]:  # a step can overshoot: keep the best candidates seen
            best = (losses[-1], x.detach().clone(), lam.detach().clone(), {k: v.detach() for k, v in terms.items()})
        if step == cfg.n_rec:
            break
        opt_x.zero_grad()
        opt_lam.zero_grad()
        loss.backward()
        opt_x.step()
        opt_lam.step()
    if best is None:  # not even the start has a finite loss: hand back the start, flagged
        best = (losses[0], x.detach(), lam.detach(), {k: v.detach() for k, v in terms.items()})
    return best[1], best[2], reconstruction_report(losses, best, first_terms, backtracks)


def reconstruction_report(losses, best, first_terms, backtracks=0):
    """What a reconstruction did: the loss at its start, of the candidates it kept, and at
    its last step; and why it failed, if it did: the optimisation diverged (a loss that
    turned non-finite, or a last step above the start), or no step lowered the loss.
    With backtracking (departure 11) an undone step counts at the loss of the state it
    returned to, so only "no step lowered the loss" can flag it; `backtracks` counts the undos."""
    first, last = losses[0], losses[-1]
    failed = (f"diverged at step {len(losses) - 1}" if not math.isfinite(last)
              else f"diverged: the last step's loss {last:.4g} is above the start's {first:.4g}" if last > first
              else "no step lowered the loss" if best[0] >= first else None)
    return {"steps": len(losses) - 1, "first_loss": first, "kept_loss": best[0], "last_step_loss": last,
            "first_terms": {k: v.item() for k, v in first_terms.items()},
            "kept_terms": {k: v.item() for k, v in best[3].items()}, "backtracks": backtracks, "failed": failed}

# -----------------------------------------------------------------------------
# Departures from the paper, and a control
# -----------------------------------------------------------------------------
# Departures 1-12; the nine in use are each behind a flag (`--paper` turns them
# all off; docs/departures.md has why and the numbers). 1-5 are every run's
# defaults, chosen on validation data; 6-12 were tried for the conv nets, and
# 7, 10 and 12 lost and are gone. By default (config.NETWORKS, docs/networks.md)
# the CNN and AlexNet take 5 at a larger weight, 6, 8 (local, in CIL; ER keeps
# CE over all classes) and 9; ResNet18 takes 6 and 9; AlexNet and ResNet18 take
# 11; the MLP takes none of 6-11:
#
# 1. `--rec-target displacement`: L_rec fits theta - theta_0, what training
#    added to the weights, relative to its size. Eq. 3 holds in the limit of
#    long training, when the random start theta_0 no longer matters; after
#    minutes of training it still dominates theta, and no candidate explains it.
# 2. `--freeze-old`: a class reconstructed once keeps its candidates, fixed;
#    only the classes of the task just learned start from noise. Reading a class
#    again from a model trained on its reconstructions lets errors compound.
# 3. `--filter`: candidates the model assigns to another class are dropped.
# 4. `--replay-noise`: reconstructions enter each batch with fresh noise (part
#    3), so the network files a neighbourhood, not a prototype, under the old class.
# 5. `--ce-weight` (CIL): a little model inversion added to Eq. 6.
# 6. `--rec-optimizer adam`: Adam for the candidates and the lambdas, the
#    optimiser of image inversion on conv nets (DeepInversion): each pixel and
#    lambda moves about its step size per step whatever the loss's scale, where
#    SGD's step follows the gradient's size, which on deep nets spans orders of
#    magnitude: on ResNet18 the lambdas' SGD step overflowed within 13 steps.
# 7. (removed) a feature-statistics prior, DeepInversion's batch-norm term at
#    every convolution: it lost on the CNN (docs/departures.md has the numbers).
# 8. `--ce-scope new` (CIL, part 3): the task's own images score only its new
#    classes, so they never push the old classes' logits down; the replayed
#    reconstructions alone keep old and new apart (the cross-entropy Always Be
#    Dreaming gives new data).
#    `--ce-scope local`: the replayed rows score only the old classes too, and
#    old against new is learned by the head alone, from both, with the features
#    held fixed (Always Be Dreaming's split): the features then have no reason
#    to tell reconstructions from real images, only classes from classes.
# 9. `--replay-batch N` (part 3): each step adds N reconstructions, drawn at
#    random, to a batch of the task's own images, as data-free replay methods do
#    (Always Be Dreaming, R-DFCIL). The paper joins every reconstruction to the
#    task's data, so the share of replay in a batch and the cost of an epoch
#    change from task to task; here both stay fixed.
# 10. (removed) DeepInversion's image priors, total variation and random
#    jitter: they made the CNN's candidates look more like data, not its replay
#    more useful (docs/departures.md).
# 11. `--backtrack` (Step 1): a step that raises L_full is undone, momentum and
#    all, and the step sizes halve, so a reconstruction only ever descends. A
#    step size that overshoots then costs steps, not the reconstruction: the
#    image-inversion codes that work on ResNets guard their steps the same way
#    (warm-up, clipping), and without it ResNet18 still ends some above its start.
# 12. (removed) Eq. 3 as a cosine, the direction of the target only, as gradient
#    inversion matches gradients; it lost on the CNN, as did weight decay in
#    training, which would make Eq. 3 hold at a stationary point (docs/departures.md).
#
# The control, `--rec-objective inversion` (the +inversion variant): is it
# Eq. 3 that makes the candidates useful, or would any optimisation that makes
# the model recognise them as their labels do? Model inversion (Simonyan et
# al. 2014; DeepInversion, Yin et al. 2020, without its batch-norm term) asks
# only the second: L_inv = sum_i CE(f(x_i), y_i) + L_prior, over the same
# candidates, labels, optimiser, steps, filter and replay; no lambdas, no
# stationarity condition, one backward pass per step instead of a double one.
# And for speed, `--rec-precision bfloat16` runs the loss's products in bfloat16.

def reconstruction_target(params, start, target):
    """Departure 1: what the gradient combination should equal, and the scale of L_rec:
    theta as in Eq. 3, or the displacement theta - theta_0 measured relative to its size."""
    if target == "weights":
        return params, 1.0
    if start is None:
        raise ValueError("the displacement target needs the model's initial weights: "
                         "build it with models.build_model or call models.remember_start first")
    displacement = {k: params[k] - start[k] for k in params}
    return displacement, 1.0 / sum(v.pow(2).sum() for v in displacement.values()).clamp_min(1e-30)


def unexplained(report, cfg):
    """For the log: with the displacement target L_rec is relative, so the kept L_rec is the
    share of theta - theta_0 that Eq. 3's combination of all the candidates (those kept fixed
    too, before the filter) leaves unexplained: 1 when it explains none of it, as with every
    lambda at 0; above 1, worse than that. (The inversion control has no target.)"""
    if cfg.rec_target != "displacement":
        return ""
    return f", Eq. 3 leaves {report['kept_terms']['rec']:.0%} of theta - theta_0 unexplained"


def keep_earlier(x, lam, labels, earlier_x, earlier_labels, earlier_lam):
    """Departure 2: put each class's earlier reconstructions, with their lambdas, into the
    first slots of that class. Returns the candidates, their lambdas and a mask of the
    slots that were filled: those stay fixed. Slots without an earlier reconstruction of
    their label (the classes of the task just learned) keep their noise and random lambdas."""
    x, lam, filled = x.clone(), lam.clone(), torch.zeros(len(x), dtype=torch.bool, device=x.device)
    for c in earlier_labels.unique():
        slots = (labels == c).nonzero().squeeze(1)
        earlier = (earlier_labels == c).nonzero().squeeze(1)
        n = min(len(slots), len(earlier))
        x[slots[:n]], lam[slots[:n]], filled[slots[:n]] = earlier_x[earlier[:n]], earlier_lam[earlier[:n]], True
    return x, lam, filled


@torch.no_grad()
def classified_as_labelled(model, x, y):
    """Departure 3, the filter: which candidates the model assigns to their own label.
    A candidate it files under another class would teach the wrong boundary
    (App. D.5 suggests filtering reconstructions)."""
    model.eval()
    return model(x).argmax(1) == y


def inversion_losses(model, params, x, y):
    """The control's L_inv by name: cross-entropy of the candidates' own labels, and L_prior."""
    logits = functional_call(model, params, (x,))
    return {"ce": F.cross_entropy(logits, y, reduction="sum"), "prior": image_prior(x)}


def objective_of(model, fixed=None, m=None):
    """L_full with the departures its `cfg` has on, or the control's L_inv, as `reconstruct`
    takes it. `fixed` = (x, labels, lambdas) of the candidates departure 2 keeps, m the count of all."""
    def objective(net, params, labels, cfg):
        if cfg.variant == "inversion":
            loss = lambda x, lam: inversion_losses(net, params, x, labels)
        else:
            target, scale = reconstruction_target(params, models.start_weights(model), cfg.rec_target)
            if fixed is not None:  # their share of Eq. 3's sum never changes: subtract it once
                share = weighted_gradient_sum(net, params, *fixed, m)
                target = {k: target[k] - share[k] for k in target}
            eq6 = stationarity_loss(net, params, labels, target, cfg.lambda_min, m, scale)
            weight = cfg.ce_weight  # departure 5
            loss = eq6 if not weight else lambda x, lam: {
                **eq6(x, lam), "ce": weight * inversion_losses(net, params, x, labels)["ce"]}
        device_type = next(iter(params.values())).device.type

        def in_precision(x, lam):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.rec_precision == "bfloat16"):
                return loss(x, lam)
        return in_precision
    return objective


def reconstruct_old_data(model, old_tasks, cfg, log=print, earlier=None):
    """Step 1 as this run makes it: labels for the candidates, then `reconstruct` with the
    run's departures. With `earlier` = (x, labels, lambdas) from before the previous task,
    the classes it covers keep those candidates, fixed (departure 2)."""
    device = next(model.parameters()).device
    input_shape = old_tasks[0].x_train.shape[1:]
    labels = candidate_labels(model.head.out_features, cfg.m, len(old_tasks), cfg.scenario).to(device)
    x, lam = (v.to(device) for v in initial_candidates(len(labels), input_shape, cfg.sigma_x, cfg.seed))
    fixed = torch.zeros(len(x), dtype=torch.bool, device=device)
    if earlier is not None:
        x, lam, fixed = keep_earlier(x, lam, labels, *earlier)
    objective = objective_of(model, (x[fixed], labels[fixed], lam[fixed]) if fixed.any() else None, len(x))
    x[~fixed], lam[~fixed], report = reconstruct(model, labels[~fixed], input_shape, cfg, log, objective,
                                                 (x[~fixed], lam[~fixed]))
    return x, labels, lam, {"candidates": len(x), "optimised": int((~fixed).sum()), **report}


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


def with_head_input(model, x):
    """The model's logits for x, and what its head took in: the features."""
    seen = []
    hook = model.head.register_forward_hook(lambda layer, inputs, out: seen.append(inputs[0]))
    try:
        return model(x), seen[0]
    finally:
        hook.remove()


def cross_entropy(logits, y, scope, own, n_old_classes, head_only=None):
    """The batch's cross-entropy over the classes `scope` lets each row compare (departure 8):
    "all" of them; "new": the task's own rows (`own`) leave the first `n_old_classes` alone;
    "local": own rows over the new classes, replayed rows over the old, and old against new
    in `head_only`, the logits of the head alone on features it cannot change."""
    if scope == "all" or not n_old_classes:
        return F.cross_entropy(logits, y)
    old = (torch.arange(logits.shape[1], device=logits.device) < n_old_classes)[None]
    own = own[:, None]
    if scope == "new":
        return F.cross_entropy(logits.masked_fill(own & old, float("-inf")), y)
    grouped = logits.masked_fill(torch.where(own, old, ~old), float("-inf"))
    return F.cross_entropy(grouped, y) + F.cross_entropy(head_only, y)


def train_task(model, x, y, hooks, state, cfg, n_replayed=0, n_old_classes=0):
    """Plain SGD on cross-entropy; the strategy's hooks add a loss term or edit gradients.

    The last `n_replayed` rows of x are ReCL's reconstructions. Each time one
    of them is drawn into a batch it gets fresh noise N(0, s^2), with s
    cfg.replay_noise times the pixel std of the task's own images (departure 4
    in part 1). Noise drawn once and kept does not help (docs/departures.md):
    it is a new draw each time that covers the neighbourhood.
    With cfg.replay_batch > 0 (departure 9), an epoch passes over the task's own
    images and each batch of them gets that many reconstructions drawn at random;
    otherwise the reconstructions are shuffled in with the task's images.
    With cfg.ce_scope "new" (departure 8), the task's own images are scored over
    the classes after the first `n_old_classes` only; with "local", the replayed
    rows over the old classes only too, and a second cross-entropy over all
    classes trains the head alone, on features it cannot change.
    """
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    first_replayed = len(x) - n_replayed
    # a Python float, so the batch loop never waits on the device to compare it
    noise_std = (cfg.replay_noise * x[:first_replayed].std()).item() if n_replayed else 0.0
    noise_gen = torch.Generator(device=x.device).manual_seed(cfg.seed)
    replay_gen = torch.Generator(device=x.device).manual_seed(cfg.seed + 1)
    mixed = bool(cfg.replay_batch and n_replayed)  # departure 9
    epoch_rows = first_replayed if mixed else len(x)
    batches = data.loader(torch.arange(epoch_rows, device=x.device), y[:epoch_rows], cfg.batch_size, seed=cfg.seed)

    def steps():
        """The row numbers of each batch of one epoch."""
        for rows, _ in batches:
            if mixed:
                drawn = torch.randint(n_replayed, (cfg.replay_batch,), generator=replay_gen, device=x.device)
                rows = torch.cat([rows, first_replayed + drawn])
            yield rows

    for epoch in range(cfg.epochs):
        total, seen = 0.0, 0
        for rows in steps():
            xb, yb = x[rows], y[rows]
            if noise_std > 0:
                replayed = (rows >= first_replayed).view(-1, *[1] * (x.dim() - 1))
                xb = xb + replayed * noise_std * torch.randn(xb.shape, generator=noise_gen, device=x.device)
            scope, head_only = cfg.ce_scope, None
            if scope == "local" and n_replayed:
                logits, features = with_head_input(model, xb)
                head_only = model.head(features.detach())
            else:
                logits = model(xb)
                scope = "new" if scope == "local" else scope  # local with no reconstruction kept to replay
            loss = cross_entropy(logits, yb, scope, rows < first_replayed, n_old_classes, head_only)
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
            total, seen = total + value * len(xb), seen + len(xb)
    # Batch norm (ResNet18) evaluates with running statistics, which start at mean 0,
    # variance 1 and move a little each step: a task's few dozen steps leave much of that
    # start in them, and a net that fits its task can score chance. So re-estimate
    # them on the task's data with the final weights (docs/running.md, "Other models").
    # Networks without batch norm skip this.
    torch.optim.swa_utils.update_bn(((x[rows],) for rows in steps()), model)
    return total / max(seen, 1)  # mean loss of the last epoch


def run_continual(cfg, tasks, log=print, judge=None, mean_image=None):
    """Train one model through all tasks, with ReCL if cfg.variant says so; return the run's
    record. `judge(old_tasks, x_rec)`, if given, reports on each reconstruction (judging.py);
    what it returns goes into the record, and training never sees it."""
    if cfg.method == "joint":  # the upper bound has no stream of tasks: see run_jointly
        return run_jointly(cfg, tasks, log)
    started = time.time()
    torch.manual_seed(cfg.seed)  # the same init and shuffles for every variant
    device = torch.device(cfg.device)
    tasks = [data.Task(t.classes, *(v.to(device) for v in t[1:])) for t in tasks]
    per_task = len(tasks[0].classes)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], per_task).to(device)
    hooks, state = strategies.STRATEGIES[cfg.method]["hooks"], strategies.new_state(cfg.method, **cfg.hp)
    step1 = reconstruct_old_data if cfg.tuning in (None, "naive") else (  # or a search, part 4
        lambda *args: search_reconstruction(*args, mean_image=mean_image))
    name = config.variant_name(cfg.method, cfg.variant)
    R = [[None] * len(tasks) for _ in tasks]
    reconstructions, recon_quality, earlier, diverged = [], [], None, None
    for t, task in enumerate(tasks):
        x, y = task.x_train, task.y_train
        if cfg.variant != "base" and t > 0:
            # Step 1: reconstruct old data from the model as it is after task t-1.
            start = time.time()
            x_rec, y_rec, lam_rec, report = step1(model, tasks[:t], cfg, log, earlier)
            log(f"    reconstruction took {time.time() - start:.1f}s")
            if cfg.freeze_old:
                earlier = (x_rec, y_rec, lam_rec)  # kept whole: the filter below judges them again each time
            if cfg.filter:
                keep = classified_as_labelled(model, x_rec, y_rec)
                x_rec, y_rec = x_rec[keep], y_rec[keep]
            reconstructions.append({"task": t + 1, **report, "kept": len(x_rec),
                                    "seconds": round(time.time() - start, 2)})
            log(f"  [{name}] task {t + 1}: reconstructed {len(x_rec)}/{report['candidates']}, "
                f"loss {report['first_loss']:.4g} -> {report['kept_loss']:.4g}" + unexplained(report, cfg)
                + (f", FLAGGED: {report['failed']} (kept its lowest-loss candidates)" if report["failed"] else ""))
            if judge and len(x_rec):
                recon_quality.append(judge(tasks[:t], x_rec))
            # Step 2: train on new data and reconstructions together (the
            # reconstructions last, so train_task knows which rows to add noise to).
            x, y = torch.cat([x, x_rec]), torch.cat([y, y_rec])
        if cfg.scenario == "cil":
            models.grow_head(model, per_task * (t + 1))
        try:
            loss = train_task(model, x, y, hooks, state, cfg, len(x) - len(task.x_train),
                              per_task * t if cfg.scenario == "cil" else 0)
        except Diverged as err:  # the record says so and has no ACC or BWT to average
            diverged = f"{err} of task {t + 1}"
            log(f"  [{name}] task {t + 1}: diverged, {err}")
            break
        model.eval()  # strategies look at the trained model (fixed batch-norm statistics, no dropout)
        if "after_task" in hooks:
            hooks["after_task"](model, data.loader(task.x_train, task.y_train, cfg.batch_size, shuffle=False), state)
        R[t][:t + 1] = [accuracy(model, old.x_test, old.y_test) for old in tasks[:t + 1]]
        log(f"  [{name}] task {t + 1}/{len(tasks)} classes {task.classes}: loss {loss:.3f}, "
            f"acc {' '.join(f'{a:.1f}' for a in R[t][:t + 1])}")

    acc, bwt = acc_and_bwt(R) if diverged is None else (None, None)
    return {"method": cfg.method, "variant": cfg.variant, "recl": cfg.variant != "base", "scenario": cfg.scenario,
            "seed": cfg.seed, "acc_matrix": R, "ACC": acc, "BWT": bwt, "diverged": diverged,
            "reconstructions": reconstructions, "recon_quality": recon_quality,
            "failed_reconstructions": sum(bool(r["failed"]) for r in reconstructions),
            "seconds": round(time.time() - started, 2),
            "phase_seconds": {"reconstruct": round(sum(r["seconds"] for r in reconstructions), 2)}}


def run_jointly(cfg, tasks, log=print):
    """The upper bound (`--method joint`): one model trained on every task's training images
    at once, as if nothing were ever forgotten. Its record has one row of test accuracies,
    one per task; BWT does not apply (no task came first), and neither does ReCL."""
    started = time.time()
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
    return {"method": "joint", "variant": "base", "recl": False, "scenario": cfg.scenario,
            "seed": cfg.seed, "acc_matrix": [row], "ACC": acc, "BWT": None, "diverged": diverged,
            "reconstructions": [], "recon_quality": [], "failed_reconstructions": 0,
            "seconds": round(time.time() - started, 2), "phase_seconds": {"reconstruct": 0.0}}



# =============================================================================
# 4. Tuning the reconstruction during training (Sec. 4.3)
# =============================================================================
# naive: the run's own values. unsup: a random search at each task, keeping the
# trial with the lowest final L_full; it needs no old data. sup: the same search
# scored by SSIM against a small buffer of real old images (an ablation: it
# stores data). Trial 1 is always the run's own values, so a search can only
# keep them or find something its score rates higher.
#
# Where we depart from the paper's App. B.3: its ranges (lr_x in [1e-5, 1], ...)
# were set for Eq. 3 on the weights, and our lr_x lies above them. Each draw is
# therefore log-uniform within a factor of the run's own value, the same rule
# for every objective and scenario (docs/reconstruction-quality.md chose them).
SEARCH_SPACE = {"sigma_x": 10.0, "lr_x": 10.0, "lr_lambda": 10.0, "lambda_min": 3.0, "alpha": 3.0}


def random_search(candidates, evaluate):
    """Score each settings dict in `candidates`, in order, by evaluate(settings) ->
    (score, summary, payload). Returns every (score, settings, summary), best first,
    and the best trial's payload, the only one kept (a reconstruction's candidates).
    Ties go to the earlier trial; a non-finite score ranks last. The methods'
    validation search shares it (experiments.py)."""
    trials, best = [], None
    for settings in candidates:
        score, summary, payload = evaluate(settings)
        score = score if math.isfinite(score) else -math.inf
        trials.append((score, settings, summary))
        if best is None or score > best[0]:
            best = (score, payload)
    return sorted(trials, key=lambda trial: -trial[0]), best[1]  # sorted() is stable: ties keep their order


def sample_hyperparameters(gen, centre):
    """One draw: each hyperparameter of `centre` log-uniform in [centre / factor, centre * factor]."""
    return {name: centre[name] * SEARCH_SPACE[name] ** (2 * torch.rand(1, generator=gen).item() - 1)
            for name in centre}


def reference_buffer(old_tasks, fraction, seed):
    """A few real images of each old task: only the supervised search uses them."""
    gen = torch.Generator().manual_seed(seed)
    picks = [t.x_train[torch.randperm(len(t.x_train), generator=gen)[:max(1, round(fraction * len(t.x_train)))]]
             for t in old_tasks]
    return torch.cat(picks)


def search_reconstruction(model, old_tasks, cfg, log=print, earlier=None, mean_image=None):
    """Step 1 with a search: `cfg.trials` reconstructions, trial 1 at the run's own values,
    the others drawn around them (only those that apply to its objective). Returns the one
    the score rates highest; its report names the values used."""
    seed = cfg.seed * 100 + len(old_tasks)  # the search's own draws, new before each task
    if cfg.tuning == "unsup":  # the lowest final L_full; needs no old data
        score = lambda x, report: -report["kept_loss"]
    else:  # sup: SSIM against a few stored real images of each old task
        buffer = reference_buffer(old_tasks, 0.1, seed)
        mean = torch.zeros(buffer.shape[1:]) if mean_image is None else mean_image
        score = lambda x, report: judging.reconstruction_quality(buffer, x, mean.to(x.device))[0].mean().item()
    gen = torch.Generator().manual_seed(seed)
    own = {k: getattr(cfg, k) for k in SEARCH_SPACE if getattr(cfg, k) is not None}
    candidates = [own] + [sample_hyperparameters(gen, own) for _ in range(cfg.trials - 1)]

    def evaluate(hp):
        x, y, lam, report = reconstruct_old_data(model, old_tasks, dataclasses.replace(cfg, **hp), log, earlier)
        # a draw whose kept candidates are no better than its start loses; one that overshot
        # after improving competes with what it kept (it is still flagged in the run)
        useless = not math.isfinite(report["kept_loss"]) or report["kept_loss"] >= report["first_loss"]
        value = -math.inf if useless else score(x, report)
        log(f"    trial {candidates.index(hp) + 1}/{cfg.trials}: " + " ".join(f"{k} {v:.3g}" for k, v in hp.items())
            + f" -> score {value:.4g}")
        return value, None, (x, y, lam, {**report, "hyperparameters": hp, "score": value})

    _, best = random_search(candidates, evaluate)
    return best


# =============================================================================
# 5. main: one config per run, checked before anything trains
# =============================================================================

def make_tasks(cfg):
    """The run's tasks (its validation split with --validation), class order, mean image,
    and the classes no task holds."""
    tasks, order, mean_image, left_out = data.make_tasks(cfg.dataset, cfg.seed, cfg.n_per_class, cfg.scenario,
                                                         cfg.classes_per_task, cfg.data_root)
    if cfg.validation:
        tasks = data.validation_split(tasks, 0.2, cfg.seed)
    return tasks, order, mean_image, left_out


def main(argv=None):
    """Run a method (and/or its +ReCL variant) over `--seeds` seeds; one JSON file per run."""
    args = config.make_parser().parse_args(argv)
    config.provenance()  # the code this process loaded, named now: a commit made while it runs is not it
    config.check(args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    runs = [config.resolve(args, seed, variant) for seed in range(args.seed, args.seed + (args.seeds or 1))
            for variant in config.variants(args)]
    for cfg in runs[::len(config.variants(args))]:  # the data each seed gets, checked before any task trains
        tasks, _, _, left_out = make_tasks(cfg)
        config.check_tasks(tasks, cfg)
        if left_out:  # the class order decides which; the run's JSON records them
            print(f"note: seed {cfg.seed} leaves out class(es) {left_out}: they fill no whole task of "
                  f"{cfg.classes_per_task} classes", flush=True)
    results, failed, loaded = {}, [], None
    for cfg in runs:
        if loaded is None or loaded[0] != cfg.seed:
            loaded = (cfg.seed, *make_tasks(cfg))
        _, tasks, class_order, mean_image, left_out = loaded
        name = config.variant_name(cfg.method, cfg.variant)
        path = config.result_path(args.out, cfg)
        log(f"{config.describe(cfg)} | class order {class_order}")
        image_path = path if args.save_images else None  # the images are named like the JSON
        judge = lambda old, x_rec: judging.report_reconstruction(name, old, x_rec, cfg, mean_image, image_path, log)
        record = run_continual(cfg, tasks, log, judge, mean_image)
        record.update(dataset=config.dataset_name(cfg.dataset), class_order=class_order, classes_left_out=left_out,
                      config=dataclasses.asdict(cfg), digest=config.digest(cfg), provenance=config.provenance())
        config.write_json_atomically(path, record)
        if record["diverged"]:
            failed.append(f"{name} {cfg.scenario} seed {cfg.seed} diverged: {record['diverged']} "
                          f"(lr {cfg.lr:g}); marked so in {path}, never averaged")
            continue
        bwt = "n/a" if record["BWT"] is None else f"{record['BWT']:.2f}"
        flagged = record["failed_reconstructions"]
        print(f"{name} {cfg.scenario} seed {cfg.seed}: ACC {record['ACC']:.2f} BWT {bwt} in {record['seconds']:.0f}s"
              + (f", {flagged} of {len(record['reconstructions'])} reconstructions FLAGGED (see the log)"
                 if flagged else "") + f" -> {path}", flush=True)
        results.setdefault(name, []).append(record["ACC"])
    for name, accs in results.items():
        if len(accs) > 1:
            log(f"{name}: mean ACC {sum(accs) / len(accs):.2f} over {len(accs)} seeds "
                f"(tables: python experiments.py aggregate {args.out})")
    if failed:
        raise RunFailed("; ".join(failed))


if __name__ == "__main__":
    config.run_from_command_line(main, "recl.py")
