"""ReCL: Reconstruction for Continual Learning, from "Slowing Down Forgetting in Continual
Learning" (Janetzky, Schlagenhauf, Feuerriegel); equation numbers are the paper's.

A network trained by gradient descent drifts towards a margin-maximisation point, where
its weights are a non-negative combination of the gradients of its margins at the
training points: theta = sum_i lambda_i grad_theta Phi(theta; x_i), lambda_i >= 0 (App. B).
ReCL reads this backwards: before each new task it optimises random candidates x_i and
their lambda_i until the equation holds for the current weights (Step 1, Sec. 4.1), then
trains on those reconstructions with the new task's data (Step 2, Sec. 4.2).

Part 1 is the paper, whole, and `--paper` runs exactly it; its functions take named
extension points (`Extensions`), each the paper's own step by default. Part 2 is our
departures, each one function on one point, and the controls; part 3 helpers and records.
The search of Sec. 4.3 is in judging.py, the command line in cli.py, every default of a
run in config.py.
"""
import dataclasses
import functools
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import config
import data
import judging
import models
import strategies

# =============================================================================
# 1. The paper: ReCL as written
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
# In every run, like the reference code (Buzaglo et al. 2023), Eq. 4 and 5 use squared
# hinges (smooth; the paper prints plain ones), weight 5 on Eq. 4; the sum is scaled by
# 1/m so that lambda_min means the same for any m; the norm runs over every parameter.

def margins(model, params, x, y):
    """Phi_y(x) - max_{j != y} Phi_j(x) for a batch, with the network's weights as `params`."""
    logits = functional_call(model, params, (x,))
    own = logits.gather(1, y[:, None]).squeeze(1)
    best_other = logits.scatter(1, y[:, None], float("-inf")).amax(1)
    return own - best_other


def weighted_gradient_sum_vmap(model, params, x, y, lam):
    """(1/m) sum_i lambda_i grad_theta Phi(theta; x_i) as written, one gradient per candidate:
    the reference the fast form below is tested against."""
    def margin_of_one(p, xi, yi):
        return margins(model, p, xi[None], yi[None])[0]

    per_candidate = vmap(grad(margin_of_one), in_dims=(None, 0, 0))(params, x, y)
    return {k: torch.tensordot(lam, g, dims=1) / len(x) for k, g in per_candidate.items()}


def weighted_gradient_sum(model, params, x, y, lam, m=None):
    """The same sum in one backward pass, as a gradient is linear: grad sum_i lambda_i Phi(x_i),
    differentiable in x and lambda. Divided by m, all candidates, also when `x` is some of them."""
    def weighted_margins(p):
        return (lam * margins(model, p, x, y)).sum() / (m or len(x))

    return grad(weighted_margins)(params)


def image_prior(x):
    """L_prior (Eq. 5): keep every pixel of the candidates inside [-1, 1]."""
    return F.relu(x.abs() - 1).pow(2).sum()


def stationarity_loss(model, params, labels, target, lambda_min, m=None, scale=1.0):
    """L_full (Eq. 6) of candidates x and lambdas, term by term; `target` is theta in Eq. 3."""
    def loss(x, lam):
        combination = weighted_gradient_sum(model, params, x, labels, lam, m)
        return {"rec": scale * sum((target[k] - combination[k]).pow(2).sum() for k in params),  # Eq. 3
                "lambda": 5 * F.relu(lambda_min - lam).pow(2).sum(),                             # Eq. 4
                "prior": image_prior(x)}                                                          # Eq. 5
    return loss


def candidate_labels(n_outputs, m_per_class, n_old_tasks, scenario):
    """Fixed labels, m per old class (Sec. 4.2); in DIL tasks share labels, so m per class per task."""
    per_class = m_per_class * (1 if scenario == "cil" else n_old_tasks)
    return torch.arange(n_outputs).repeat_interleave(per_class)


# The extension points. Each default is the paper's own step; part 2's departures replace some.

def random_start(labels, input_shape, cfg, last=None):
    """x_i ~ N(0, sigma_x^2 I) (Sec. 4.1) and lambda_i ~ U(0, 1), reproducibly, none held fixed
    (`last`, the previous reconstruction, is for a start that builds on it)."""
    gen, m, device = torch.Generator().manual_seed(cfg.seed), len(labels), labels.device
    x, lam = torch.randn(m, *input_shape, generator=gen) * cfg.sigma_x, torch.rand(m, generator=gen)
    return x.to(device), lam.to(device), torch.zeros(m, dtype=torch.bool, device=device)


