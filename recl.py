"""ReCL: Reconstruction for Continual Learning, from "Slowing Down Forgetting in Continual
Learning" (Janetzky, Schlagenhauf, Feuerriegel); equation numbers are the paper's.

A network trained by gradient descent drifts towards a margin-maximisation point, where its
weights are a non-negative combination of the gradients of its margins at the training points:
theta = sum_i lambda_i grad_theta Phi(theta; x_i), lambda_i >= 0 (App. B). ReCL reads this
backwards: before each new task it optimises random candidates x_i and their lambda_i until the
equation holds for the current weights (Step 1, Sec. 4.1), then trains on those reconstructions
with the new task's data (Step 2, Sec. 4.2).

Read top to bottom:
  1. The paper: Eq. 3-6, Step 1's loop (`reconstruct`), Step 2's loop (`train_task`), the
     metrics (Eq. 1-2). Each loop takes values, as PyTorch code does.
  2. A run: `step1` and `step2` build those values from a `config.Config` (its values are
     in the header a run prints), and `run_continual` is the task loop. Each departure
     from the paper is one `if cfg.<field>:` line where it acts: in step1, in step2, or
     (3, the filter) in run_continual.
  3. The departures, one function each, numbered as in docs/departures.md.
  4. `main`: the command line, from flags to one JSON file per run.
Part 1's functions also run alone: `python tools/see_eq3_work.py` trains an MLP long on a few digits, the regime the
theory is about, and shows Eq. 3 giving the training images back (docs/see-eq3-work.md).

`--paper` (`config.PAPER`) switches every departure off: Eq. 3 fits theta (1), every
class restarts from noise (2), no filter (3), no replay noise (4), no inversion term (5), SGD
(6), cross-entropy over all classes (8), the reconstructions join the task's data (9); 7 and
10-15 were tried and lost, and have no code. It also trains at the method's own budget (lr,
epochs, hyperparameters; with ReCL the defaults have their own, docs/departures.md). Eq. 3-6's
own settings (m, n_rec, sigma_x, the step sizes, lambda_min, alpha) keep their values. It runs the
paper's text plus these choices, on in every run, that its reference code (Buzaglo et al. 2023) makes
or the text leaves open:
  - Eq. 4 and 5 as squared hinges (the paper prints plain ones), weight 5 on Eq. 4, and
    Eq. 3's sum scaled by 1/n (n candidates), as the reference code;
  - SGD with momentum 0.9 for the candidates and lambdas (the paper says SGD);
  - a reconstruction hands back its lowest-loss step, not its last (a step can overshoot);
  - batch-norm statistics re-estimated after each task (only ResNet18 has them);
  - float32 throughout (bfloat16 products in Step 1 only with --rec-precision bfloat16).
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

# ==== 1. The paper ===================================================================================================
#
# Why reading data out of weights can work (App. B). A homogeneous network, Phi(c theta; x) = c^L Phi(theta; x)
# (ReLU layers without biases or skips), trained by gradient descent on cross-entropy, converges in direction to a
# KKT point of the max-margin problem
#
#   min_theta 1/2 |theta|^2   s.t.   Phi_y_i(theta; x_i) - Phi_j(theta; x_i) >= 1   for every i and j != y_i.
#
# Its KKT system has four parts:
#   stationarity             theta = sum_i sum_{j != y_i} lambda_ij grad_theta (Phi_y_i - Phi_j)(theta; x_i)   (Eq. 9)
#   dual feasibility         lambda_ij >= 0                                                                    (Eq. 10)
#   primal feasibility       every margin >= 1
#   complementary slackness  lambda_ij > 0 only where x_i's margin against j is exactly 1 (points on the margin)
# ReCL keeps the first two, as losses over unknown points: the training images are what is sought, the labels are
# fixed, m per old class. It simplifies them: one lambda per point, on the margin against the best other class (Phi
# below), not one per (point, class); primal feasibility and complementary slackness are dropped, so nothing asks a
# candidate to sit on the margin.
#
# Phi(theta; x) for a multi-class network is thus the margin of x's label y: its logit minus the largest other
# logit. Eq. 3 turns stationarity into a loss over n candidates x_1..x_n with coefficients lambda_1..lambda_n
# (n = m candidates per old class, `--m`, times the old classes):
#
#   L_rec    = || theta - (1/n) sum_i lambda_i grad_theta Phi(theta; x_i) ||^2   (Eq. 3)
#   L_lambda = 5 sum_i relu(lambda_min - lambda_i)^2                             (Eq. 4)
#   L_prior  = sum_{i,k} relu(|x_ik| - 1)^2                                      (Eq. 5)
#   L_full   = L_rec + L_lambda + L_prior                                        (Eq. 6)
#
# Like the reference code, Eq. 4 and 5 use squared hinges (smooth; the paper prints
# plain ones); the sum is scaled by 1/n so that lambda_min means the same for any n;
# the norm runs over every parameter. `scale` multiplies L_rec: 1 here; departure 1
# divides by |theta - theta_0|^2, so that L_rec is the share left, whatever the network.
#
# Why lambda_min, not just lambda >= 0: lambda_i = 0 is feasible and takes x_i out of the sum, so the optimiser
# could explain theta with a few candidates and leave the rest as noise. Eq. 4 pushes every lambda_i above
# lambda_min: every candidate has to carry some of theta.
#
# Three facts of the implementation the loss relies on:
#   - A double backward. L_rec contains grad_theta Phi(theta; x_i), and Step 1 needs its gradient in x_i and
#     lambda_i: a derivative of a derivative. torch.func.grad builds the inner gradient as a graph that autograd can
#     differentiate again; loss.backward() in `reconstruct` then goes through it.
#   - The smooth ReLU (models.with_smooth_relu). ReLU's derivative is a step in z: the activation pattern, which
#     decides grad_theta Phi, moves with x, but the step's derivative is zero, so that dependence is invisible to
#     the outer gradient. The copy Step 1 uses keeps ReLU's forward (the margins are the network's own) and uses
#     sigmoid(alpha z) as its derivative in the backward: a surrogate gradient, sharper as alpha grows.
#   - One pass for the whole sum. sum_i lambda_i grad Phi(x_i) = grad sum_i lambda_i Phi(x_i), since a gradient is
#     linear, provided each Phi(x_i) depends on its own x_i only. That holds in eval mode (batch norm uses its running
#     statistics, no dropout); in train mode batch norm mixes the candidates of a batch and the identity fails.
#     `step1` puts its copy in eval mode; a test checks the one-pass form against vmap's per-candidate gradients.

def margins(model, params, x, y):
    """Phi_y(x) - max_{j != y} Phi_j(x) for a batch, with the network's weights as `params`."""
    logits = functional_call(model, params, (x,))
    own = logits.gather(1, y[:, None]).squeeze(1)
    best_other = logits.scatter(1, y[:, None], float("-inf")).amax(1)
    return own - best_other


