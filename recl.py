"""ReCL: Reconstruction for Continual Learning, from "Slowing Down Forgetting in Continual Learning" (Janetzky,
Schlagenhauf, Feuerriegel); equation numbers are the paper's.

A network trained by gradient descent drifts towards a margin-maximisation point, where its weights are a
non-negative combination of the gradients of its margins at the training points: theta = sum_i lambda_i
grad_theta Phi(theta; x_i), lambda_i >= 0 (App. B). ReCL reads this backwards: before each new task it optimises
random candidates x_i and their lambda_i until the equation holds for the current weights (Step 1, Sec. 4.1), then
trains on those reconstructions with the new task's data (Step 2, Sec. 4.2).

Read top to bottom:
  0. The settings: `Config`, one field per setting with its help, and the tables a run's values are looked up in.
  1. The paper: Eq. 3-6 and the theory behind them, Step 1's loop (`reconstruct`), Step 2's (`train_task`), Eq. 1-2.
  2. A run: `step1` and `step2` build those loops' values from a Config, each departure one named `if` line where it
     acts (the filter's in `run_continual`, between the two steps); `run_continual` is the task loop.
  3. The departures, one function each, numbered as in docs/departures.md; the controls (inversion, stored images).
  4. Judging a reconstruction (SSIM, App. D.5) and Sec. 4.3's search, which runs Step 1 several times.
  5. The command line: a run's values looked up (`resolve`), the checks, `main`.
A method (EWC, ER, ...) is an entry of strategies.STRATEGIES (joint: one with no hooks), for example
  "ewc": {"hooks": {"extra_loss": ewc_loss, "after_task": ewc_after_task},
          "hyperparameters": {"ewc_lambda": (DEFAULT, MEANING, TEST)}, "grid": {"ewc_lambda": [VALUES]}}
(TEST: true for a valid value; the grid is what tools/tune.py searches). The hooks, each called where it acts in
`train_task` and `run_continual`: extra_loss(model, x, y, logits, state) -> a loss added to the batch's;
after_backward(model, state), which may rewrite .grad; after_task(model, loader, state), on the task's real images.
`state` starts as the method's hyperparameters (strategies.new_state); its hooks keep it across tasks. A run reads one
more table from there, TUNED[scenario][method] = {"alone": {lr, epochs, hyperparameters}, "recl": {what +ReCL's budget
changes}}: those three only, never ce_scope (test_a_methods_tuned_values_are_step_2_values_only). Networks are in
models.py, the data and result files in data.py; tools/see_eq3_work.py shows Eq. 3 reading training images back.

Adding a method: its STRATEGIES entry (hyperparameters named unlike Config's fields: `resolve` merges them), its TUNED
values, an ARMS line if one arm needs its own, a test of its hooks against a direct computation (as EWC's Fisher against
a per-sample loop); a call in `train_task` or `run_continual` only for a new hook point; its rows in the README's tables
once run_all.sh has run it. No code lists methods (`--method`, run_all.sh and tools/ read STRATEGIES). Adding a
departure: a Config field among the replay fields, `m` to `trials` (among Step 2's, `lr` to `ce_scope`, if the method
alone takes it too); `kind=` if its default is None; its "off" value in PAPER; its value in NETWORKS or CONTROL where a
network or inversion differs, and its name in STORED's kept list if the stored controls use it; its function in part 3
and one `if` line where it acts, reading None as off (the method alone's replay fields are None); where needed a
`retune` line, a refusal in `check`, a range in SEARCH_SPACE, a term in `models.step1_gib`'s memory estimate; a test on
a trained net and a docs/departures.md section; then rerun the shipped tables (a new field renames every result). Its
flag, range check and header entry follow from the field; run_all.sh, tools/ and the other tests need no edit.

`--paper` switches every departure off (PAPER), and with them each network's and method's replay values (NETWORKS,
ARMS), and trains at the method's own budget (TUNED's "alone", tuned on validation as the paper tunes its baselines,
App. D.3); flags given with it still win. It acts on the replay arm: the method alone is the same run with it or
without. Eq. 3-6's own values (m, n_rec, sigma_x, lr_lambda, lambda_min, alpha; lr_x follows the target, below) stay
Config's: the paper gives ranges (App. B.3); `--tuning` searches them per task (Sec. 4.3). Where the paper's text is
silent it keeps: Phi of a multi-class network as the margin against the best other class (in CIL of the old classes:
Step 1 runs before the head grows), one lambda per candidate, lambda_i from U(0, 1), nothing clamping lambda, momentum
0.9 in Step 1's SGD, the lowest-loss step kept, Step 1's copy in eval mode, the same random start before every task, the
candidates' step size following what Eq. 3 fits (`retune`: lr_x 1 for theta), batch-norm statistics re-estimated after
each task (ResNet18), float32, and for each task's Step 2 a fresh SGD and the same seeded sequence of shuffles (a new
order each epoch), the method's hooks on replayed rows too, a failed reconstruction's lowest-loss candidates replayed
(and FLAGGED). Against the printed equations, as the reconstruction code of Buzaglo et al. (2023) does: squared hinges
in Eq. 4 and 5, weight 5 on Eq. 4, Eq. 3's sum scaled by 1/n. The rest is the paper's: x_i ~ N(0, sigma_x^2 I), fixed
labels, m = n, the smooth ReLU's backward, SGD on L_full for n_rec steps, naive tuning (Sec. 4.3), the CIL head grown
with its old rows, a bias on the first layer only, Step 2 as plain SGD in batches of 64 (App. D); models.py's init,
data.py's scaling.
"""
import argparse, copy, dataclasses, math, os, shlex, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import data, models, strategies

# ==== 0. The settings ================================================================================================

def setting(default, help, low=None, high=None, above=None, choices=None, kind=None, flag=True):
    """A Config field: its default, its help, and what a flag may give it (low <= v, above < v, v <= high)."""
    return dataclasses.field(default=default, metadata=dict(help=help, low=low, high=high, above=above,
                                                            choices=choices, kind=kind, flag=flag))

per_class = lambda text: text if text == "all" else int(text)  # --n-per-class
COUNT = dict(above=0, high=100_000)  # far beyond any study here, far short of forever