def shuffled_batches(x, y, own, cfg):
    """Each epoch shuffles every row, the task's own (the first `own`) and the reconstructions alike."""
    loader = data.loader(torch.arange(len(x), device=x.device), y, cfg.batch_size, seed=cfg.seed)
    return lambda: (rows for rows, _ in loader)


def cross_entropy_over_all(model, xb, yb, own_rows, n_old_classes, cfg, replaying):
    """The batch's logits, and its cross-entropy over every class (the other arguments are for departure 8)."""
    logits = model(xb)
    return logits, F.cross_entropy(logits, yb)


@dataclasses.dataclass(frozen=True)
class Extensions:
    """Where part 2 plugs in; each default is what the paper does, and shows the point's signature."""
    # Step 1
    start: Callable = random_start                                   # where the candidates start
    target: Callable = lambda params, model: (params, 1.0)           # what Eq. 3 fits: theta, at scale 1
    loss: Callable = stationarity_loss                               # L_full (the inversion control swaps it)
    extra_terms: Callable = lambda net, params, labels, cfg: lambda x: {}  # terms added to Eq. 6: none
    optimizer: Callable = lambda v, lr: torch.optim.SGD([v], lr=lr, momentum=0.9)  # SGD (momentum: reference code)
    keep_step: Callable = lambda losses, best, tensors, optimizers, memo: True    # every step is kept
    # Step 2
    select: Callable = lambda model, x, y: torch.ones(len(x), dtype=torch.bool, device=x.device)  # replay all
    batches: Callable = shuffled_batches                             # how a batch is drawn
    replayed: Callable = lambda x, own, cfg: lambda xb, rows: xb     # replayed rows: as they are
    cross_entropy: Callable = cross_entropy_over_all                 # which classes it compares: all


def full_loss(model, net, params, labels, x0, lam0, fixed, cfg, ext=Extensions()):
    """L_full (Eq. 6) of the candidates not held `fixed`, in the run's number format; and L_rec's scale."""
    target, scale = ext.target(params, model)
    if fixed.any():  # candidates held fixed add a constant to Eq. 3's sum: take it off the target once
        share = weighted_gradient_sum(net, params, x0[fixed], labels[fixed], lam0[fixed], len(labels))
        target = {k: target[k] - share[k] for k in target}
    eq6 = ext.loss(net, params, labels[~fixed], target, cfg.lambda_min, len(labels), scale)
    extra = ext.extra_terms(net, params, labels[~fixed], cfg)

    def L_full(x, lam):
        with torch.autocast(labels.device.type, dtype=torch.bfloat16, enabled=cfg.rec_precision == "bfloat16"):
            return {**eq6(x, lam), **extra(x)}
    return L_full, scale