def weighted_gradient_sum_vmap(model, params, x, y, lam):
    """(1/n) sum_i lambda_i grad_theta Phi(theta; x_i) as written, one gradient per candidate:
    the reference the fast form below is tested against."""
    def margin_of_one(p, xi, yi):
        return margins(model, p, xi[None], yi[None])[0]

    per_candidate = vmap(grad(margin_of_one), in_dims=(None, 0, 0))(params, x, y)
    return {k: torch.tensordot(lam, g, dims=1) / len(x) for k, g in per_candidate.items()}


def weighted_gradient_sum(model, params, x, y, lam, n=None):
    """The same sum in one backward pass, as a gradient is linear: grad sum_i lambda_i Phi(x_i),
    differentiable in x and lambda. Divided by n, all candidates, also when `x` is some of them."""
    def weighted_margins(p):
        return (lam * margins(model, p, x, y)).sum() / (n or len(x))

    return grad(weighted_margins)(params)


def image_prior(x):
    """L_prior (Eq. 5): keep every pixel of the candidates inside [-1, 1]."""
    return F.relu(x.abs() - 1).pow(2).sum()


def stationarity_loss(model, params, labels, target, lambda_min, n=None, scale=1.0):
    """L_full (Eq. 6) of candidates x and lambdas, term by term; `target` is theta in Eq. 3."""
    def loss(x, lam):
        combination = weighted_gradient_sum(model, params, x, labels, lam, n)
        return {"rec": scale * sum((target[k] - combination[k]).pow(2).sum() for k in params),  # Eq. 3
                "lambda": 5 * F.relu(lambda_min - lam).pow(2).sum(),                             # Eq. 4
                "prior": image_prior(x)}                                                          # Eq. 5
    return loss


def candidate_labels(n_outputs, m, n_old_tasks, scenario):
    """Fixed labels, m per old class (Sec. 4.2); in DIL tasks share labels, so m per class per task."""
    return torch.arange(n_outputs).repeat_interleave(m * (1 if scenario == "cil" else n_old_tasks))