@dataclasses.dataclass(frozen=True)
class Config:
    """Every value one run uses. The defaults are the MLP's +ReCL run on SplitMNIST, but for the lr, epochs and
    hyperparameters each method tunes (strategies.TUNED). The replay arm's fields, `m` to `trials`, are None for the
    method alone (`budget` too, unless --budget is given), and for the controls those they skip (CONTROL, STORED)."""
    # what runs
    dataset: str = setting("mnist", "mnist (shipped), fashion-mnist, cifar10, or a .pt")
    scenario: str = setting("cil", "class-incremental (a growing head) or domain-incremental", choices=["cil", "dil"])
    method: str = setting("finetune", "the continual-learning method", choices=list(strategies.STRATEGIES))
    variant: str = setting("base", "base (the method alone), recl, inversion, real or centroids", flag=False)
    model: str = setting("mlp", "the paper's MLP or CNN, or AlexNet or ResNet18", choices=models.MODELS)
    seed: int = setting(0, "first seed: class order, init and shuffles", low=0)
    # data
    n_per_class: int = setting(100, "training images per class, or 'all'", kind=per_class, above=0)
    classes_per_task: int = setting(2, "classes per task", above=0)
    validation: bool = setting(False, "score on a held-out fifth of each task's training images, not the test set")
    data_root: str = setting("data", "where fashion-mnist and cifar10 live")
    # training (Step 2)
    lr: float = setting(0.05, "SGD learning rate", above=0, high=10.0)
    epochs: int = setting(20, "epochs per task", above=0, high=10_000)
    batch_size: int = setting(64, "training batch size", above=0)
    ce_scope: str = setting("all", "CIL, departure 8, the method alone too: the task's images scored over all classes "
                            "(all) or its new ones (new); local: new, and replay over the old",
                            choices=["all", "new", "local"])
    hp: dict = dataclasses.field(default_factory=dict)  # the method's own hyperparameters (strategies.py), by --hp
    # reconstruction (Step 1) and replay: the replay arm's fields, m to trials (RECL_FIELDS; a new departure's here)
    m: int = setting(None, "candidates per old class (DIL: per class and old task); default: --n-per-class", kind=int,
                     **COUNT)
    n_rec: int = setting(100, "reconstruction steps before each task", **COUNT)
    sigma_x: float = setting(1e-3, "std of the initial random candidates", above=0, high=10.0)
    lr_x: float = setting(3.0, "step size of the candidates", above=0, high=1000.0)
    lr_lambda: float = setting(0.1, "step size of the lambdas", above=0, high=1000.0)
    lambda_min: float = setting(0.05, "Eq. 4 pushes each lambda_i above this", above=0, high=1000.0)
    alpha: float = setting(100.0, "sharpness of the smooth ReLU's backward", above=0, high=1e6)
    rec_target: str = setting("displacement", "departure 1: Eq. 3 fits theta - theta_0, or theta (weights)",
                              choices=["weights", "displacement"])
    freeze_old: bool = setting(True, "departure 2: classes reconstructed before keep their candidates")
    filter: bool = setting(True, "departure 3: replay only candidates the model files under their label")
    replay_noise: float = setting(2.5, "departure 4: std of fresh noise on replay, in pixel stds", low=0, high=100.0)
    ce_weight: float = setting(3e-4, "departure 5: weight of an inversion term added to Eq. 6", low=0, high=1e6)
    rec_optimizer: str = setting("sgd", "departure 6: the candidates' optimiser", choices=["sgd", "adam"])
    replay_batch: int = setting(0, "departure 9: reconstructions in each batch; 0: they join the task's data", low=0,
                                high=100_000)
    budget: str = setting("recl", "the method's lr, epochs, hp: its +ReCL arm's (recl) or its own (alone); recl on "
                          "the method alone: no replay, +ReCL's training", choices=["alone", "recl"])
    rec_precision: str = setting("float32", "number format of Step 1's products", choices=["float32", "bfloat16"])
    tuning: str = setting("naive", "Sec. 4.3: the run's values, or a search per task scored by the final L_full "
                          "(unsup) or by SSIM to a few stored images (sup)", choices=["naive", "unsup", "sup"])
    trials: int = setting(None, "the search's trials per task (default: 10)", kind=int, above=0, high=1000)
    paper: bool = setting(False, "the paper's method: every departure off, the method's own training budget")
    # where
    device: str = setting("auto", "auto: CUDA when present", choices=["auto", "cpu", "cuda"])
    set_by: dict = dataclasses.field(default_factory=dict)  # each value not a default: where it came from

FIELDS, DEFAULTS = [f.name for f in dataclasses.fields(Config)], dataclasses.asdict(Config())
RECL_FIELDS = FIELDS[FIELDS.index("m"):FIELDS.index("paper")]  # what the method alone does not use
# --paper: every departure off. Eq. 3-6's own settings (m, n_rec, sigma_x, the step sizes, lambda_min, alpha) keep
# Config's values, for which the paper gives ranges (App. B.3); lr_x follows what Eq. 3 fits (`resolve`).
PAPER = {"rec_target": "weights", "freeze_old": False, "filter": False, "replay_noise": 0.0, "ce_weight": 0.0,
         "rec_optimizer": "sgd", "replay_batch": 0, "ce_scope": "all", "budget": "alone"}
# The controls skip what is Eq. 3-6's: inversion has no lambdas, no target, no added term; the stored arms (real
# images, class centroids) optimise nothing: only m, the filter and the replay are theirs.
CONTROL = {"lr_lambda": None, "lambda_min": None, "rec_target": None, "ce_weight": None}
STORED = {k: None for k in RECL_FIELDS if k not in ("m", "filter", "replay_noise", "replay_batch", "budget")}
SOURCES = {"eq3": "recl", "inversion": "inversion", "real": "real", "centroids": "centroids"}  # --replay-source
# Each network's replay values per scenario, chosen on validation (docs/networks.md); in DIL no inversion term
# (docs/departures.md, 5). AlexNet takes the CNN's at the method's own budget: the harder one bought it nothing.
CONV = {"rec_optimizer": "adam", "m": 20, "n_rec": 30, "replay_batch": 64}
RESNET = {"rec_optimizer": "adam", "m": 10, "n_rec": 15, "replay_batch": 32, "replay_noise": 1.0}
NETWORKS = {"mlp": {"cil": {}, "dil": {"ce_weight": 0.0}},
            "cnn": {"cil": {**CONV, "ce_scope": "local", "ce_weight": 0.03},
                    "dil": {**CONV, "replay_noise": 1.0, "ce_weight": 0.0}},
            "resnet18": {"cil": RESNET, "dil": {**RESNET, "ce_weight": 0.0}}}
NETWORKS["alexnet"] = {scenario: {**values, "budget": "alone"} for scenario, values in NETWORKS["cnn"].items()}
# A method's values on its replay arms, by (scenario, method) for every arm, (scenario, method, arm) for one; not under
# --paper. GPM replays without noise: it learns only outside the old tasks' input space, where noise trains what real
# images never use; its CIL centroids keep it (docs/evidence.md). ER scores all classes, over the CNN's "local": its
# real images teach old vs new.
ARMS = {("cil", "er"): {"ce_scope": "all"}, ("cil", "gpm"): {"replay_noise": 0.0},
        ("dil", "gpm"): {"replay_noise": 0.0}, ("cil", "gpm", "centroids"): {"replay_noise": 2.5}}

# ==== 1. The paper ===================================================================================================
#
# Why reading data out of weights can work (App. B). A homogeneous network, Phi(c theta; x) = c^L Phi(theta; x)
# (ReLU layers without biases or skips), trained by gradient descent on cross-entropy, converges in direction to a
# KKT point of  min_theta 1/2 |theta|^2  s.t.  Phi_y_i(theta; x_i) - Phi_j(theta; x_i) >= 1  for all i, j != y_i:
#   stationarity             theta = sum_i sum_{j != y_i} lambda_ij grad_theta (Phi_y_i - Phi_j)(theta; x_i)   (Eq. 9)
#   dual feasibility         lambda_ij >= 0                                                                    (Eq. 10)
#   primal feasibility       every margin >= 1
#   complementary slackness  lambda_ij > 0 only where x_i's margin against j is exactly 1 (points on the margin)
# ReCL keeps the first two, as losses over unknown points (the images are sought; the labels are fixed, m per old
# class) and drops the last two, so nothing asks a candidate to sit on the margin. The paper's Eq. 3 keeps one lambda
# per point, not per (point, class), and leaves Phi of a multi-class network open: here Phi(theta; x) is the margin of
# x's label y, its logit minus the largest other logit. Over n candidates (m per old class, `--m`, times the classes):
#
#   L_rec    = || theta - (1/n) sum_i lambda_i grad_theta Phi(theta; x_i) ||^2   (Eq. 3; by default theta - theta_0
#                                                                                 in place of theta: departure 1)
#   L_lambda = 5 sum_i relu(lambda_min - lambda_i)^2                             (Eq. 4)
#   L_prior  = sum_{i,k} relu(|x_ik| - 1)^2                                      (Eq. 5)
#   L_full   = L_rec + L_lambda + L_prior                                        (Eq. 6)
#
# The paper prints Eq. 3 without 1/n, L_lambda = sum_i max(-lambda_i, -lambda_min) and L_prior = sum_{i,k}
# max(x_ik - 1, -x_ik - 1, 0). As in Buzaglo et al.'s (2023) reconstruction code, Eq. 4 and 5 are squared hinges
# here (smooth), and 1/n makes lambda_min mean the same for any n. The norm runs over every parameter (models.py's
# MLP: D-1000-1000-C, every ReLU an nn.ReLU module, a bias on the first layer only). `scale` multiplies L_rec: 1 here;
# departure 1 divides by |theta - theta_0|^2, so L_rec is the share left. Eq. 5's [-1, 1] holds the data: data.py
# scales pixels to [0, 1] and subtracts the training set's mean image.
#
# Why lambda_min, not just lambda >= 0: lambda_i = 0 is feasible and takes x_i out of the sum, so a few candidates
# could explain theta and leave the rest as noise. Eq. 4 pushes every lambda_i above lambda_min, so every candidate
# carries some of theta. Nothing clamps lambda: Eq. 4 is the only push.
#
# Three facts of the implementation the loss relies on:
#   - A double backward. L_rec contains grad_theta Phi(theta; x_i), and Step 1 needs its gradient in x_i and lambda_i,
#     a derivative of a derivative: torch.func.grad builds the inner gradient as a graph that loss.backward() in
#     `reconstruct` differentiates again.
#   - The smooth ReLU. ReLU's derivative is a step in z: the activation pattern, which decides grad_theta Phi, moves
#     with x, but the step's derivative is zero, so the outer gradient cannot see that. Step 1's copy keeps ReLU's
#     forward (the margins are the network's own) and takes sigmoid(alpha z) as its derivative in every backward, so
#     grad_theta Phi in Eq. 3 is the surrogate's too: a surrogate gradient, sharper as alpha grows.
#   - One pass for the whole sum. sum_i lambda_i grad Phi(x_i) = grad sum_i lambda_i Phi(x_i), as a gradient is
#     linear, provided each Phi(x_i) depends on its own x_i only. That holds in eval mode (batch norm uses running
#     statistics, no dropout); in train mode batch norm mixes a batch's candidates. `step1` puts its copy in eval
#     mode; a test checks the one-pass form against vmap's per-candidate gradients.