def reconstruct(model, labels, input_shape, cfg, log=print, ext=Extensions(), last=None):
    """Step 1 (Sec. 4.1): look-alikes of old training data from `model` alone. Random candidates
    and lambdas, two SGD optimisers with momentum, n_rec steps on L_full; returns the candidates
    and lambdas with the lowest loss seen (the last step's included) and a report."""
    net = models.with_smooth_relu(model, cfg.alpha).eval()  # smooth backward, exact forward (Haim et al.)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x0, lam0, fixed = ext.start(labels, input_shape, cfg, last)
    L_full, scale = full_loss(model, net, params, labels, x0, lam0, fixed, cfg, ext)
    x, lam = x0[~fixed].requires_grad_(), lam0[~fixed].requires_grad_()
    optimizers = ext.optimizer(x, cfg.lr_x), ext.optimizer(lam, cfg.lr_lambda or 0.0)  # the control: no lambdas
    losses, best, memo = [], None, {}
    for step in range(cfg.n_rec + 1):  # the last pass only scores the last step's candidates
        with torch.set_grad_enabled(step < cfg.n_rec):
            terms = L_full(x, lam)
            loss = sum(terms.values())
        losses.append(loss.item())
        first_terms = detached(terms) if step == 0 else first_terms
        # a step is judged (and may be undone) before it is logged, kept as the best, or taken
        kept = ext.keep_step(losses, best, (x, lam), optimizers, memo)
        if step and step % max(1, cfg.n_rec // 4) == 0 and step < cfg.n_rec:  # progress at each quarter
            log(f"    step {step}/{cfg.n_rec}: loss {losses[-1]:.4g}")
        if not kept:
            continue
        if not math.isfinite(losses[-1]):
            break
        if best is None or losses[-1] < best[0]:  # a step can overshoot: keep the best seen (the paper: the last)
            best = (losses[-1], x.detach().clone(), lam.detach().clone(), detached(terms))
        if step < cfg.n_rec:
            descend(loss, optimizers)
    if best is None:  # not even the start has a finite loss: hand back the start, flagged
        best = (losses[0], x.detach(), lam.detach(), detached(terms))
    x0[~fixed], lam0[~fixed] = best[1], best[2]
    report = reconstruction_report(losses, best, first_terms, memo.get("backtracks", 0))
    return x0, lam0, {"candidates": len(x0), "optimised": int((~fixed).sum()), "rec_scale": float(scale), **report}


def reconstruct_old_data(model, old_tasks, cfg, log=print, ext=Extensions(), last=None):
    """Step 1 for a run: labels over the old classes, then `reconstruct`: x, labels, lambdas, report."""
    device = next(model.parameters()).device
    labels = candidate_labels(model.head.out_features, cfg.m, len(old_tasks), cfg.scenario).to(device)
    x, lam, report = reconstruct(model, labels, old_tasks[0].x_train.shape[1:], cfg, log, ext, last)
    return x, labels, lam, report


# Metrics (Sec. 3). R[t][i] is the test accuracy (percent) on task i after training on task t.

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


def train_task(model, x, y, hooks, state, cfg, n_replayed=0, n_old_classes=0, ext=Extensions()):
    """Step 2 (Sec. 4.2): SGD on cross-entropy, which the strategy's hooks extend; the last
    `n_replayed` rows are the reconstructions. Returns the last epoch's mean loss."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    own = len(x) - n_replayed  # the task's own rows come first
    draw, change = ext.batches(x, y, own, cfg), ext.replayed(x, own, cfg)
    for epoch in range(cfg.epochs):
        total, seen = 0.0, 0
        for rows in draw():
            xb, yb = change(x[rows], rows), y[rows]
            logits, loss = ext.cross_entropy(model, xb, yb, rows < own, n_old_classes, cfg, n_replayed > 0)
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
    # Batch norm (ResNet18) evaluates with running statistics that a task's few dozen steps
    # barely move from their start: re-estimate them with the final weights (docs/running.md).
    torch.optim.swa_utils.update_bn(((x[rows],) for rows in draw()), model)
    return total / max(seen, 1)


def run_continual(cfg, tasks, log=print, judge=None, mean_image=None):
    """Train one model through all tasks, with ReCL unless cfg.variant is "base"; its record.
    `judge(old_tasks, x_rec, y_rec)` reports on each reconstruction (judging.py); training never sees it."""
    if cfg.method == "joint":  # the upper bound has no stream of tasks (part 2)
        return run_jointly(cfg, tasks, log)
    started = time.time()
    torch.manual_seed(cfg.seed)  # the same init and shuffles for every variant
    tasks = [data.Task(t.classes, *(v.to(cfg.device) for v in t[1:])) for t in tasks]
    per_task, name = len(tasks[0].classes), config.variant_name(cfg.method, cfg.variant)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], per_task).to(cfg.device)
    hooks, state = strategies.STRATEGIES[cfg.method]["hooks"], strategies.new_state(cfg.method, **cfg.hp)
    ext = extensions(cfg)  # the paper's steps, with this run's departures on them (part 2)
    step1 = reconstruct_old_data if cfg.tuning in (None, "naive") else functools.partial(  # or Sec. 4.3's search
        judging.search_reconstruction, mean_image=mean_image)
    R, reconstructions, recon_quality, last, diverged = [[None] * len(tasks) for _ in tasks], [], [], None, None
    for t, task in enumerate(tasks):
        x, y = task.x_train, task.y_train
        if cfg.variant != "base" and t > 0:  # Step 1: reconstruct old data from the model after task t-1
            start = time.time()
            x_rec, y_rec, lam_rec, report = step1(model, tasks[:t], cfg, log, ext, last)
            log(f"    reconstruction took {time.time() - start:.1f}s")
            last = (x_rec, y_rec, lam_rec)  # whole: a start may build on it
            keep = ext.select(model, x_rec, y_rec)
            x_rec, y_rec = x_rec[keep], y_rec[keep]
            reconstructions.append(noted(report, t, len(x_rec), start, name, log))
            if judge and len(x_rec):
                recon_quality.append(judge(tasks[:t], x_rec, y_rec))
            x, y = torch.cat([x, x_rec]), torch.cat([y, y_rec])  # Step 2: the reconstructions last
        if cfg.scenario == "cil":
            models.grow_head(model, per_task * (t + 1))
        try:
            loss = train_task(model, x, y, hooks, state, cfg, len(x) - len(task.x_train),
                              per_task * t if cfg.scenario == "cil" else 0, ext)
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
    return record_of(cfg, R, acc, bwt, diverged, reconstructions, recon_quality, started)


# =============================================================================
# 2. Departures from the paper, and the controls
# =============================================================================
# Each departure is one function on one extension point of part 1, switched on
# by one config field; `--paper` switches every one off. Each says what the
# paper does, what we do and why; docs/departures.md has the numbers under the
# same number (the gaps are levers that lost, recorded there).

# Departure 1, displacement target (`--rec-target displacement`), point `target`.
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


def unexplained(report):
    """For the log: with a relative L_rec (departure 1), the kept L_rec is the share of
    theta - theta_0 that Eq. 3's combination of all the candidates leaves unexplained."""
    if report.get("rec_scale", 1.0) == 1.0 or "rec" not in report["kept_terms"]:
        return ""
    return f", Eq. 3 leaves {report['kept_terms']['rec']:.0%} of theta - theta_0 unexplained"


# Departure 2, freeze old (`--freeze-old`), point `start`.
# Paper: every candidate starts from noise before every task. Here: the slots of a class
# reconstructed before keep those candidates and lambdas, fixed; the other slots start from noise.
# Why: reading a class again from a model trained on its reconstructions compounds errors.
def start_from_earlier(labels, input_shape, cfg, last=None):
    x, lam, fixed = random_start(labels, input_shape, cfg)
    if last is None:
        return x, lam, fixed
    earlier_x, earlier_labels, earlier_lam = last
    for c in earlier_labels.unique():  # the earlier ones fill the first slots of their class
        slots = (labels == c).nonzero().squeeze(1)
        earlier = (earlier_labels == c).nonzero().squeeze(1)
        n = min(len(slots), len(earlier))
        x[slots[:n]], lam[slots[:n]], fixed[slots[:n]] = earlier_x[earlier[:n]], earlier_lam[earlier[:n]], True
    return x, lam, fixed


# Departure 3, filter (`--filter`), point `select`.
# Paper: every reconstruction is replayed. Here: those the model files under another class
# are dropped. Why: they would teach the wrong boundary (App. D.5 suggests filtering).
@torch.no_grad()
def classified_as_labelled(model, x, y):
    model.eval()
    return model(x).argmax(1) == y


# Departure 4, replay noise (`--replay-noise`), point `replayed`.
# Paper: reconstructions are replayed as they are. Here: each time one enters a batch it gets
# fresh noise N(0, s^2), s = replay_noise times the task's pixel std.
# Why: the network then files a neighbourhood under the old class, not a prototype.
def noisy_replay(x, own, cfg):
    std = (cfg.replay_noise * x[:own].std()).item() if own < len(x) else 0.0  # a float: no device sync
    gen = torch.Generator(device=x.device).manual_seed(cfg.seed)
    if std <= 0:
        return Extensions().replayed(x, own, cfg)

    def change(xb, rows):
        replayed = (rows >= own).view(-1, *[1] * (x.dim() - 1))
        return xb + replayed * std * torch.randn(xb.shape, generator=gen, device=x.device)
    return change


# Departure 5, inversion term (`--ce-weight`), point `extra_terms`.
# Paper: Eq. 6 alone. Here: plus ce_weight times the candidates' summed cross-entropy.
# Why: in CIL, Eq. 3 alone loses to model inversion; a little of it draws level.
def inversion_term(net, params, labels, cfg):
    return lambda x: {"ce": cfg.ce_weight * F.cross_entropy(functional_call(net, params, (x,)), labels,
                                                              reduction="sum")}


# Departure 6, Adam (`--rec-optimizer adam`), point `optimizer`.
# Paper: SGD with momentum. Here: Adam with DeepInversion's betas.
# Why: on deep nets SGD's step follows a gradient whose size spans orders of magnitude.
def adam(tensor, lr):
    return torch.optim.Adam([tensor], lr=lr, betas=(0.5, 0.9))


# Departure 8, local cross-entropy (`--ce-scope new` or `local`, CIL), point `cross_entropy`.
# Paper: every row is scored over every class. Here, "new": the task's own rows over its new
# classes only; "local": the replayed rows over the old classes only too, and old against new
# learned by the head alone on features it cannot change (Always Be Dreaming's split).
# Why: the task's images then never push the old classes' logits down.
def scoped_cross_entropy(model, xb, yb, own_rows, n_old_classes, cfg, replaying):
    scope = cfg.ce_scope if replaying or cfg.ce_scope != "local" else "new"  # local needs replayed rows
    seen, hook = [], None  # with "local": what the head takes in, the features
    if scope == "local":
        hook = model.head.register_forward_hook(lambda layer, inputs, out: seen.append(inputs[0]))
    try:
        logits = model(xb)
    finally:
        if hook:
            hook.remove()
    if not n_old_classes:
        return logits, F.cross_entropy(logits, yb)
    old, own = (torch.arange(logits.shape[1], device=logits.device) < n_old_classes)[None], own_rows[:, None]
    if scope == "new":
        return logits, F.cross_entropy(logits.masked_fill(own & old, float("-inf")), yb)
    grouped = logits.masked_fill(torch.where(own, old, ~old), float("-inf"))
    return logits, F.cross_entropy(grouped, yb) + F.cross_entropy(model.head(seen[0].detach()), yb)


# Departure 9, replay batch (`--replay-batch N`), point `batches`.
# Paper: the reconstructions join the task's data. Here: an epoch passes over the task's own
# images and each batch gets N reconstructions drawn at random.
# Why: the share of replay in a batch and an epoch's cost then stay fixed from task to task.
def replay_batch(x, y, own, cfg):
    if own == len(x):
        return shuffled_batches(x, y, own, cfg)
    gen = torch.Generator(device=x.device).manual_seed(cfg.seed + 1)
    loader = data.loader(torch.arange(own, device=x.device), y[:own], cfg.batch_size, seed=cfg.seed)
    return lambda: (torch.cat([rows, own + torch.randint(len(x) - own, (cfg.replay_batch,), generator=gen,
                                                         device=x.device)]) for rows, _ in loader)


# Departure 11, backtracking (`--backtrack`), point `keep_step`.
# Paper: every step is kept. Here: a step that raised L_full is undone, momentum and all, and
# the step sizes halve; the pass after an undo only rescores the restored state, unjudged.
# Why: a step size that overshoots then costs steps, not the reconstruction.
def backtrack(losses, best, tensors, optimizers, memo):
    if best is None or memo.pop("undone", False) or losses[-1] <= best[0]:
        return True
    with torch.no_grad():
        for tensor, kept in zip(tensors, best[1:3]):
            tensor.copy_(kept)
    for opt in optimizers:
        opt.state.clear()
        opt.param_groups[0]["lr"] /= 2
    losses[-1], memo["undone"], memo["backtracks"] = best[0], True, memo.get("backtracks", 0) + 1
    return False


DEPARTURES = {  # name: (the docs' number, extension point, function, whether a run has it on)
    "displacement target": (1, "target", displacement_target, lambda cfg: cfg.rec_target == "displacement"),
    "freeze old": (2, "start", start_from_earlier, lambda cfg: bool(cfg.freeze_old)),
    "filter": (3, "select", classified_as_labelled, lambda cfg: bool(cfg.filter)),
    "replay noise": (4, "replayed", noisy_replay, lambda cfg: bool(cfg.replay_noise)),
    "inversion term": (5, "extra_terms", inversion_term, lambda cfg: bool(cfg.ce_weight)),
    "adam": (6, "optimizer", adam, lambda cfg: cfg.rec_optimizer == "adam"),
    "local cross-entropy": (8, "cross_entropy", scoped_cross_entropy, lambda cfg: cfg.ce_scope != "all"),
    "replay batch": (9, "batches", replay_batch, lambda cfg: bool(cfg.replay_batch)),
    "backtracking": (11, "keep_step", backtrack, lambda cfg: bool(cfg.backtrack)),
}


# The inversion control (`--rec-objective inversion`, the +inversion variant), point `loss`:
# is it Eq. 3 that makes the candidates useful, or would any optimisation that makes the
# model recognise them as their labels do? Model inversion (Simonyan et al. 2014) asks only
# the second: L_inv = sum_i CE(f(x_i), y_i) + L_prior over the same candidates, labels,
# optimiser, steps, filter and replay; no lambdas, no stationarity condition.
def inversion_loss(net, params, labels, *unused):
    return lambda x, lam: {"ce": F.cross_entropy(functional_call(net, params, (x,)), labels, reduction="sum"),
                           "prior": image_prior(x)}


def extensions(cfg):
    """The paper's steps with the departures this run has on, and the control's loss."""
    on = {point: function for _, point, function, has in DEPARTURES.values() if has(cfg)}
    return Extensions(**on, **({"loss": inversion_loss} if cfg.variant == "inversion" else {}))


def run_jointly(cfg, tasks, log=print):
    """The upper bound (`--method joint`): one model trained on every task's training images
    at once. Its record has one row of test accuracies; BWT and ReCL do not apply."""
    started = time.time()
    torch.manual_seed(cfg.seed)
    tasks = [data.Task(t.classes, *(v.to(cfg.device) for v in t[1:])) for t in tasks]
    n_outputs = len(tasks[0].classes) * (len(tasks) if cfg.scenario == "cil" else 1)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], n_outputs).to(cfg.device)
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
    return record_of(cfg, [row], acc, None, diverged, [], [], started)


