"""Continual-learning methods, each a STRATEGIES entry (at the end): hooks that recl.py's training loop calls (their
contract and `state`: its docstring), hyperparameters, a grid. ReCL needs no hook (it only adds training samples)."""
import copy
import math

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

def defaults(method):  # a method's own hyperparameters at their literature defaults ({} for joint)
    return {k: spec[0] for k, spec in STRATEGIES.get(method, {}).get("hyperparameters", {}).items()}

def check_hyperparameters(method, pairs, error=ValueError):  # --hp's pairs as {key: value}; `error` at the first bad
    known, checked = STRATEGIES.get(method, {}).get("hyperparameters", {}), {}
    for key, value in pairs:
        if key not in known:
            raise error(f"--hp {key}: {method} has {', '.join(known) or 'no hyperparameters'}")
        (default, meaning, valid), whole = known[key], isinstance(known[key][0], int)
        if value is None or not math.isfinite(value) or (whole and value != int(value)) or not valid(value):
            raise error(f"--hp {key} must be {'a whole number ' if whole else ''}{meaning}, got {value}")
        checked[key] = type(default)(value)
    return checked

def new_state(method, **overrides):  # the state its hooks start from
    if unknown := set(overrides) - set(defaults(method)):
        raise ValueError(f"{method} has no hyperparameter {sorted(unknown)}")
    return {**defaults(method), **overrides}

def pad_to(tensor, shape):  # zero-pad each dimension at its end up to `shape`: a grown head's old values
    return F.pad(tensor, [n for have, want in zip(reversed(tensor.shape), reversed(shape)) for n in (0, want - have)])

def sample_rows(x, y, n):  # n random rows (all if fewer), drawn from the global RNG
    return x[idx := torch.randperm(len(x), device=x.device)[:n]], y[idx]

# --- EWC (Kirkpatrick et al. 2017, Eq. 3): lambda/2 sum_i F_i (theta_i - theta*_i)^2, theta*: the last task's weights
def ewc_after_task(model, loader, state):  # F: the empirical Fisher's diagonal, summed over the tasks so far
    params = {k: v.detach() for k, v in model.named_parameters()}  # a task's F_i: its mean squared per-sample gradient
    grads = vmap(grad(lambda p, xi, yi: F.cross_entropy(functional_call(model, p, xi[None]), yi[None])), (None, 0, 0))
    fisher, n, old = {k: torch.zeros_like(v) for k, v in params.items()}, 0, state.get("fisher", {})
    for x, y in loader:
        for xs, ys in zip(x.split(32), y.split(32)):  # chunks of 32 bound the memory of vmap
            n, fisher = n + len(xs), {k: fisher[k] + g.pow(2).sum(0) for k, g in grads(params, xs, ys).items()}
    state["fisher"] = {k: f / n + pad_to(old[k], f.shape) if k in old else f / n for k, f in fisher.items()}
    state["anchor"] = {k: p.detach().clone() for k, p in model.named_parameters()}

def ewc_loss(model, x, y, logits, state):  # 0 before the first task's end; rows a head grew since are free
    penalty = [(state["fisher"][k] * (model.get_parameter(k)[tuple(map(slice, anchor.shape))] - anchor).pow(2)).sum()
               for k, anchor in state.get("anchor", {}).items()]
    return state["ewc_lambda"] / 2 * sum(penalty)

# --- ER (Chaudhry et al. 2019, "On tiny episodic memories"): each batch adds the cross-entropy of as many memory rows
def remember(state, x, y, n):  # add n random rows of (x, y) to the episodic memory (ER's and A-GEM's)
    for key, rows in zip(("memory_x", "memory_y"), sample_rows(x, y, n)):
        state[key] = torch.cat([state.get(key, rows[:0]), rows])

def er_after_task(model, loader, state):  # the memory keeps er_fraction of each task's real rows (ReCL's App. D.2)
    x, y = map(torch.cat, zip(*loader))
    remember(state, x, y, max(1, round(state["er_fraction"] * len(x))))

def memory_ce(model, state, n):  # the cross-entropy of n random rows of the episodic memory
    mx, my = sample_rows(state["memory_x"], state["memory_y"], n)
    return F.cross_entropy(model(mx), my)

def er_loss(model, x, y, logits, state):
    return memory_ce(model, state, len(x)) if "memory_x" in state else 0.0

# --- A-GEM (Chaudhry et al. 2019, Eq. 11): if g . g_ref < 0 (g_ref: on memory), step along g - g.g_ref/|g_ref|^2 g_ref
def agem_after_task(model, loader, state):  # the memory keeps agem_patterns_per_task of each task's real rows
    remember(state, *map(torch.cat, zip(*loader)), state["agem_patterns_per_task"])