def random_start(n, input_shape, sigma_x, seed):
    """x_i ~ N(0, sigma_x^2 I) (Sec. 4.1) and lambda_i ~ U(0, 1), the same draw for a seed: before every task
    slot i starts from the same noise (with departure 2 the earlier classes' slots are then overwritten)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *input_shape, generator=gen) * sigma_x, torch.rand(n, generator=gen)


def reconstruct(L_full, x, lam, optimizers, steps, log=print):
    """Step 1 (Sec. 4.1): `steps` steps of the optimisers on L_full(x, lam) (Eq. 6), in place.
    Returns the candidates and lambdas of the lowest loss seen and a report."""
    losses, best = [], None
    for step in range(steps + 1):  # the last pass only scores the last step
        with torch.set_grad_enabled(step < steps):
            terms = L_full(x, lam)
            loss = sum(terms.values())
        losses.append(loss.item())
        if step == 0:
            first_terms = {k: v.detach() for k, v in terms.items()}
        if step and step % max(1, steps // 4) == 0 and step < steps:  # progress at each quarter
            log(f"    step {step}/{steps}: loss {losses[-1]:.4g}")
        if not math.isfinite(losses[-1]):
            break
        if best is None or losses[-1] < best[0]:  # keep the lowest loss seen
            best = (losses[-1], x.detach().clone(), lam.detach().clone(), {k: v.detach() for k, v in terms.items()})
        if step < steps:
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            for opt in optimizers:
                opt.step()
    if best is None:  # not even the start has a finite loss: hand back the start, flagged
        best = (losses[0], x.detach(), lam.detach(), first_terms)
    return best[1], best[2], reconstruction_report(losses, best, first_terms)


def train_task(model, batches, loss_of, optimizer, epochs, hooks, state):
    """Step 2 (Sec. 4.2): SGD on cross-entropy, which the strategy's hooks extend. `batches()`
    draws one epoch of (x, y, replayed) batches; returns the last epoch's mean loss."""
    model.train()
    for epoch in range(epochs):
        total, seen = 0.0, 0
        for xb, yb, replayed in batches():
            logits, loss = loss_of(model, xb, yb, replayed)
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
    return total / max(seen, 1)


def cross_entropy(model, xb, yb, replayed):
    """The paper's loss: every row scored over every class."""
    logits = model(xb)
    return logits, F.cross_entropy(logits, yb)