# =============================================================================
# 3. Small helpers, and what a run records
# =============================================================================

def descend(loss, optimizers):
    """One step of each optimiser on `loss`."""
    for opt in optimizers:
        opt.zero_grad()
    loss.backward()
    for opt in optimizers:
        opt.step()


class Diverged(Exception):
    """Training produced a non-finite loss; the run's numbers would be meaningless."""


def detached(terms):
    return {k: v.detach() for k, v in terms.items()}


def noted(report, t, kept, started, name, log):
    """Log what the reconstruction before task t + 1 did; its entry in the run's record."""
    log(f"  [{name}] task {t + 1}: reconstructed {kept}/{report['candidates']}, "
        f"loss {report['first_loss']:.4g} -> {report['kept_loss']:.4g}" + unexplained(report)
        + (f", FLAGGED: {report['failed']} (kept its lowest-loss candidates)" if report["failed"] else ""))
    return {"task": t + 1, **report, "kept": kept, "seconds": round(time.time() - started, 2)}


def reconstruction_report(losses, best, first_terms, backtracks=0):
    """What a reconstruction did: the loss at its start, of the candidates it kept, and at its
    last step; and why it failed, if it did: it diverged (a loss that turned non-finite, or a
    last step above the start), or no step lowered the loss. `backtracks`: steps undone."""
    first, last = losses[0], losses[-1]
    failed = (f"diverged at step {len(losses) - 1}" if not math.isfinite(last)
              else f"diverged: the last step's loss {last:.4g} is above the start's {first:.4g}" if last > first
              else "no step lowered the loss" if best[0] >= first else None)
    return {"steps": len(losses) - 1, "first_loss": first, "kept_loss": best[0], "last_step_loss": last,
            "first_terms": {k: v.item() for k, v in first_terms.items()},
            "kept_terms": {k: v.item() for k, v in best[3].items()}, "backtracks": backtracks, "failed": failed}


def record_of(cfg, R, acc, bwt, diverged, reconstructions, recon_quality, started):
    """A run's record: its accuracy matrix, ACC, BWT and what each reconstruction did."""
    return {"method": cfg.method, "variant": cfg.variant, "recl": cfg.variant != "base", "scenario": cfg.scenario,
            "seed": cfg.seed, "acc_matrix": R, "ACC": acc, "BWT": bwt, "diverged": diverged,
            "reconstructions": reconstructions, "recon_quality": recon_quality,
            "failed_reconstructions": sum(bool(r["failed"]) for r in reconstructions),
            "seconds": round(time.time() - started, 2),
            "phase_seconds": {"reconstruct": round(sum(r["seconds"] for r in reconstructions), 2)}}


if __name__ == "__main__":  # the command line lives in cli.py
    import cli
    cli.run_from_command_line(cli.main, "recl.py")