class SmoothBackwardReLU(torch.autograd.Function):
    """relu(z) forward; backward sigmoid(alpha z), the derivative of the rounded ReLU log(1 + e^(alpha z)) / alpha
    (Haim et al. 2022), in plain operations that autograd differentiates again in Step 1's double backward."""
    generate_vmap_rule = True  # torch.func takes it through vmap

    @staticmethod
    def forward(z, alpha):
        return z.clamp_min(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, ctx.alpha = inputs
        ctx.save_for_backward(z)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out * torch.sigmoid(ctx.alpha * ctx.saved_tensors[0]), None

class SmoothReLU(torch.nn.Module):  # the module that stands in for each nn.ReLU
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, z):
        return SmoothBackwardReLU.apply(z, self.alpha)

def with_smooth_relu(model, alpha):
    """A copy of `model` whose every ReLU is SmoothReLU(alpha): the network Step 1 differentiates."""
    copied = copy.deepcopy(model)
    for parent in copied.modules():
        for name in [name for name, child in parent.named_children() if isinstance(child, torch.nn.ReLU)]:
            setattr(parent, name, SmoothReLU(alpha))
    return copied

def margins(model, params, x, y):
    """Phi_y(x) - max_{j != y} Phi_j(x) for a batch x [n, C, H, W], y [n], with the network's weights as `params`."""
    logits = functional_call(model, params, (x,))
    own = logits.gather(1, y[:, None]).squeeze(1)
    best_other = logits.scatter(1, y[:, None], float("-inf")).amax(1)
    return own - best_other

def weighted_gradient_sum_vmap(model, params, x, y, lam):
    """(1/n) sum_i lambda_i grad_theta Phi(theta; x_i) as written, one gradient per candidate (the tests' reference)."""
    margin_of_one = lambda p, xi, yi: margins(model, p, xi[None], yi[None])[0]
    per_candidate = vmap(grad(margin_of_one), in_dims=(None, 0, 0))(params, x, y)
    return {k: torch.tensordot(lam, g, dims=1) / len(x) for k, g in per_candidate.items()}

def weighted_gradient_sum(model, params, x, y, lam, n=None):
    """The same sum in one backward pass, as a gradient is linear: grad sum_i lambda_i Phi(x_i), differentiable in x
    and lambda. Divided by n, all candidates, also when `x` is some of them."""
    return grad(lambda p: (lam * margins(model, p, x, y)).sum() / (n or len(x)))(params)

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
    """x_i ~ N(0, sigma_x^2 I) (Sec. 4.1), then lambda_i ~ U(0, 1), from one generator seeded by `seed`: before every
    task candidate i starts from the same x_i whatever n, but not the same lambda_i (drawn after all n candidates).
    With departure 2 the earlier classes' slots are then overwritten."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *input_shape, generator=gen) * sigma_x, torch.rand(n, generator=gen)

def reconstruct(L_full, x, lam, optimizers, steps, log=print):
    """Step 1 (Sec. 4.1): `steps` steps of the optimisers on L_full(x, lam) (Eq. 6), in place. Returns the candidates
    and lambdas of the lowest loss seen, and a report: the loss at the start, kept and last, and why the
    reconstruction failed, if it did: it diverged (a non-finite loss, or a last step above the start, even if a lower
    loss was kept on the way), or no step lowered the loss. A failed one's kept candidates are still replayed."""
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
    best = best or (losses[0], x.detach(), lam.detach(), first_terms)  # not even the start is finite: flagged below
    first, last = losses[0], losses[-1]
    failed = (f"diverged at step {len(losses) - 1}" if not math.isfinite(last)
              else f"diverged: the last step's loss {last:.4g} is above the start's {first:.4g}" if last > first
              else "no step lowered the loss" if best[0] >= first else None)
    return best[1], best[2], {"steps": len(losses) - 1, "first_loss": first, "kept_loss": best[0],
                              "last_step_loss": last, "first_terms": {k: v.item() for k, v in first_terms.items()},
                              "kept_terms": {k: v.item() for k, v in best[3].items()}, "failed": failed}

class Diverged(Exception):
    """A non-finite training loss: the run's numbers would be meaningless."""

def train_task(model, batches, loss_of, optimizer, epochs, hooks, state):
    """Step 2 (Sec. 4.2): SGD on cross-entropy, which the strategy's hooks extend (on every batch, replayed rows too).
    `batches()` draws one epoch of (x, y, replayed) batches; returns the last epoch's mean loss."""
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
            if not math.isfinite(value := loss.item()):  # nothing useful can follow: stop here and say where
                raise Diverged(f"training loss {value} in epoch {epoch + 1}")
            total, seen = total + value * len(xb), seen + len(xb)
    return total / max(seen, 1)

def cross_entropy(model, xb, yb, replayed):
    """The paper's loss: every row scored over every class."""
    logits = model(xb)
    return logits, F.cross_entropy(logits, yb)

