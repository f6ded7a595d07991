"""Continual-learning strategies as small hooks that the training loop in recl.py calls:
    extra_loss(model, x, y, logits, state)       added to the batch's cross-entropy
    after_backward(model, state)                 may rewrite the .grad of parameters
    after_task(model, loader, state)             after training on a task, on its real data

`state` is a plain dict kept across tasks, starting from the method's hyperparameters (`STRATEGIES`, at the end).
ReCL needs no hook: it only adds reconstructed samples to the training data, so it composes with every strategy here.
"""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

# What tools/tune.py searches for every method on a validation split, besides the method's own grid (at the end).
TRAINING_GRID = {"lr": [0.01, 0.05, 0.1], "epochs": [10, 20, 40]}


def defaults(method):
    """A method's own hyperparameters at their literature defaults ({} for joint)."""
    return {k: spec[0] for k, spec in STRATEGIES.get(method, {}).get("hyperparameters", {}).items()}


def check_hyperparameters(method, pairs, error=ValueError):
    """(key, value) pairs from the command line as {key: value} of each default's type,
    or `error` naming the first that is unknown, not a number, or out of its range."""
    known = STRATEGIES.get(method, {}).get("hyperparameters", {})
    checked = {}
    for key, value in pairs:
        if key not in known:
            raise error(f"--hp {key}: {method} has {', '.join(known) or 'no hyperparameters'}")
        default, meaning, valid = known[key]
        whole = isinstance(default, int)
        if value is None or not math.isfinite(value) or (whole and value != int(value)) or not valid(value):
            raise error(f"--hp {key} must be {'a whole number ' if whole else ''}{meaning}, got {value}")
        checked[key] = type(default)(value)
    return checked


def new_state(method, **overrides):
    unknown = set(overrides) - set(defaults(method))
    if unknown:
        raise ValueError(f"{method} has no hyperparameter {sorted(unknown)}")
    return {**defaults(method), **overrides}


def pad_to(tensor, shape):
    """Zero-pad `tensor` at the end of each dimension up to `shape` (a grown head)."""
    return F.pad(tensor, [n for have, want in zip(reversed(tensor.shape), reversed(shape)) for n in (0, want - have)])


def sample_rows(x, y, n):
    idx = torch.randperm(len(x), device=x.device)[:n]
    return x[idx], y[idx]


def collect(loader):  # the rows of a loader's batches, concatenated
    batches = list(loader)
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def append_memory(state, x, y):
    if "memory_x" in state:
        x, y = torch.cat([state["memory_x"], x]), torch.cat([state["memory_y"], y])
    state["memory_x"], state["memory_y"] = x, y


# --- EWC: quadratic penalty weighted by the diagonal Fisher --------------------