def acc_and_bwt(R):
    """R[t][i]: test accuracy (percent) on task i after training task t. ACC = mean_i R[T, i]
    (Eq. 1); BWT = mean_{i<T} R[T, i] - R[i, i] (Eq. 2)."""
    T = len(R)
    acc = sum(R[T - 1][i] for i in range(T)) / T
    bwt = sum(R[T - 1][i] - R[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else 0.0
    return acc, bwt


@torch.no_grad()
def accuracy(model, x, y, batch_size=1000):
    model.eval()
    correct = sum((model(xb).argmax(1) == yb).sum().item() for xb, yb in zip(x.split(batch_size), y.split(batch_size)))
    return 100.0 * correct / len(x)


# ==== 2. A run: the values each step takes, and the task loop ========================================================

def step1(model, old_tasks, cfg, last=None, log=print):
    """Step 1 for a run: candidates for every old class, read from `model` after its last task.
    `last`: the previous reconstruction (x, labels, lambdas). Returns x, labels, lambdas, report."""
    device = next(model.parameters()).device
    labels = candidate_labels(model.head.out_features, cfg.m, len(old_tasks), cfg.scenario).to(device)
    # The paper's smooth ReLU (Haim et al. 2022): ReLU's derivative is a step, whose own derivative
    # is zero, so Eq. 3's gradient in x needs a smooth one: sigmoid(alpha z) in the backward only.
    net = models.with_smooth_relu(model, cfg.alpha).eval()  # a copy, for Step 1 only
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, lam = (v.to(device) for v in random_start(len(labels), old_tasks[0].x_train.shape[1:], cfg.sigma_x, cfg.seed))
    fixed = torch.zeros(len(labels), dtype=torch.bool, device=device)
    target, scale = params, 1.0                                            # Eq. 3 fits theta
    if cfg.rec_target == "displacement":                                   # departure 1: theta - theta_0
        target, scale = displacement_target(params, model)
    if cfg.freeze_old and last is not None:                                # departure 2: keep what was read
        fixed = keep_earlier(labels, x, lam, *last)
        target = less_share_of(net, params, target, x[fixed], labels[fixed], lam[fixed], len(labels))
    L_full = stationarity_loss(net, params, labels[~fixed], target, cfg.lambda_min, len(labels), scale)
    if cfg.variant == "inversion":                                         # the control: no Eq. 3
        L_full = inversion_loss(net, params, labels[~fixed])
    if cfg.ce_weight:                                                      # departure 5 (None for the control)
        L_full = plus_inversion_term(L_full, net, params, labels[~fixed], cfg.ce_weight)
    if cfg.rec_precision == "bfloat16":  # products in bfloat16, summed in float32: not a departure in what is computed
        L_full = torch.autocast(device.type, dtype=torch.bfloat16)(L_full)
    free_x, free_lam = x[~fixed].requires_grad_(), lam[~fixed].requires_grad_()  # copies, written back below
    optimizer = lambda v, lr: torch.optim.SGD([v], lr=lr, momentum=0.9)   # the paper's SGD (momentum: ref. code)
    if cfg.rec_optimizer == "adam":                                        # departure 6
        optimizer = adam
    optimizers = [optimizer(free_x, cfg.lr_x)] + ([optimizer(free_lam, cfg.lr_lambda)] if cfg.lr_lambda else [])
    x[~fixed], lam[~fixed], report = reconstruct(L_full, free_x, free_lam, optimizers, cfg.n_rec, log)
    return x, labels, lam, {"candidates": len(x), "optimised": int((~fixed).sum()), "rec_scale": float(scale),
                            **report}


def shuffled_rows(x, batch_size, seed):
    """Each call draws a new order of every row, the task's own and the reconstructions alike."""
    loader = data.loader(torch.arange(len(x), device=x.device), torch.zeros(len(x)), batch_size, seed=seed)
    return lambda: (rows for rows, _ in loader)


def step2(task, x_rec, y_rec, cfg, n_old_classes):
    """Step 2 for a run: the task's images with the reconstructions last, as batches and a loss.
    Returns batches(), the loss, and batches without replay noise (for batch norm's statistics)."""
    x, y, own = torch.cat([task.x_train, x_rec]), torch.cat([task.y_train, y_rec]), len(task.x_train)
    rows = shuffled_rows(x, cfg.batch_size, cfg.seed)                      # the paper: one shuffled set
    if cfg.replay_batch and own < len(x):                                  # departure 9: replay in every batch
        rows = replay_in_every_batch(x, own, cfg.batch_size, cfg.replay_batch, cfg.seed)
    clean = lambda: ((x[r], y[r], r >= own) for r in rows())  # (images, labels, which are replayed)
    batches = clean
    if cfg.replay_noise and own < len(x):                                  # departure 4: fresh noise on replay
        batches = with_noise(clean, (cfg.replay_noise * x[:own].std()).item(), x.device, cfg.seed)
    loss = cross_entropy
    if cfg.ce_scope != "all" and n_old_classes:                            # departure 8 (the method alone too)
        scope = cfg.ce_scope if own < len(x) else "new"  # local needs replayed rows
        loss = lambda model, xb, yb, replayed: scoped_cross_entropy(model, xb, yb, replayed, n_old_classes, scope)
    return batches, loss, clean


def run_continual(cfg, tasks, log=print, judge=None, search=None):
    """Train one model through all tasks, with ReCL unless cfg.variant is "base"; its record.
    `judge(old_tasks, x, y)` reports on a reconstruction (judging.py), which training never sees;
    `search(reconstruct_with, old_tasks, cfg, log)` picks one by Sec. 4.3's search."""
    if cfg.method == "joint":  # the upper bound: no stream of tasks
        return run_jointly(cfg, tasks, log)
    search = search or judging.search_reconstruction
    started = time.time()
    torch.manual_seed(cfg.seed)  # the same init and shuffles for every variant
    tasks = [data.Task(t.classes, *(v.to(cfg.device) for v in t[1:])) for t in tasks]
    per_task, name = len(tasks[0].classes), config.variant_name(cfg.method, cfg.variant, cfg.budget)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], per_task).to(cfg.device)
    hooks, state = strategies.STRATEGIES[cfg.method]["hooks"], strategies.new_state(cfg.method, **cfg.hp)
    R, reconstructions, quality, last, diverged = [[None] * len(tasks) for _ in tasks], [], [], None, None
    memory = []  # the stored controls' kept images and labels, per old task
    for t, task in enumerate(tasks):
        x_rec, y_rec = task.x_train[:0], task.y_train[:0]
        if cfg.variant != "base" and t > 0:  # Step 1: reconstruct old data from the model after task t
            start = time.time()
            if cfg.variant in ("real", "centroids"):  # the stored controls read nothing: they replay what they kept
                x_rec, y_rec = (torch.cat(kept) for kept in zip(*memory))
                lam, report = None, {"candidates": len(x_rec), "failed": None}
            elif cfg.tuning in (None, "naive"):
                x_rec, y_rec, lam, report = step1(model, tasks[:t], cfg, last, log)
            else:  # Sec. 4.3: several reconstructions, the best by a score
                x_rec, y_rec, lam, report = search(lambda c: step1(model, tasks[:t], c, last, log), tasks[:t], cfg, log)
            last = (x_rec, y_rec, lam)  # whole, before the filter: for departure 2
            if cfg.filter:  # departure 3: drop those the model (of the old classes) files under another class
                keep = classified_as_labelled(model, x_rec, y_rec)
                x_rec, y_rec = x_rec[keep], y_rec[keep]
            reconstructions.append(noted(report, t, len(x_rec), start, name, log))
            if judge and len(x_rec):
                quality.append(judge(tasks[:t], x_rec, y_rec))
        if cfg.scenario == "cil":
            models.grow_head(model, per_task * (t + 1))
        batches, loss_of, clean = step2(task, x_rec, y_rec, cfg, per_task * t if cfg.scenario == "cil" else 0)
        try:
            loss = train_task(model, batches, loss_of, torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg.epochs,
                              hooks, state)
        except Diverged as err:  # the record says so and has no ACC or BWT to average
            diverged = f"{err} of task {t + 1}"
            log(f"  [{name}] task {t + 1}: diverged, {err}")
            break
        # Batch norm (ResNet18) evaluates with running statistics that a task's few dozen steps barely move
        # from their start: re-estimate them with the final weights, on the rows it trained on (no-op without it).
        torch.optim.swa_utils.update_bn(((xb,) for xb, _, _ in clean()), model)
        model.eval()  # strategies look at the trained model (fixed batch-norm statistics, no dropout)
        if "after_task" in hooks:
            hooks["after_task"](model, data.loader(task.x_train, task.y_train, cfg.batch_size, shuffle=False), state)
        if cfg.variant in ("real", "centroids") and t < len(tasks) - 1:
            memory.append(stored_images(task, cfg.m, cfg.variant == "centroids", cfg.seed + t))
        R[t][:t + 1] = [accuracy(model, old.x_test, old.y_test) for old in tasks[:t + 1]]
        log(f"  [{name}] task {t + 1}/{len(tasks)} classes {task.classes}: loss {loss:.3f}, "
            f"acc {' '.join(f'{a:.1f}' for a in R[t][:t + 1])}")
    acc, bwt = acc_and_bwt(R) if diverged is None else (None, None)
    record = record_of(cfg, R, acc, bwt, diverged, reconstructions, quality, started)
    held = 0 if last is None else len(last[0].unique(dim=0)) if cfg.variant == "centroids" else len(last[0])
    return {**record, "stored_images": held}  # what the arm holds before the last task: a centroid counts once