def acc_and_bwt(R):
    """R[t][i]: test accuracy (percent) on task i after training task t. ACC = mean_i R[T, i] (Eq. 1);
    BWT = mean_{i<T} R[T, i] - R[i, i] (Eq. 2)."""
    T = len(R)
    acc = sum(R[T - 1][i] for i in range(T)) / T
    bwt = sum(R[T - 1][i] - R[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else 0.0
    return acc, bwt

@torch.no_grad()
def accuracy(model, x, y, batch_size=1000):
    model.eval()
    correct = sum((model(xb).argmax(1) == yb).sum().item() for xb, yb in zip(x.split(batch_size), y.split(batch_size)))
    return 100.0 * correct / len(x)

# ==== 2. A run: the values each loop takes, and the task loop ========================================================

def step1(model, old_tasks, cfg, last=None, log=print):
    """Step 1 for a run: candidates for every old class, read from `model` after its last task.
    `last`: the previous reconstruction (x, labels, lambdas). Returns x, labels, lambdas, report."""
    device = next(model.parameters()).device
    labels = candidate_labels(model.head.out_features, cfg.m, len(old_tasks), cfg.scenario).to(device)
    net = with_smooth_relu(model, cfg.alpha).eval()  # a copy for Step 1: smooth backward, eval mode (part 1)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, lam = (v.to(device) for v in random_start(len(labels), old_tasks[0].x_train.shape[1:], cfg.sigma_x, cfg.seed))
    fixed = torch.zeros(len(labels), dtype=torch.bool, device=device)
    target, scale = params, 1.0                                            # Eq. 3 fits theta
    if cfg.rec_target == "displacement":                                   # departure 1: theta - theta_0
        target, scale = displacement_target(params, model)
    if cfg.freeze_old and last is not None:                                # departure 2: keep what was read
        fixed = keep_earlier(labels, x, lam, *last)                        # (writes into x and lam)
        target = less_share_of(net, params, target, x[fixed], labels[fixed], lam[fixed], len(labels))
    if cfg.variant == "inversion":                                         # the control: no Eq. 3
        L_full = inversion_loss(net, params, labels[~fixed])
    else:
        L_full = stationarity_loss(net, params, labels[~fixed], target, cfg.lambda_min, len(labels), scale)
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

def step2(task, x_rec, y_rec, cfg, n_old_classes):
    """Step 2 for a run: the task's images with the reconstructions last, as batches and a loss.
    Returns batches(), the loss, and batches without replay noise (for batch norm's statistics)."""
    x, y, own = torch.cat([task.x_train, x_rec]), torch.cat([task.y_train, y_rec]), len(task.x_train)
    # the paper: one set, shuffled each epoch (a DataLoader over row numbers, with dummy labels, and a generator of its
    # own seeded with the run's seed: a new order each epoch, the same sequence of orders for every task)
    loader = data.loader(torch.arange(len(x), device=x.device), torch.zeros(len(x)), cfg.batch_size, seed=cfg.seed)
    rows = lambda: (r for r, _ in loader)
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

def run_continual(cfg, tasks, log=print, mean_image=None, judge=False, image_path=None):
    """Train one model through all tasks, with its replay arm unless cfg.variant is "base"; its record. `judge`: score
    each reconstruction against the real old images (part 4), which training never sees. `--method joint`, the upper
    bound, trains once on every task's images together and is tested task by task."""
    started, joint = time.time(), cfg.method == "joint"
    torch.manual_seed(cfg.seed)  # the same init and shuffles for every variant
    tasks = [data.Task(t.classes, *(v.to(cfg.device) for v in t[1:])) for t in tasks]
    per_task, name = len(tasks[0].classes), data.variant_name(cfg.method, cfg.variant, cfg.budget)
    n_outputs = per_task * (len(tasks) if joint and cfg.scenario == "cil" else 1)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], n_outputs).to(cfg.device)
    hooks, state = strategies.STRATEGIES[cfg.method]["hooks"], strategies.new_state(cfg.method, **cfg.hp)
    stream = tasks  # what it trains on, task by task; joint: every task's training images at once
    if joint:
        every = lambda field: torch.cat([getattr(t, field) for t in tasks])
        stream = [data.Task(None, every("x_train"), every("y_train"), None, None)]
    R = [[None] * len(tasks) for _ in stream]  # R[t][i]: accuracy on task i after training task t
    reconstructions, quality, last, diverged = [], [], None, None  # last: the previous reconstruction, whole
    memory = []  # the stored controls' kept images and labels, per old task
    for t, task in enumerate(stream):
        x_rec, y_rec = task.x_train[:0], task.y_train[:0]
        if cfg.variant != "base" and t > 0:  # Step 1: reconstruct old data from the model after task t
            start = time.time()
            if cfg.variant in ("real", "centroids"):  # the stored controls read nothing: they replay what they kept
                x_rec, y_rec = (torch.cat(kept) for kept in zip(*memory))
                lam, report = None, {"candidates": len(x_rec), "failed": None}
            elif cfg.tuning in (None, "naive"):
                x_rec, y_rec, lam, report = step1(model, tasks[:t], cfg, last, log)
            else:  # Sec. 4.3: several reconstructions, the best by a score
                x_rec, y_rec, lam, report = search_reconstruction(model, tasks[:t], cfg, last, log, mean_image)
            last = (x_rec, y_rec, lam)  # whole, before the filter: for departure 2
            if cfg.filter:  # departure 3: drop those the model (of the old classes) files under another class
                keep = classified_as_labelled(model, x_rec, y_rec)
                x_rec, y_rec = x_rec[keep], y_rec[keep]
            seconds = round(time.time() - start, 2)
            reconstructions.append({"task": t + 1, **report, "kept": len(x_rec), "seconds": seconds})
            log(f"  [{name}] task {t + 1}: " + said(reconstructions[-1]))
            if judge and len(x_rec):
                quality.append(report_reconstruction(name, tasks[:t], x_rec, y_rec, cfg, mean_image, image_path, log))
        if cfg.scenario == "cil" and not joint:
            models.grow_head(model, per_task * (t + 1))
        batches, loss_of, clean = step2(task, x_rec, y_rec, cfg, per_task * t if cfg.scenario == "cil" else 0)
        try:
            loss = train_task(model, batches, loss_of, torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg.epochs,
                              hooks, state)
        except Diverged as err:  # the record says so and has no ACC or BWT to average
            diverged = f"{err} of task {t + 1} (lr {cfg.lr:g})"
            log(f"  [{name}] task {t + 1}: diverged, {err}")
            break
        # Batch norm (ResNet18) evaluates with running statistics that a task's few dozen steps barely move from their
        # start: re-estimate them with the final weights, on the rows it trained on (no-op without it).
        torch.optim.swa_utils.update_bn(((xb,) for xb, _, _ in clean()), model)
        model.eval()  # strategies look at the trained model (fixed batch-norm statistics, no dropout)
        if "after_task" in hooks:
            hooks["after_task"](model, data.loader(task.x_train, task.y_train, cfg.batch_size, shuffle=False), state)
        if cfg.variant in ("real", "centroids") and t < len(tasks) - 1:
            memory.append(stored_images(task, cfg.m, cfg.variant == "centroids", cfg.seed + t))
        tested = tasks if joint else tasks[:t + 1]
        R[t][:len(tested)] = [accuracy(model, old.x_test, old.y_test) for old in tested]
        what = f"all {len(tasks)} tasks at once" if joint else f"task {t + 1}/{len(tasks)} classes {task.classes}"
        log(f"  [{name}] {what}: loss {loss:.3f}, acc {' '.join(f'{a:.1f}' for a in R[t][:len(tested)])}")
    if diverged is None and reconstructions and all(r["failed"] for r in reconstructions):
        diverged = "every reconstruction failed (the reconstruction settings; see each one's \"failed\")"
    acc = bwt = None
    if not diverged and joint:  # one row, each task tested once: no BWT
        acc = sum(R[0]) / len(R[0])
    elif not diverged:
        acc, bwt = acc_and_bwt(R)
    held = 0 if last is None else len(last[0].unique(dim=0)) if cfg.variant == "centroids" else len(last[0])
    return {"method": cfg.method, "variant": cfg.variant, "recl": cfg.variant != "base", "scenario": cfg.scenario,
            "seed": cfg.seed, "acc_matrix": R, "ACC": acc, "BWT": bwt, "diverged": diverged,
            "reconstructions": reconstructions, "recon_quality": quality,
            "failed_reconstructions": sum(bool(r["failed"]) for r in reconstructions),
            "stored_images": held,  # what the arm holds before the last task (a centroid counts once)
            "seconds": round(time.time() - started, 2),
            "phase_seconds": {"reconstruct": round(sum(r["seconds"] for r in reconstructions), 2)}}