def agem_after_backward(model, state):
    if "memory_x" not in state:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    g_ref = torch.cat([g.flatten() for g in torch.autograd.grad(memory_ce(model, state, state["agem_batch"]), params)])
    g = torch.cat([p.grad.flatten() for p in params])
    if (dot := g @ g_ref) < 0:  # the step would raise the memory's loss: the projection goes into the .grad
        torch.nn.utils.vector_to_parameters(g - dot / (g_ref @ g_ref) * g_ref, [p.grad for p in params])

# --- LwF (Li & Hoiem 2017): distil the previous model's outputs on the current data, lambda T^2 KL at temperature T
def lwf_after_task(model, loader, state):
    state["teacher"] = copy.deepcopy(model).eval().requires_grad_(False)  # frozen: its outputs are targets

def lwf_loss(model, x, y, logits, state):  # CIL: only the outputs the teacher had
    if "teacher" not in state:
        return 0.0
    old, t = state["teacher"](x), state["lwf_temperature"]
    return state["lwf_lambda"] * t * t * F.kl_div(F.log_softmax(logits[:, :old.shape[1]] / t, 1),
                                                  F.log_softmax(old / t, 1), log_target=True, reduction="batchmean")

# --- GPM (Saha et al. 2021, Eq. 6-9): each layer's basis M of its inputs; grad W <- grad W (I - M M^T), W [out, fan_in]
def projected_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}

def extend_basis(basis, activations, threshold):
    """Add top left singular vectors of R = activations off `basis` until it holds `threshold` of R's energy."""
    total = activations.pow(2).sum()
    residual = activations if basis is None else activations - basis @ (basis.T @ activations)
    u, s, _ = torch.linalg.svd(residual, full_matrices=False)
    captured = total - s.pow(2).sum()  # energy the old basis already holds
    if captured / total >= threshold:
        return basis
    new = u[:, :min(int(((captured + s.pow(2).cumsum(0)) / total < threshold).sum()) + 1, len(s))]  # fewest to reach it
    return new if basis is None else torch.cat([basis, new], 1)[:, :activations.shape[0]]

def gpm_after_task(model, loader, state):  # on a random subset, as Saha et al. sample theirs (the loader is by class)
    bases, inputs, (x, y) = state.setdefault("bases", {}), {}, map(torch.cat, zip(*loader))
    x = sample_rows(x, y, state["gpm_samples"])[0] if len(x) > state["gpm_samples"] else x
    handles = [layer.register_forward_hook(lambda mod, args, out, key=name: inputs.update({key: args[0].detach()}))
               for name, layer in projected_layers(model).items()]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    for name, r in inputs.items():
        if isinstance(conv := model.get_submodule(name), torch.nn.Conv2d):  # its rows: every input patch (im2col)
            r = F.unfold(r, conv.kernel_size, conv.dilation, conv.padding, conv.stride).transpose(1, 2).flatten(0, 1)
        bases[name] = extend_basis(bases.get(name), r.T, state["gpm_threshold"])

def gpm_after_backward(model, state):  # biases stay free
    for name, layer in projected_layers(model).items():
        if (basis := state.get("bases", {}).get(name)) is not None and layer.weight.grad is not None:
            g = layer.weight.grad.view(len(layer.weight), -1)
            g -= (g @ basis) @ basis.T

# --- UPGD (Elsayed & Mahmood 2024), global first-order form: step (grad + weight decay + noise) * (1 - scaled utility)
def upgd_after_backward(model, state):  # utility u = -grad * w: to first order, the loss change if w were set to 0
    beta, utility, state["step"] = state["upgd_beta"], state.setdefault("utility", {}), state.get("step", 0) + 1
    params = [(k, p) for k, p in model.named_parameters() if p.grad is not None]
    for k, p in params:  # a running mean of u
        u = pad_to(utility[k], p.shape) if k in utility else torch.zeros_like(p)
        utility[k] = u.mul_(beta).add_(-p.grad * p.detach(), alpha=1 - beta)
    global_max = max(u.max() for u in utility.values()).clamp_min(1e-12)
    for k, p in params:  # scaled to (0, 1) by a sigmoid of u / max u, bias-corrected: useful weights barely move
        free = 1 - torch.sigmoid(utility[k] / (1 - beta ** state["step"]) / global_max)
        p.grad = (p.grad + state["upgd_weight_decay"] * p.detach() + torch.randn_like(p) * state["upgd_sigma"]) * free