def diagonal_fisher(model, loader, chunk=32):
    """Mean of squared per-sample log-likelihood gradients (empirical Fisher), batch by batch."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    sample_loss = lambda p, xi, yi: F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])
    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    fisher, n = {k: torch.zeros_like(v) for k, v in params.items()}, 0
    for x, y in loader:
        for xs, ys in zip(x.split(chunk), y.split(chunk)):
            for k, g in per_sample_grads(params, xs, ys).items():
                fisher[k] += g.pow(2).sum(0)
        n += len(x)
    return {k: f / n for k, f in fisher.items()}


def ewc_after_task(model, loader, state):
    # Fishers of all tasks so far add up; the anchor is the latest weights.
    fisher = diagonal_fisher(model, loader)
    for k, old in state.get("fisher", {}).items():
        fisher[k] += pad_to(old, fisher[k].shape)
    state["fisher"], state["anchor"] = fisher, {k: p.detach().clone() for k, p in model.named_parameters()}


def ewc_loss(model, x, y, logits, state):
    if "fisher" not in state:
        return 0.0
    penalty = 0.0
    for k, p in model.named_parameters():
        anchor = state["anchor"][k]
        old_part = p[tuple(slice(0, n) for n in anchor.shape)]  # only rows that existed: new head rows are free
        penalty = penalty + (state["fisher"][k] * (old_part - anchor).pow(2)).sum()
    return state["ewc_lambda"] / 2 * penalty


# --- ER: replay a small buffer of real old data alongside each batch ---------

def er_after_task(model, loader, state):
    x, y = collect(loader)
    append_memory(state, *sample_rows(x, y, max(1, round(state["er_fraction"] * len(x)))))


def er_loss(model, x, y, logits, state):
    if "memory_x" not in state:
        return 0.0
    mx, my = sample_rows(state["memory_x"], state["memory_y"], len(x))
    return F.cross_entropy(model(mx), my)


# --- A-GEM: never let a step increase the loss on the episodic memory ---------

def agem_after_task(model, loader, state):
    append_memory(state, *sample_rows(*collect(loader), state["agem_patterns_per_task"]))


def agem_after_backward(model, state):
    """If g . g_ref < 0, use g - (g . g_ref / g_ref . g_ref) g_ref (Chaudhry et al. 2019, Eq. 11)."""
    if "memory_x" not in state:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    mx, my = sample_rows(state["memory_x"], state["memory_y"], state["agem_batch"])
    g_ref = torch.cat([g.flatten() for g in torch.autograd.grad(F.cross_entropy(model(mx), my), params)])
    g = torch.cat([p.grad.flatten() for p in params])
    dot = g @ g_ref
    if dot < 0:
        g = g - dot / (g_ref @ g_ref) * g_ref
        for p, new in zip(params, g.split([p.numel() for p in params])):
            p.grad.copy_(new.view_as(p))


# --- LwF: distil the previous model's outputs on the current data ------------

def lwf_after_task(model, loader, state):
    state["teacher"] = copy.deepcopy(model).eval()


def lwf_loss(model, x, y, logits, state):
    if "teacher" not in state:
        return 0.0
    with torch.no_grad():
        old = state["teacher"](x)
    t = state["lwf_temperature"]
    new = logits[:, :old.shape[1]]  # CIL: only the outputs the teacher had
    kl = F.kl_div(F.log_softmax(new / t, 1), F.log_softmax(old / t, 1), log_target=True, reduction="batchmean")
    return state["lwf_lambda"] * t * t * kl


# --- GPM: keep gradients orthogonal to the inputs old tasks used -------------

def projected_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def layer_inputs(model, x):
    """For a batch x, each projected layer's representation matrix [rows, fan_in], rows that span what
    its weights act on: its inputs, or for a convolution every input patch (im2col; Saha et al. 2021)."""
    inputs, handles = {}, []
    for name, layer in projected_layers(model).items():
        def hook(mod, args, out, key=name):
            inputs[key] = args[0].detach()
            if isinstance(mod, nn.Conv2d):
                patches = F.unfold(inputs[key], mod.kernel_size, mod.dilation, mod.padding, mod.stride)
                inputs[key] = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        handles.append(layer.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return inputs


def extend_basis(basis, activations, threshold):
    """Grow an orthonormal basis until it holds `threshold` of the activations' energy (Saha et al. 2021, Eq. 6-9):
    project the new representation matrix R off the existing basis, take the SVD of the residual and add its top
    left singular vectors until ||projection of R||^2 / ||R||^2 reaches the threshold."""
    total = activations.pow(2).sum()
    if basis is not None:
        activations = activations - basis @ (basis.T @ activations)
    u, s, _ = torch.linalg.svd(activations, full_matrices=False)
    captured = total - s.pow(2).sum()  # energy the old basis already holds
    if captured / total >= threshold:
        return basis
    below = ((captured + s.pow(2).cumsum(0)) / total < threshold).sum()
    new = u[:, :min(int(below) + 1, len(s))]
    return new if basis is None else torch.cat([basis, new], 1)[:, :activations.shape[0]]


def gpm_after_task(model, loader, state):
    bases = state.setdefault("bases", {})
    # A random subset, as Saha et al. sample theirs: the loader is class-sorted, its first rows would be one class.
    x, y = collect(loader)
    if len(x) > state["gpm_samples"]:
        x, y = sample_rows(x, y, state["gpm_samples"])
    for name, r in layer_inputs(model, x).items():
        bases[name] = extend_basis(bases.get(name), r.T, state["gpm_threshold"])


def gpm_after_backward(model, state):
    # grad W <- grad W (I - M M^T) for every weight, kernels flattened to [out, fan_in]; biases stay free.
    for name, layer in projected_layers(model).items():
        basis = state.get("bases", {}).get(name)
        if basis is not None and layer.weight.grad is not None:
            g = layer.weight.grad.view(len(layer.weight), -1)
            g -= (g @ basis) @ basis.T


# --- UPGD: protect useful weights, perturb the others --------------------------

def upgd_after_backward(model, state):
    """Utility-perturbed gradient descent (Elsayed & Mahmood 2024), global first-order form: utility u = -grad * w (the
    loss change if w were set to 0, to first order), a running mean scaled to (0, 1) by a sigmoid of u / max(u). The
    step is (grad + noise) * (1 - scaled utility): useful weights barely move, useless ones learn and get perturbed."""
    beta = state["upgd_beta"]
    state["step"] = state.get("step", 0) + 1
    utility = state.setdefault("utility", {})
    params = [(k, p) for k, p in model.named_parameters() if p.grad is not None]
    for k, p in params:
        u = pad_to(utility[k], p.shape) if k in utility else torch.zeros_like(p)
        utility[k] = u.mul_(beta).add_(-p.grad * p.detach(), alpha=1 - beta)
    global_max = max(u.max() for u in utility.values()).clamp_min(1e-12)
    for k, p in params:
        scaled = torch.sigmoid(utility[k] / (1 - beta ** state["step"]) / global_max)  # bias-corrected
        noise = torch.randn_like(p) * state["upgd_sigma"]
        p.grad = (p.grad + state["upgd_weight_decay"] * p.detach() + noise) * (1 - scaled)


# Each method: its hooks; its hyperparameters as (literature default, valid range, its test); its grid for
# `tools/tune.py`. Its tuned values are in TUNED, below.
AT_LEAST_0 = (">= 0", lambda v: v >= 0)
POSITIVE = ("> 0", lambda v: v > 0)
FRACTION = ("in (0, 1]", lambda v: 0 < v <= 1)
STRATEGIES = {
    "finetune": {"hooks": {}, "hyperparameters": {}, "grid": {}},
    "ewc": {"hooks": {"extra_loss": ewc_loss, "after_task": ewc_after_task},               # Kirkpatrick et al. 2017
            "hyperparameters": {"ewc_lambda": (100.0, *AT_LEAST_0)},
            "grid": {"ewc_lambda": [10.0, 100.0, 1000.0, 10000.0]}},
    "er": {"hooks": {"extra_loss": er_loss, "after_task": er_after_task},
           "hyperparameters": {"er_fraction": (0.1, *FRACTION)},                       # buffer: paper App. D.2
           "grid": {}},  # the buffer is a memory budget, fixed like the paper's, not tuned
    "upgd": {"hooks": {"after_backward": upgd_after_backward},                          # Elsayed & Mahmood 2024
             "hyperparameters": {"upgd_beta": (0.999, "in [0, 1)", lambda v: 0 <= v < 1),
                                 "upgd_sigma": (0.001, *AT_LEAST_0), "upgd_weight_decay": (0.0, *AT_LEAST_0)},
             "grid": {"upgd_beta": [0.9, 0.99, 0.999], "upgd_sigma": [0.0001, 0.001, 0.01]}},
    "agem": {"hooks": {"after_backward": agem_after_backward, "after_task": agem_after_task},  # Chaudhry et al. 2019
             "hyperparameters": {"agem_patterns_per_task": (50, *POSITIVE), "agem_batch": (256, *POSITIVE)},
             "grid": {"agem_patterns_per_task": [25, 50, 100]}},
    "lwf": {"hooks": {"extra_loss": lwf_loss, "after_task": lwf_after_task},
            "hyperparameters": {"lwf_lambda": (1.0, *AT_LEAST_0), "lwf_temperature": (2.0, *POSITIVE)},  # Li & Hoiem
            "grid": {"lwf_lambda": [0.5, 1.0, 2.0, 5.0], "lwf_temperature": [1.0, 2.0, 4.0]}},
    "gpm": {"hooks": {"after_backward": gpm_after_backward, "after_task": gpm_after_task},
            "hyperparameters": {"gpm_threshold": (0.99, *FRACTION), "gpm_samples": (300, *POSITIVE)},  # Saha et al.
            "grid": {"gpm_threshold": [0.9, 0.95, 0.97, 0.99]}},
    "joint": {"hooks": {}, "hyperparameters": {},  # the upper bound: every task at once (recl.run_jointly)
              "grid": {"epochs": [20, 40, 80, 160]}},  # time to fit all tasks
}

# Each method's lr, epochs and hyperparameters per scenario, chosen on validation (docs/hyperparameters.md): "alone"
# at its own training budget, and what "recl", the harder budget its +ReCL variant trains at, changes: ReCL reads
# back only what the network has fitted (docs/departures.md, "training budget"). The rest: Config's, and the above.
TUNED = {"cil": {
    "finetune": {"alone": {"lr": 0.01, "epochs": 10}, "recl": {"lr": 0.1, "epochs": 20}},
    "ewc": {"alone": {"lr": 0.01, "epochs": 20, "ewc_lambda": 1000.0}, "recl": {"lr": 0.1, "ewc_lambda": 100.0}},
    "er": {"alone": {"lr": 0.05, "epochs": 20}, "recl": {"lr": 0.1}},
    "upgd": {"alone": {"lr": 0.01, "epochs": 10, "upgd_beta": 0.99, "upgd_sigma": 0.001},
             "recl": {"lr": 0.1, "epochs": 20}},
    "agem": {"alone": {"lr": 0.05, "epochs": 40, "agem_patterns_per_task": 100}, "recl": {"lr": 0.1, "epochs": 20}},
    "lwf": {"alone": {"lr": 0.01, "epochs": 20, "lwf_lambda": 0.5, "lwf_temperature": 4.0}, "recl": {"lr": 0.1}},
    "gpm": {"alone": {"lr": 0.01, "epochs": 20, "gpm_threshold": 0.9}, "recl": {"lr": 0.1}},
    "joint": {"alone": {"lr": 0.1, "epochs": 80}},
}, "dil": {
    "finetune": {"alone": {"lr": 0.01, "epochs": 10}, "recl": {"lr": 0.05, "epochs": 20}},
    "ewc": {"alone": {"lr": 0.01, "epochs": 20, "ewc_lambda": 10000.0}, "recl": {"lr": 0.05, "ewc_lambda": 100.0}},
    "er": {"alone": {"lr": 0.1, "epochs": 10}, "recl": {"lr": 0.05, "epochs": 20}},
    "upgd": {"alone": {"lr": 0.01, "epochs": 20, "upgd_beta": 0.99, "upgd_sigma": 0.0001}, "recl": {"lr": 0.1}},
    "agem": {"alone": {"lr": 0.05, "epochs": 40, "agem_patterns_per_task": 50}, "recl": {"lr": 0.1, "epochs": 20}},
    "lwf": {"alone": {"lr": 0.05, "epochs": 20, "lwf_lambda": 2.0, "lwf_temperature": 2.0},
            "recl": {"lwf_lambda": 0.5}},
    "gpm": {"alone": {"lr": 0.1, "epochs": 20, "gpm_threshold": 0.9}, "recl": {}},
    "joint": {"alone": {"lr": 0.1, "epochs": 40}},
}}

# A method's values on its replay arms, over the network's, by (scenario, method) for every arm and (scenario, method,
# arm) for one; not under --paper. GPM replays without noise: its projection lets a layer learn only outside the old
# tasks' input space, where noise trains directions real images never use; its centroids in CIL keep the noise
# (docs/evidence.md, the arms' knobs). ER keeps CE over all classes: its real images already teach old against new
# (docs/networks.md, "The settings").
ARMS = {("cil", "er"): {"ce_scope": "all"}, ("cil", "gpm"): {"replay_noise": 0.0},
        ("dil", "gpm"): {"replay_noise": 0.0}, ("cil", "gpm", "centroids"): {"replay_noise": 2.5}}