def run_jointly(cfg, tasks, log=print):
    """The upper bound (`--method joint`): one model on every task's images at once; no BWT."""
    started = time.time()
    torch.manual_seed(cfg.seed)
    tasks = [data.Task(t.classes, *(v.to(cfg.device) for v in t[1:])) for t in tasks]
    n_outputs = len(tasks[0].classes) * (len(tasks) if cfg.scenario == "cil" else 1)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], n_outputs).to(cfg.device)
    every = data.Task(None, torch.cat([t.x_train for t in tasks]), torch.cat([t.y_train for t in tasks]), None, None)
    batches, loss_of, clean = step2(every, every.x_train[:0], every.y_train[:0], cfg, 0)
    acc, row, diverged = None, None, None
    try:
        loss = train_task(model, batches, loss_of, torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg.epochs, {}, {})
        torch.optim.swa_utils.update_bn(((xb,) for xb, _, _ in clean()), model)
        row = [accuracy(model, t.x_test, t.y_test) for t in tasks]
        acc = sum(row) / len(row)
        log(f"  [joint] all {len(tasks)} tasks at once: loss {loss:.3f}, acc {' '.join(f'{a:.1f}' for a in row)}")
    except Diverged as err:
        diverged = str(err)
        log(f"  [joint] diverged, {err}")
    return record_of(cfg, [row], acc, None, diverged, [], [], started)