def said(r):
    """What the reconstruction before a task did, in a line."""
    if "first_loss" not in r:  # a stored control: nothing was optimised
        return f"replays {r['kept']}/{r['candidates']} stored images"
    left = (f", Eq. 3 leaves {r['kept_terms']['rec']:.0%} of |theta - theta_0|^2 unexplained"  # by all candidates
            if r["rec_scale"] != 1.0 and "rec" in r["kept_terms"] else "")
    return (f"reconstructed {r['kept']}/{r['candidates']}, loss {r['first_loss']:.4g} -> {r['kept_loss']:.4g}{left}"
            + (f", FLAGGED: {r['failed']} (kept its lowest-loss candidates)" if r["failed"] else ""))

# ==== 3. The departures from the paper, and the controls =============================================================
# Each: what the paper does, what we do, why; docs/departures.md has the numbers under the same number. A gap in the
# numbering (7) is a lever that lost: it has no code. `--paper` switches every one off.

# Departure 1, displacement target (`--rec-target displacement`). Paper: Eq. 3 fits theta. Here: theta - theta_0, what
# training added, relative to its size (theta_0 of a grown head's new rows: their values when the head grew). Why:
# Eq. 3 holds after long training; after minutes the random start theta_0 still dominates theta.
def displacement_target(params, model):
    start = models.start_weights(model)  # the copy of the weights models.build_model kept when it made the net
    if start is None:
        raise ValueError("the displacement target needs the model's initial weights: "
                         "build it with models.build_model or call models.remember_start first")
    displacement = {k: params[k] - start[k] for k in params}
    return displacement, 1.0 / sum(v.pow(2).sum() for v in displacement.values()).clamp_min(1e-30)

# Departure 2, freeze old (`--freeze-old`). Paper: every candidate starts from noise before every task. Here: the
# slots of a class read before keep those candidates and lambdas, fixed. Why: reading a class again from a model
# trained on its reconstructions compounds errors.
def keep_earlier(labels, x, lam, earlier_x, earlier_labels, earlier_lam):
    """Fill the first slots of each class read before with its earlier candidates; which are fixed."""
    fixed = torch.zeros(len(labels), dtype=torch.bool, device=labels.device)
    for c in earlier_labels.unique():
        slots, earlier = (labels == c).nonzero().squeeze(1), (earlier_labels == c).nonzero().squeeze(1)
        n = min(len(slots), len(earlier))
        x[slots[:n]], lam[slots[:n]], fixed[slots[:n]] = earlier_x[earlier[:n]], earlier_lam[earlier[:n]], True
    return fixed

def less_share_of(net, params, target, x, labels, lam, n):
    """Fixed candidates add a constant to Eq. 3's sum: take it off the target once. Their lambdas were fitted under
    the smaller n of an earlier task, so 1/n now shrinks their share; the free candidates fit the rest. The scale
    stays departure 1's: L_rec is still the share of theta - theta_0 that all candidates, fixed and free, leave."""
    share = weighted_gradient_sum(net, params, x, labels, lam, n)
    return {k: target[k] - share[k] for k in target}

# Departure 3, filter (`--filter`). Paper: every reconstruction is replayed. Here: those the model files under another
# class are dropped. Why: they would teach the wrong boundary (App. D.5 suggests filtering).
@torch.no_grad()
def classified_as_labelled(model, x, y):  # in eval mode, as the model is tested
    return model.eval()(x).argmax(1) == y