TRAINING_GRID = {"lr": [0.01, 0.05, 0.1], "epochs": [10, 20, 40]}  # tools/tune.py searches it besides a method's grid
# Each method's hooks, hyperparameters as (literature default, valid range, its test) and grid for tools/tune.py.
AT_LEAST_0, POSITIVE = (">= 0", lambda v: v >= 0), ("> 0", lambda v: v > 0)
FRACTION, BELOW_1 = ("in (0, 1]", lambda v: 0 < v <= 1), ("in [0, 1)", lambda v: 0 <= v < 1)
STRATEGIES = {
    "finetune": {"hooks": {}, "hyperparameters": {}, "grid": {}},  # plain SGD, no hook: the lower bound
    "ewc": {"hooks": {"extra_loss": ewc_loss, "after_task": ewc_after_task},
            "hyperparameters": {"ewc_lambda": (100.0, *AT_LEAST_0)}, "grid": {"ewc_lambda": [1e1, 1e2, 1e3, 1e4]}},
    "er": {"hooks": {"extra_loss": er_loss, "after_task": er_after_task},
           "hyperparameters": {"er_fraction": (0.1, *FRACTION)}, "grid": {}},  # a memory budget, fixed, not tuned
    "upgd": {"hooks": {"after_backward": upgd_after_backward}, "hyperparameters": {"upgd_beta": (0.999, *BELOW_1),
             "upgd_sigma": (0.001, *AT_LEAST_0), "upgd_weight_decay": (0.0, *AT_LEAST_0)},
             "grid": {"upgd_beta": [0.9, 0.99, 0.999], "upgd_sigma": [0.0001, 0.001, 0.01]}},
    "agem": {"hooks": {"after_backward": agem_after_backward, "after_task": agem_after_task},
             "hyperparameters": {"agem_patterns_per_task": (50, *POSITIVE), "agem_batch": (256, *POSITIVE)},
             "grid": {"agem_patterns_per_task": [25, 50, 100]}},
    "lwf": {"hooks": {"extra_loss": lwf_loss, "after_task": lwf_after_task},
            "hyperparameters": {"lwf_lambda": (1.0, *AT_LEAST_0), "lwf_temperature": (2.0, *POSITIVE)},
            "grid": {"lwf_lambda": [0.5, 1.0, 2.0, 5.0], "lwf_temperature": [1.0, 2.0, 4.0]}},
    "gpm": {"hooks": {"after_backward": gpm_after_backward, "after_task": gpm_after_task},
            "hyperparameters": {"gpm_threshold": (0.99, *FRACTION), "gpm_samples": (300, *POSITIVE)},
            "grid": {"gpm_threshold": [0.9, 0.95, 0.97, 0.99]}},
    "joint": {"hooks": {}, "hyperparameters": {}, "grid": {"epochs": [20, 40, 80, 160]}},  # all tasks at once
}

# Each method's lr, epochs and hyperparameters per scenario, chosen on validation (docs/hyperparameters.md): "alone" at
# its own budget, "recl" what changes at its +ReCL variant's harder one (docs/departures.md); else Config's, defaults().
TUNED = {"cil": {
    "finetune": {"alone": dict(lr=0.01, epochs=10), "recl": dict(lr=0.1, epochs=20)},
    "ewc": {"alone": dict(lr=0.01, epochs=20, ewc_lambda=1000.0), "recl": dict(lr=0.1, ewc_lambda=100.0)},
    "er": {"alone": dict(lr=0.05, epochs=20), "recl": dict(lr=0.1)},
    "upgd": {"alone": dict(lr=0.01, epochs=10, upgd_beta=0.99, upgd_sigma=0.001), "recl": dict(lr=0.1, epochs=20)},
    "agem": {"alone": dict(lr=0.05, epochs=40, agem_patterns_per_task=100), "recl": dict(lr=0.1, epochs=20)},
    "lwf": {"alone": dict(lr=0.01, epochs=20, lwf_lambda=0.5, lwf_temperature=4.0), "recl": dict(lr=0.1)},
    "gpm": {"alone": dict(lr=0.01, epochs=20, gpm_threshold=0.9), "recl": dict(lr=0.1)},
    "joint": {"alone": dict(lr=0.1, epochs=80)},
}, "dil": {
    "finetune": {"alone": dict(lr=0.01, epochs=10), "recl": dict(lr=0.05, epochs=20)},
    "ewc": {"alone": dict(lr=0.01, epochs=20, ewc_lambda=10000.0), "recl": dict(lr=0.05, ewc_lambda=100.0)},
    "er": {"alone": dict(lr=0.1, epochs=10), "recl": dict(lr=0.05, epochs=20)},
    "upgd": {"alone": dict(lr=0.01, epochs=20, upgd_beta=0.99, upgd_sigma=0.0001), "recl": dict(lr=0.1)},
    "agem": {"alone": dict(lr=0.05, epochs=40, agem_patterns_per_task=50), "recl": dict(lr=0.1, epochs=20)},
    "lwf": {"alone": dict(lr=0.05, epochs=20, lwf_lambda=2.0, lwf_temperature=2.0), "recl": dict(lwf_lambda=0.5)},
    "gpm": {"alone": dict(lr=0.1, epochs=20, gpm_threshold=0.9), "recl": {}},
    "joint": {"alone": dict(lr=0.1, epochs=40)},
}}