# ==== 3. The departures from the paper, and the inversion control ====================================================
# Each: what the paper does, what we do, why. docs/departures.md has the numbers under the
# same number (the gaps are levers that lost). `--paper` switches every one off.

# Departure 1, displacement target (`--rec-target displacement`).
# Paper: Eq. 3 fits theta. Here: theta - theta_0, what training added, relative to its size.
# Why: Eq. 3 holds after long training; after minutes the random start theta_0 still
# dominates theta, and no candidate explains it.
def displacement_target(params, model):
    start = models.start_weights(model)
    if start is None:
        raise ValueError("the displacement target needs the model's initial weights: "
                         "build it with models.build_model or call models.remember_start first")
    displacement = {k: params[k] - start[k] for k in params}
    return displacement, 1.0 / sum(v.pow(2).sum() for v in displacement.values()).clamp_min(1e-30)


# Departure 2, freeze old (`--freeze-old`).
# Paper: every candidate starts from noise before every task. Here: the slots of a class
# reconstructed before keep those candidates and lambdas, fixed; the other slots start from noise.
# Why: reading a class again from a model trained on its reconstructions compounds errors.
def keep_earlier(labels, x, lam, earlier_x, earlier_labels, earlier_lam):
    """Fill the first slots of each class read before with its earlier candidates; which are fixed."""
    fixed = torch.zeros(len(labels), dtype=torch.bool, device=labels.device)
    for c in earlier_labels.unique():
        slots, earlier = (labels == c).nonzero().squeeze(1), (earlier_labels == c).nonzero().squeeze(1)
        n = min(len(slots), len(earlier))
        x[slots[:n]], lam[slots[:n]], fixed[slots[:n]] = earlier_x[earlier[:n]], earlier_lam[earlier[:n]], True
    return fixed


def less_share_of(net, params, target, x, labels, lam, n):
    """Fixed candidates add a constant to Eq. 3's sum: take it off the target once."""
    share = weighted_gradient_sum(net, params, x, labels, lam, n)
    return {k: target[k] - share[k] for k in target}


# Departure 3, filter (`--filter`).
# Paper: every reconstruction is replayed. Here: those the model files under another class
# are dropped. Why: they would teach the wrong boundary (App. D.5 suggests filtering).
@torch.no_grad()
def classified_as_labelled(model, x, y):
    return model.eval()(x).argmax(1) == y