# Departure 4, replay noise (`--replay-noise`). Paper: reconstructions are replayed as they are. Here: each time one
# enters a batch it gets fresh noise N(0, s^2), s = replay_noise times the task's pixel std. Why: the network then
# files a neighbourhood under the old class, not a prototype.
def with_noise(batches, std, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    if std <= 0:
        return batches
    noise = lambda xb, replayed: replayed.view(-1, *[1] * (xb.dim() - 1)) * std * torch.randn(
        xb.shape, generator=gen, device=device)
    return lambda: ((xb + noise(xb, replayed), yb, replayed) for xb, yb, replayed in batches())

# Departure 5, inversion term (`--ce-weight`). Paper: Eq. 6 alone. Here: plus ce_weight times the candidates' summed
# cross-entropy. Why: in CIL, Eq. 3 alone loses to model inversion; a little of it draws level.
def plus_inversion_term(L_full, net, params, labels, weight):
    return lambda x, lam: {**L_full(x, lam), "ce": weight * F.cross_entropy(functional_call(net, params, (x,)),
                                                                            labels, reduction="sum")}

# Departure 6, Adam (`--rec-optimizer adam`). Paper: SGD (with momentum, part 1). Here: Adam with DeepInversion's
# betas. Why: on deep nets SGD's step follows a gradient whose size spans orders of magnitude.
def adam(tensor, lr):
    return torch.optim.Adam([tensor], lr=lr, betas=(0.5, 0.9))

# Departure 8, local cross-entropy (`--ce-scope new` or `local`, CIL). Paper: every row is scored over every class.
# Here, "new": the task's own rows over its new classes only; "local": the replayed rows over the old classes only too,
# and old against new learned by the head alone on features it cannot change (Always Be Dreaming's split). Why: the
# task's images then never push the old classes' logits down through the features ("new": not at all).
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

# Departure 9, replay batch (`--replay-batch N`). Paper: the reconstructions join the task's data. Here: an epoch
# passes over the task's own images and each batch gets N reconstructions drawn at random. Why: the share of replay
# in a batch and an epoch's cost then stay fixed from task to task.
def replay_in_every_batch(x, own, batch_size, n, seed):
    gen = torch.Generator(device=x.device).manual_seed(seed + 1)
    loader = data.loader(torch.arange(own, device=x.device), torch.zeros(own), batch_size, seed=seed)
    return lambda: (torch.cat([rows, own + torch.randint(len(x) - own, (n,), generator=gen, device=x.device)])
                    for rows, _ in loader)

# The inversion control (`--replay-source inversion`): is it Eq. 3 that makes the candidates useful, or would any
# optimisation that makes the model recognise them as their labels do? Model inversion (Simonyan et al. 2014) asks
# only the second: L_inv = sum_i CE(f(x_i), y_i) + L_prior, with the same candidates, optimiser (at its own step size,
# `resolve`), steps, filter and replay; no lambdas, no stationarity condition.
def inversion_loss(net, params, labels):
    return lambda x, lam: {"ce": F.cross_entropy(functional_call(net, params, (x,)), labels, reduction="sum"),
                           "prior": image_prior(x)}

# The stored controls (`--replay-source real` or `centroids`): where is the ceiling of any replay here, and what
# would a memory of class statistics give? `real` keeps m of each class's own training images (a buffer as large as
# the reconstruction), `centroids` each class's mean image in the same m slots, which replay noise spreads. Both go
# through the same filter, replay and training as +ReCL.
def stored_images(task, m, centroids, seed):
    gen, xs, ys = torch.Generator().manual_seed(seed), [], []
    for c in task.y_train.unique():
        rows = task.x_train[task.y_train == c]
        pick = torch.randperm(len(rows), generator=gen)[:m].to(rows.device)
        xs.append(rows.mean(0, keepdim=True).expand(len(pick), *rows.shape[1:]) if centroids else rows[pick])
        ys.append(torch.full((len(pick),), int(c), dtype=task.y_train.dtype, device=rows.device))
    return torch.cat(xs), torch.cat(ys)


# ==== 4. Judging a reconstruction, and Sec. 4.3's search =============================================================
# Reporting only: training never sees these real images. App. D.5: (1) standardise both sets and match each real image
# to its nearest candidate by L2; (2) add the training mean image back, stretch each image to [0, 1]; (3) SSIM of each
# pair (Haim et al. 2022: above 0.4 is recovered). In (2) the paper adds the mean to the *standardised* candidates, so
# even exact copies score well below 1; here they first take the real set's mean image and spread.

def ssim(a, b, window=11, sigma=1.5):
    """Mean SSIM (Wang et al. 2004) of each image pair in [0, 1]; Gaussian window, valid borders."""
    channels, size = a.shape[1], min(window, a.shape[-2], a.shape[-1])
    g = torch.exp(-(torch.arange(size, dtype=a.dtype, device=a.device) - (size - 1) / 2) ** 2 / (2 * sigma ** 2))
    kernel = (torch.outer(g, g) / g.sum() ** 2).expand(channels, 1, size, size)
    blur = lambda t: F.conv2d(t, kernel, groups=channels)
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2, blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    index = (2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return index.flatten(1).mean(1)

def standardise(images):
    """Each image minus the set's mean image, divided by the set's spread around it."""
    centred = images - images.mean(0)
    return centred / centred.std().clamp_min(1e-12)

def as_picture(x, mean_image):
    """Undo the mean subtraction and stretch each image to [0, 1]."""
    x = x + mean_image
    low, high = (m.view(-1, *[1] * (x.dim() - 1)) for m in x.flatten(1).aminmax(dim=1))
    return (x - low) / (high - low).clamp_min(1e-12)

def on_reference_scale(candidates, reference):
    """Standardised candidates with the reference set's mean image and spread."""
    return standardise(candidates) * (reference - reference.mean(0)).std() + reference.mean(0)

def reconstruction_quality(reference, candidates, mean_image):
    """SSIM of every reference image with its nearest candidate (L2, each set standardised), and which that is."""
    nearest = torch.cdist(standardise(reference).flatten(1), standardise(candidates).flatten(1)).argmin(1)
    shown = on_reference_scale(candidates, reference)[nearest]
    return ssim(as_picture(reference, mean_image), as_picture(shown, mean_image)), nearest

def save_pairs(path, reference, candidates, nearest, mean_image, n=32):
    """A PNG of rows of real images, each row over their nearest candidates."""
    from torchvision.utils import save_image
    pick = torch.linspace(0, len(reference) - 1, min(n, len(reference))).long()  # spread over the classes
    real = as_picture(reference[pick], mean_image)
    found = as_picture(on_reference_scale(candidates, reference)[nearest[pick]], mean_image)
    rows = [t for pair in zip(real.split(16), found.split(16)) for t in pair]
    save_image(torch.cat(rows).cpu(), path, nrow=16, padding=1, pad_value=1.0)

def report_reconstruction(name, old_tasks, x_rec, y_rec, cfg, mean_image, image_path=None, log=print):
    """SSIM of the old real images with their nearest reconstructions, beside a floor (the random candidates they
    started from) and a ceiling (held-out real images of the old classes: look-alikes, not copies); and the
    memorisation gap: a reconstruction's nearest SSIM to n of the old training images less that to n held-out ones.
    Positive, it read those samples; about 0, what the class shares (a prototype). With `image_path` (RUN.json),
    RUN-taskT.png shows real images over their nearest reconstructions, RUN-taskT.pt holds the candidates."""
    real, held_out = torch.cat([t.x_train for t in old_tasks]), torch.cat([t.x_test for t in old_tasks])
    mean_image, draw = mean_image.to(real.device), lambda: torch.Generator().manual_seed(cfg.seed)
    start = random_start(len(x_rec), real.shape[1:], cfg.sigma_x or 0.0, cfg.seed)[0]  # the stored arms: from none
    pick = torch.randperm(len(held_out), generator=draw())[:len(x_rec)].to(held_out.device)
    (found, nearest), (floor, _), (ceiling, _) = (reconstruction_quality(real, c, mean_image) for c in (
        x_rec, start.to(real.device), held_out[pick]))
    q = {"task": len(old_tasks) + 1}
    for prefix, scores in (("", found), ("init_", floor), ("real_", ceiling)):
        q[prefix + "mean_ssim"] = scores.mean().item()
        q[prefix + "frac_ssim_above_0_4"] = (scores > 0.4).float().mean().item()
    n, gen = min(len(real), len(held_out)), draw()
    own, unseen = (s[torch.randperm(len(s), generator=gen)[:n].to(s.device)] for s in (real, held_out))
    q["ssim_to_training"], q["ssim_to_held_out"] = (reconstruction_quality(x_rec, s, mean_image)[0].mean().item()
                                                    for s in (own, unseen))
    q["memorisation_gap"] = q["ssim_to_training"] - q["ssim_to_held_out"]
    log(f"  [{name}] task {q['task']}: SSIM to nearest real image {q['mean_ssim']:.3f} (random candidates "
        f"{q['init_mean_ssim']:.3f}, held-out real {q['real_mean_ssim']:.3f}), {100 * q['frac_ssim_above_0_4']:.0f}% "
        f"above 0.4")
    if image_path is not None and min(real.shape[-2:]) > 1:  # images, not vectors
        path = Path(image_path).with_name(f"{Path(image_path).stem}-task{q['task']}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_pairs(path, real, x_rec, nearest, mean_image)
        torch.save({"x": x_rec.cpu(), "pixels": (x_rec + mean_image).clamp(0, 1).cpu(), "labels": y_rec.cpu()},
                   path.with_suffix(".pt"))
        log(f"  [{name}] task {q['task']}: images in {path} and {path.with_suffix('.pt')}")
    return q

# Sec. 4.3: naive takes the run's own values. unsup: a random search before each task, keeping the trial with the
# lowest final L_full; sup: scored by SSIM to a few stored real old images. Trial 1 is the run's own values; each other
# draw is log-uniform within a factor of them, where App. B.3 gives fixed ranges (docs/departures.md).
SEARCH_SPACE = {"sigma_x": 10.0, "lr_x": 10.0, "lr_lambda": 10.0, "lambda_min": 3.0, "alpha": 3.0}

def search_reconstruction(model, old_tasks, cfg, last=None, log=print, mean_image=None):
    """Step 1 `cfg.trials` times with drawn values; the reconstruction scored highest (ties: the earlier)."""
    seed = cfg.seed * 100 + len(old_tasks)  # the search's own draws, new before each task
    if cfg.tuning == "unsup":  # the lowest final L_full; needs no old data
        score = lambda x, report: -report["kept_loss"]
    else:  # sup: SSIM against a tenth of each old task's real images
        draws = torch.Generator().manual_seed(seed)
        few = lambda n: torch.randperm(n, generator=draws)[:max(1, round(0.1 * n))]
        buffer = torch.cat([t.x_train[few(len(t.x_train))] for t in old_tasks])
        mean = torch.zeros(buffer.shape[1:]) if mean_image is None else mean_image
        score = lambda x, report: reconstruction_quality(buffer, x, mean.to(x.device))[0].mean().item()
    gen = torch.Generator().manual_seed(seed)
    own = {k: getattr(cfg, k) for k in SEARCH_SPACE if getattr(cfg, k) is not None}
    trials = [own] + [{k: v * SEARCH_SPACE[k] ** (2 * torch.rand(1, generator=gen).item() - 1) for k, v in own.items()}
                      for _ in range(cfg.trials - 1)]
    best = None
    for i, hp in enumerate(trials):
        x, y, lam, report = step1(model, old_tasks, dataclasses.replace(cfg, **hp), last, log)
        useless = not math.isfinite(report["kept_loss"]) or report["kept_loss"] >= report["first_loss"]
        value = -math.inf if useless else score(x, report)
        log(f"    trial {i + 1}/{cfg.trials}: " + " ".join(f"{k} {v:.3g}" for k, v in hp.items())
            + f" -> score {value:.4g}")
        ranked = value if math.isfinite(value) else -math.inf
        if best is None or ranked > best[0]:
            best = (ranked, (x, y, lam, {**report, "hyperparameters": hp, "score": value}))
    return best[1]

# ==== 5. The command line: a run's values, the checks, main ==========================================================

def resolve(args, seed, variant):
    """One run's Config from the command line's `args` (None: not given; args.hp a dict, `check`), looked up in a fixed
    order, each source over those before: Config's defaults, the network's (NETWORKS), the method's at the run's budget
    (strategies.TUNED, then ARMS), --paper's (PAPER), the control's (CONTROL, STORED), the flags given. Then the values
    that depend on others, each a named `retune` line that never overrides a flag."""
    method, scenario, model, replay = args.method, args.scenario, args.model, variant != "base"
    # the flags given, but those of the replay arm for the method alone (which takes only --budget of them)
    given = {k: v for k, v in vars(args).items() if v is not None and k in FIELDS and k not in ("seed", "variant", "hp")
             and (replay or k not in RECL_FIELDS or k == "budget")}
    given.update(dict(args.hp))
    if not replay and given.get("budget") == "alone":
        del given["budget"]  # the method alone trains at its own budget anyway
    if given.get("n_per_class") == "all":
        given["n_per_class"] = None  # every training image
    paper = replay and bool(given.get("paper"))
    # the values tuned here, not the paper's: a replay arm's, and the method alone's at +ReCL's budget (--budget recl)
    tuned = (replay and not paper) or (not replay and given.get("budget") == "recl")
    network = NETWORKS[model][scenario] if tuned else {}
    # which row of the method's TUNED entry (its lr, epochs, hyperparameters): "recl" for a tuned run unless the network
    # (AlexNet) or --budget says otherwise; its own ("alone") for the method alone and under --paper
    row = given.get("budget", network.get("budget", "recl") if tuned else "alone")
    own = strategies.TUNED[scenario].get(method, {})  # a method not tuned yet: Config's values
    arm = {**ARMS.get((scenario, method), {}), **ARMS.get((scenario, method, variant), {})}
    sources = {"default": {**DEFAULTS, **strategies.defaults(method), "seed": seed, "variant": variant},
               "network": network,
               "method": {**own.get("alone", {}), **own.get(row, {}), **(arm if tuned else {})},
               "paper": PAPER if paper else {},
               "control": {"inversion": CONTROL, "real": STORED, "centroids": STORED}.get(variant, {}),
               "flag": given}
    values, set_by = {}, {}  # each value, and the source that set it last (the header shows it; not for what runs)
    for source, changes in sources.items():
        values.update(changes)
        set_by.update({k: source for k in changes if source != "default" and k not in ("dataset", "scenario",
                                                                                          "method", "model")})

    def retune(source, **changes):  # never a flag's value, nor one the run does not use
        for k in (k for k in changes if k not in given and values[k] is not None):
            values[k], set_by[k] = changes[k], source
    if not replay:  # the method alone replays nothing; at +ReCL's budget it trains as that arm, on its own images
        values.update({k: None for k in RECL_FIELDS if k not in given})
        for k in [k for k in set_by if values[k] is None and k not in given]:
            del set_by[k]  # nor where such a value would have come from
        if values["ce_scope"] == "local":
            values["ce_scope"] = "new"  # local needs replayed rows
    # the candidates' step size follows what they fit and how, under --paper too (departures.md, 1 and 6)
    if variant == "inversion":
        retune("steps", lr_x=0.3 if scenario == "dil" else 0.003)
    if variant == "recl" and values["rec_target"] == "weights":
        retune("steps", lr_x=1.0)
    if values["rec_optimizer"] == "adam":
        retune("steps", lr_x=1e-3 if model == "resnet18" else 0.01, lr_lambda=0.01)
    # the CNN trains gently in DIL, for every method: Eq. 3 can then read it (networks.md, "The CNN's budget in DIL")
    if model == "cnn" and scenario == "dil" and tuned and row == "recl":
        retune("network", lr=0.01, epochs=40)
    if values["tuning"] in ("unsup", "sup") and values["trials"] is None:
        values["trials"] = 10  # the search's default
    if replay:
        values["m"] = values["m"] or values["n_per_class"] or 100
    values["hp"] = {k: values.pop(k) for k in strategies.defaults(method)}
    values["set_by"], values["paper"] = set_by, paper  # the method alone is the same run with --paper or without
    if values["device"] == "auto":
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return Config(**values)

def variants(args):
    """The variants a command runs: the method alone and its replay arm (+ReCL, or what --replay-source names)."""
    if args.method == "joint":
        return ["base"]
    arm = SOURCES[args.replay_source or "eq3"]
    return {None: ["base", arm], "both": ["base", arm], "base": ["base"], "recl": [arm]}[args.variant]

class UsageError(Exception):
    """Bad input, printed as one line."""

class Parser(argparse.ArgumentParser):  # whole flag names only (--ou is not --out), errors in one line
    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise UsageError(message)

def method_hyperparameter(text):  # --hp KEY=NUMBER
    key, sep, value = text.partition("=")
    try:
        return key, float(value) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=NUMBER") from None

def make_parser(prog="recl.py", description="Train a continual-learning method alone and with ReCL on a stream "
                "of tasks; one JSON file per run. Defaults: Config's, NETWORKS, strategies.TUNED; a flag wins."):
    """One flag per Config field, each defaulting to None ("not given"), and the few that are not settings."""
    p = Parser(prog=prog, description=description)
    for f in (f for f in dataclasses.fields(Config) if f.metadata.get("flag")):
        kind = f.metadata["kind"] or type(f.default)
        kwargs = ({"action": "store_true" if f.name in ("validation", "paper") else argparse.BooleanOptionalAction}
                  if kind is bool else {"type": kind, "choices": f.metadata["choices"]})
        known = f.name in ("scenario", "method", "model", "dataset", "seed")  # what runs is always known
        p.add_argument(f"--{f.name.replace('_', '-')}", help=f"{f.metadata['help']} (default: {f.default})",
                       default=f.default if known else None, **kwargs)
    p.add_argument("--variant", choices=["both", "base", "recl"], help="the method alone, its replay arm, or both")
    p.add_argument("--replay-source", choices=list(SOURCES), help="what the replay arm replays: candidates fitted to "
                   "Eq. 3-6 (eq3, +ReCL), by model inversion (the control), m real training images per old class "
                   "(real: the ceiling) or each old class's mean image (centroids: the floor) (default: eq3)")
    p.add_argument("--hp", type=method_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
                   help="a method's own hyperparameter, e.g. --hp ewc_lambda=1000 (default: strategies.TUNED's)")
    p.add_argument("--seeds", type=int, help="number of seeds (default: 1)")
    p.add_argument("--save-images", action="store_true", default=None,
                   help="per task, a PNG of real images over their nearest reconstructions, and a .pt of them")
    p.add_argument("--out", default="results", help="folder for one JSON file per run (default: results)")
    p.add_argument("--quiet", action="store_true", help="print only one line per finished run")
    p.add_argument("--skip-done", action="store_true", help="skip a run whose result file exists")
    p.add_argument("--dry-run", action="store_true", help="check, then print this command if a run of it is left")
    return p

RECL_FLAGS = [k for k in RECL_FIELDS if k != "budget"] + ["paper", "replay_source", "save_images"]
first_given = lambda a, names: next((f"--{k.replace('_', '-')}" for k in names if getattr(a, k, None) is not None),
                                    None)  # the first of `names` given as a flag

def check(args, probe_out=True):
    """Refuse, in one line, what makes no sense or would do nothing, before any work starts; args.hp becomes a dict."""
    for f in dataclasses.fields(Config):  # each number a flag gives, within its field's range
        value, meta, flag = getattr(args, f.name, None), f.metadata, f"--{f.name.replace('_', '-')}"
        if value is None or isinstance(value, str) or not meta or meta["choices"]:
            continue
        if not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, got {value}")
        for bound, bad, sign in (("above", lambda b: not value > b, ">"), ("low", lambda b: not value >= b, ">="),
                                 ("high", lambda b: value > b, "<=")):
            if meta[bound] is not None and bad(meta[bound]):
                raise UsageError(f"{flag} must be {sign} {meta[bound]:g}, got {value:g}")
    a, stored = args, [*STORED, "paper"]  # what no field can say alone: (refused when, why)
    alone = "joint has none" if a.method == "joint" else "--variant base runs it alone"
    for refused, why in [
        (a.seed + (a.seeds or 1) > 2 ** 31, f"--seed plus --seeds must stay below {2 ** 31}"),
        (a.seeds is not None and not 0 < a.seeds <= 1000, f"--seeds must be from 1 to 1000, got {a.seeds}"),
        (not str(a.out).strip(), "--out is empty; it must name a folder"),
        (a.scenario == "dil" and a.classes_per_task == 1, "--classes-per-task 1 in DIL gives every task one label"),
        (a.method == "joint" and a.variant not in (None, "base"), "--variant: joint has nothing to reconstruct"),
        ((a.method == "joint" or a.variant == "base") and first_given(a, RECL_FLAGS),
         f"{first_given(a, RECL_FLAGS)} applies to the replay arm only; {alone}"),
        (a.replay_source == "inversion" and first_given(a, CONTROL),
         f"{first_given(a, CONTROL)} is part of Eq. 3-6, which the inversion control does not use"),
        (a.replay_source in ("real", "centroids") and first_given(a, stored),
         f"{first_given(a, stored)}: --replay-source {a.replay_source} stores images and reconstructs nothing"),
        (a.budget is not None and a.method == "joint", "--budget: joint trains on all tasks at once, at its own"),
        (a.ce_scope == "local" and a.variant != "recl", "--ce-scope local needs replayed rows: add --variant recl"),
        (a.ce_scope is not None and (a.scenario == "dil" or a.method == "joint"),
         "--ce-scope applies to class-incremental training after the first task"),
        (a.trials is not None and a.tuning in (None, "naive"), "--trials needs --tuning unsup or sup"),
        (a.dataset not in data.DATASETS and not a.dataset.endswith(".pt"),
         f"--dataset must be one of {', '.join(data.DATASETS)} or a .pt file, got {a.dataset!r}"),
        (a.data_root is not None and (a.dataset == "mnist" or a.dataset.endswith(".pt")),
         f"--data-root: {a.dataset} is not read from a data folder"),
        (a.device == "cuda" and not torch.cuda.is_available(), "--device cuda: no CUDA device is available")]:
        if refused:
            raise UsageError(why)
    args.hp = strategies.check_hyperparameters(args.method, args.hp, UsageError)
    if probe_out:
        data.check_writable(args.out)

def check_network(tasks, cfg):
    """Before the first task trains: a network that takes the images, and room for the candidates Step 1 optimises
    before the last task (about; models.step1_gib). data.tasks_of checked that every class has images."""
    shape = tasks[0].x_train.shape[1:]
    try:
        net = models.build_model(cfg.model, shape, len(tasks[0].classes))
    except ValueError as err:
        raise UsageError(f"--model {cfg.model}: {err}") from None
    if cfg.variant in ("recl", "inversion"):
        n = cfg.m * len(tasks[0].classes) * (len(tasks) - 1)
        need = models.step1_gib(net, shape, n)
        have = (torch.cuda.mem_get_info()[0] if cfg.device == "cuda"
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2 ** 30
        if need > have:
            raise UsageError(f"--m {cfg.m}: {n:,} candidates need about {need:,.1f} GiB, more than the {have:,.1f} "
                             f"GiB of {cfg.device} memory")

def describe(cfg):
    """A run's header: what it is, each value it uses under the one word that says where it came from (`resolve`),
    and the digest that names its file."""
    text = (f"{data.variant_name(cfg.method, cfg.variant, cfg.budget)} | {cfg.scenario} | {cfg.dataset}"
            f"{' (validation split)' if cfg.validation else ''} | {cfg.model} | seed {cfg.seed} | {cfg.device} | "
            f"{cfg.n_per_class or 'all'} per class, {cfg.classes_per_task} per task")
    training = FIELDS[FIELDS.index("lr"):FIELDS.index("hp")]  # Step 2's fields, lr to ce_scope
    settings = {**{k: getattr(cfg, k) for k in training}, **cfg.hp,
                **{k: getattr(cfg, k) for k in RECL_FIELDS if getattr(cfg, k) is not None}}
    by = {s: [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in settings.items()
              if cfg.set_by.get(k, "default") == s]
          for s in ("default", "network", "method", "paper", "control", "steps", "flag")}
    return text + "".join(f" | {s}: {', '.join(kv)}" for s, kv in by.items() if kv) + f" | config {data.digest(cfg)}"

class RunFailed(Exception):
    """A run diverged: no usable numbers, printed as one line."""

def main(argv=None):
    """Flags, checked -> a Config per seed and variant, all checked -> run_continual -> a JSON file each."""
    argv = sys.argv[1:] if argv is None else argv
    args = make_parser().parse_args(argv)
    data.provenance()  # the commit, library and machine this process runs with, read now; stored in every record
    check(args)  # the flags' ranges and combinations, --hp, a writable --out (data.check_writable)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    runs = [resolve(args, seed, variant) for seed in range(args.seed, args.seed + (args.seeds or 1))
            for variant in variants(args)]
    for cfg in runs:  # every run checked before any task trains
        tasks, class_order, mean_image, left_out = data.tasks_of(cfg)  # checked: every class has images
        check_network(tasks, cfg)
        if left_out and not args.dry_run:
            print(f"note: seed {cfg.seed} leaves out class(es) {left_out}: they fill no whole task", flush=True)
    if args.dry_run:  # run_all.sh's list (or a cluster's): this command, if a run of it has no result file yet
        if not all(data.result_path(args.out, cfg).exists() for cfg in runs):
            print(shlex.join([os.environ.get("PYTHON", "python"), "recl.py", *(a for a in argv if a != "--dry-run")]))
        return
    failed = []
    for cfg in runs:
        name, path = data.variant_name(cfg.method, cfg.variant, cfg.budget), data.result_path(args.out, cfg)
        if args.skip_done and path.exists():
            print(f"{name} {cfg.scenario} seed {cfg.seed}: done before, skipped -> {path}", flush=True)
            continue
        tasks, class_order, mean_image, left_out = data.tasks_of(cfg)  # the same tasks as checked above (cached)
        log(f"{describe(cfg)} | class order {class_order}")
        record = run_continual(cfg, tasks, log, mean_image, judge=True, image_path=path if args.save_images else None)
        pt = cfg.dataset.endswith(".pt")
        record.update(dataset=Path(cfg.dataset).stem if pt else cfg.dataset, class_order=class_order,
                      classes_left_out=left_out, config=dataclasses.asdict(cfg), digest=data.digest(cfg),
                      provenance=data.provenance(), **({"dataset_sha256": data.file_sha256(cfg.dataset)} if pt else {}))
        data.write_json_atomically(path, record)  # to a temporary name, then renamed: never half a file
        if record["diverged"]:
            failed.append(f"{name} {cfg.scenario} seed {cfg.seed}: {record['diverged']}; marked so in {path}, "
                          f"never averaged")
            continue
        bwt = "n/a" if record["BWT"] is None else f"{record['BWT']:.2f}"
        flagged = record["failed_reconstructions"]
        print(f"{name} {cfg.scenario} seed {cfg.seed}: ACC {record['ACC']:.2f} BWT {bwt} in {record['seconds']:.0f}s"
              + (f", {flagged} of {len(record['reconstructions'])} reconstructions FLAGGED (see the "
                 f"{'JSON' if args.quiet else 'log'})" if flagged else "") + f" -> {path}", flush=True)
    if failed:
        raise RunFailed("; ".join(failed))

def run_from_command_line(main, program):
    """Run `main`; the errors a user can cause end in one line and a non-zero exit."""
    try:
        main()
    except (UsageError, RunFailed, data.DataError) as err:
        sys.exit(f"{program}: error: {err}")
    except torch.OutOfMemoryError:
        sys.exit(f"{program}: error: out of memory; lower --m, --replay-batch or --batch-size")
    except KeyboardInterrupt:
        sys.exit(f"{program}: interrupted; finished runs are saved, rerun to redo the rest")

if __name__ == "__main__":
    run_from_command_line(main, "recl.py")