# Departure 4, replay noise (`--replay-noise`).
# Paper: reconstructions are replayed as they are. Here: each time one enters a batch it gets
# fresh noise N(0, s^2), s = replay_noise times the task's pixel std.
# Why: the network then files a neighbourhood under the old class, not a prototype.
def with_noise(batches, std, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    if std <= 0:
        return batches
    return lambda: ((xb + replayed.view(-1, *[1] * (xb.dim() - 1)) * std * torch.randn(xb.shape, generator=gen,
                                                                                         device=device), yb, replayed)
                    for xb, yb, replayed in batches())


# Departure 5, inversion term (`--ce-weight`).
# Paper: Eq. 6 alone. Here: plus ce_weight times the candidates' summed cross-entropy.
# Why: in CIL, Eq. 3 alone loses to model inversion; a little of it draws level.
def plus_inversion_term(L_full, net, params, labels, weight):
    return lambda x, lam: {**L_full(x, lam), "ce": weight * F.cross_entropy(functional_call(net, params, (x,)),
                                                                            labels, reduction="sum")}


# Departure 6, Adam (`--rec-optimizer adam`).
# Paper: SGD (part 1: with momentum). Here: Adam with DeepInversion's betas.
# Why: on deep nets SGD's step follows a gradient whose size spans orders of magnitude.
def adam(tensor, lr):
    return torch.optim.Adam([tensor], lr=lr, betas=(0.5, 0.9))


# Departure 8, local cross-entropy (`--ce-scope new` or `local`, CIL).
# Paper: every row is scored over every class. Here, "new": the task's own rows over its new
# classes only; "local": the replayed rows over the old classes only too, and old against new
# learned by the head alone on features it cannot change (Always Be Dreaming's split).
# Why: the task's images then never push the old classes' logits down.
def scoped_cross_entropy(model, xb, yb, replayed, n_old_classes, scope):
    seen = []  # with "local": what the head takes in, the features
    hook = model.head.register_forward_hook(lambda layer, inputs, out: seen.append(inputs[0]))
    try:
        logits = model(xb)
    finally:
        hook.remove()
    old, own = (torch.arange(logits.shape[1], device=logits.device) < n_old_classes)[None], ~replayed[:, None]
    if scope == "new":
        return logits, F.cross_entropy(logits.masked_fill(own & old, float("-inf")), yb)
    grouped = logits.masked_fill(torch.where(own, old, ~old), float("-inf"))
    return logits, F.cross_entropy(grouped, yb) + F.cross_entropy(model.head(seen[0].detach()), yb)


# Departure 9, replay batch (`--replay-batch N`).
# Paper: the reconstructions join the task's data. Here: an epoch passes over the task's own
# images and each batch gets N reconstructions drawn at random.
# Why: the share of replay in a batch and an epoch's cost then stay fixed from task to task.
def replay_in_every_batch(x, own, batch_size, n, seed):
    gen = torch.Generator(device=x.device).manual_seed(seed + 1)
    loader = data.loader(torch.arange(own, device=x.device), torch.zeros(own), batch_size, seed=seed)
    return lambda: (torch.cat([rows, own + torch.randint(len(x) - own, (n,), generator=gen, device=x.device)])
                    for rows, _ in loader)


# The inversion control (`--replay-source inversion`, the +inversion variant): is it Eq. 3
# that makes the candidates useful, or would any optimisation that makes the model recognise
# them as their labels do? Model inversion (Simonyan et al. 2014) asks only the second:
# L_inv = sum_i CE(f(x_i), y_i) + L_prior, over the same candidates, labels, optimiser, steps,
# filter and replay; no lambdas, no stationarity condition.
def inversion_loss(net, params, labels):
    return lambda x, lam: {"ce": F.cross_entropy(functional_call(net, params, (x,)), labels, reduction="sum"),
                           "prior": image_prior(x)}


# The stored controls (`--replay-source real` or `centroids`): where is the ceiling of any replay
# in this pipeline, and what would a memory of class statistics give? `real` keeps m of each
# class's own training images (a buffer as large as the reconstruction), `centroids` each class's
# mean image in the same m slots, which fresh replay noise (departure 4) spreads. Both are kept
# once their task is learned and go through the same filter, replay and training as +ReCL.
def stored_images(task, m, centroids, seed):
    gen, xs, ys = torch.Generator().manual_seed(seed), [], []
    for c in task.y_train.unique():
        rows = task.x_train[task.y_train == c]
        pick = torch.randperm(len(rows), generator=gen)[:m].to(rows.device)
        xs.append(rows.mean(0, keepdim=True).expand(len(pick), *rows.shape[1:]) if centroids else rows[pick])
        ys.append(torch.full((len(pick),), int(c), dtype=task.y_train.dtype, device=rows.device))
    return torch.cat(xs), torch.cat(ys)


# ==== 4. Records, and the command line ===============================================================================

class Diverged(Exception):  # a non-finite training loss: the run's numbers would be meaningless
    pass


def reconstruction_report(losses, best, first_terms):
    """The loss at the start, of the kept candidates and of the last step; and why the
    reconstruction failed, if it did: it diverged, or no step lowered the loss."""
    first, last = losses[0], losses[-1]
    failed = (f"diverged at step {len(losses) - 1}" if not math.isfinite(last)
              else f"diverged: the last step's loss {last:.4g} is above the start's {first:.4g}" if last > first
              else "no step lowered the loss" if best[0] >= first else None)
    return {"steps": len(losses) - 1, "first_loss": first, "kept_loss": best[0], "last_step_loss": last,
            "first_terms": {k: v.item() for k, v in first_terms.items()},
            "kept_terms": {k: v.item() for k, v in best[3].items()}, "failed": failed}


def noted(report, t, kept, started, name, log):
    """Log what the reconstruction before task t + 1 did; its entry in the run's record."""
    if "first_loss" not in report:  # a stored control: nothing was optimised
        log(f"  [{name}] task {t + 1}: replays {kept}/{report['candidates']} stored images")
        return {"task": t + 1, **report, "kept": kept, "seconds": round(time.time() - started, 2)}
    left = (f", Eq. 3 leaves {report['kept_terms']['rec']:.0%} of |theta - theta_0|^2 unexplained"  # departure 1
            if report["rec_scale"] != 1.0 and "rec" in report["kept_terms"] else "")
    log(f"  [{name}] task {t + 1}: reconstructed {kept}/{report['candidates']}, "
        f"loss {report['first_loss']:.4g} -> {report['kept_loss']:.4g}{left}"
        + (f", FLAGGED: {report['failed']} (kept its lowest-loss candidates)" if report["failed"] else ""))
    return {"task": t + 1, **report, "kept": kept, "seconds": round(time.time() - started, 2)}


def record_of(cfg, R, acc, bwt, diverged, reconstructions, quality, started):
    """A run's record: its accuracy matrix, ACC, BWT and what each reconstruction did."""
    return {"method": cfg.method, "variant": cfg.variant, "recl": cfg.variant != "base", "scenario": cfg.scenario,
            "seed": cfg.seed, "acc_matrix": R, "ACC": acc, "BWT": bwt, "diverged": diverged,
            "reconstructions": reconstructions, "recon_quality": quality,
            "failed_reconstructions": sum(bool(r["failed"]) for r in reconstructions),
            "seconds": round(time.time() - started, 2),
            "phase_seconds": {"reconstruct": round(sum(r["seconds"] for r in reconstructions), 2)}}


def main(argv=None):
    """Flags, checked -> a Config per seed and variant, all checked -> run_continual -> a JSON each."""
    args = config.make_parser().parse_args(argv)
    config.provenance()  # the code this process loaded, named now
    config.check(args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    # per seed, the method alone and its replay variant (+ReCL, or the arm --replay-source names); --variant picks one
    runs = [config.resolve(args, seed, variant) for seed in range(args.seed, args.seed + (args.seeds or 1))
            for variant in config.variants(args)]
    loaded = None
    for cfg in runs:  # every run checked before any task trains
        if loaded is None or loaded[0] != cfg.seed:
            loaded = (cfg.seed, *config.make_tasks(cfg))
            if loaded[4]:
                print(f"note: seed {cfg.seed} leaves out class(es) {loaded[4]}: they fill no whole task", flush=True)
        config.check_tasks(loaded[1], cfg)
    failed = []
    for cfg in runs:
        name, path = config.variant_name(cfg.method, cfg.variant, cfg.budget), config.result_path(args.out, cfg)
        if args.skip_done and path.exists():
            print(f"{name} {cfg.scenario} seed {cfg.seed}: done before, skipped -> {path}", flush=True)
            continue
        if loaded is None or loaded[0] != cfg.seed:
            loaded = (cfg.seed, *config.make_tasks(cfg))
        _, tasks, class_order, mean_image, left_out = loaded
        log(f"{config.describe(cfg)} | class order {class_order}")
        images = path if args.save_images else None  # the images are named like the JSON
        judge = lambda old, x, y: judging.report_reconstruction(name, old, x, cfg, mean_image, images, log, y)
        search = lambda with_cfg, old, c, log: judging.search_reconstruction(with_cfg, old, c, log, mean_image)
        record = run_continual(cfg, tasks, log, judge, search)
        record.update(dataset=config.dataset_name(cfg.dataset), class_order=class_order, classes_left_out=left_out,
                      config=dataclasses.asdict(cfg), digest=config.digest(cfg), provenance=config.provenance(),
                      **({"dataset_sha256": config.file_sha256(cfg.dataset)} if cfg.dataset.endswith(".pt") else {}))
        config.write_json_atomically(path, record)
        if record["diverged"]:
            failed.append(f"{name} {cfg.scenario} seed {cfg.seed} diverged: {record['diverged']} (lr {cfg.lr:g}); "
                          f"marked so in {path}, never averaged")
            continue
        bwt, flagged = "n/a" if record["BWT"] is None else f"{record['BWT']:.2f}", record["failed_reconstructions"]
        print(f"{name} {cfg.scenario} seed {cfg.seed}: ACC {record['ACC']:.2f} BWT {bwt} in {record['seconds']:.0f}s"
              + (f", {flagged} of {len(record['reconstructions'])} reconstructions FLAGGED (see the "
                 f"{'JSON' if args.quiet else 'log'})" if flagged else "") + f" -> {path}", flush=True)
    if failed:
        raise config.RunFailed("; ".join(failed))


if __name__ == "__main__":
    config.run_from_command_line(main, "recl.py")
