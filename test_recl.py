"""Tests in the order recl.py teaches, each one claim against a reference computed another way (by hand, a formula,
a slower loop): the paper's maths (Eq. 1-6), its two loops, the departures on a trained network, the task loop; then
strategies, judging, data and networks; then the command line, run_all.sh and tools/aggregate.py.
Run with `python -m pytest -q`; everything runs on tiny problems on the CPU."""
import copy
import dataclasses
import hashlib
import json
import math
import shlex
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import grad

import data
import models
import recl
import strategies
from tools import see_eq3_work
from conftest import HERE, QUIET, aggregate_tool, command, config, resolved, run_all, synthetic_tasks

randn = lambda *shape, seed=0: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
labels_of = lambda n, k, seed=1: torch.randint(0, k, (n,), generator=torch.Generator().manual_seed(seed))
flat = lambda tensors: torch.cat([t.flatten() for t in tensors])
loader_of = lambda x, y: data.loader(x, y, 64, shuffle=False)

def mlp(in_dim=6, n_classes=2, hidden=5):
    torch.manual_seed(0)
    return models.MLP(in_dim, n_classes, hidden=hidden, first_init_scale=1.0)


# ==== 1. The paper's maths ===========================================================================================

def test_the_margin_is_the_own_logit_minus_the_best_other():
    model = nn.Linear(3, 3, bias=False)
    nn.init.eye_(model.weight)  # the logits are the inputs
    params, x = dict(model.named_parameters()), torch.tensor([[1.0, 5.0, 2.0]] * 2)
    assert recl.margins(model, params, x, torch.tensor([1, 0])).tolist() == [5.0 - 2.0, 1.0 - 5.0]

def test_candidate_labels_are_m_per_old_class_and_in_dil_m_per_class_per_old_task():
    assert recl.candidate_labels(4, 3, 2, "cil").tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert recl.candidate_labels(2, 3, 2, "dil").tolist() == [0] * 6 + [1] * 6

def test_acc_and_bwt_are_eq1_and_eq2_by_hand():
    acc, bwt = recl.acc_and_bwt([[90.0, None, None], [60.0, 80.0, None], [50.0, 70.0, 95.0]])
    assert (acc, bwt) == (pytest.approx((50 + 70 + 95) / 3), pytest.approx(((50 - 90) + (70 - 80)) / 2))

def test_eq3s_sum_in_one_backward_pass_equals_one_gradient_per_candidate():
    torch.manual_seed(0)
    model = recl.with_smooth_relu(models.MLP(12, 3, hidden=7), alpha=50.0).eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y, lam = torch.randn(6, 12), torch.arange(6) % 3, torch.rand(6)
    fast = recl.weighted_gradient_sum(model, params, x, y, lam)
    reference = recl.weighted_gradient_sum_vmap(model, params, x, y, lam)
    for k in params:
        torch.testing.assert_close(fast[k], reference[k], rtol=1e-5, atol=1e-7)

Z, S = torch.linspace(-1, 1, 9), torch.sigmoid(10.0 * torch.linspace(-1, 1, 9))

@pytest.mark.parametrize("order, expected", [(0, torch.relu(Z)), (1, S), (2, 10.0 * S * (1 - S))],
                         ids=["relu-forward", "sigmoid-backward", "its-derivative"])
def test_the_smooth_relu_is_relu_forward_with_sigmoid_alpha_z_as_its_derivative(order, expected):
    form = lambda u: recl.SmoothBackwardReLU.apply(u, 10.0)
    for _ in range(order):  # d/dz sigmoid(alpha z) = alpha s (1 - s)
        form = (lambda f: grad(lambda u: f(u).sum()))(form)
    torch.testing.assert_close(form(Z), expected)


# ==== 2. The two loops ===============================================================================================

def test_a_reconstruction_hands_back_its_lowest_loss_iterate():
    seen, x = [], randn(2, 4).requires_grad_()
    def bowl(x, lam):  # x^2 - 0.5 x: momentum carries the candidates past its bottom and back
        value = (x.pow(2) - 0.5 * x).sum()
        seen.append((value.item(), x.detach().clone()))
        return {"rec": value}
    best_x, _, report = recl.reconstruct(bowl, x, torch.rand(2), [torch.optim.SGD([x], lr=0.9, momentum=0.9)], 40,
                                         QUIET)
    lowest, kept = min(seen, key=lambda pair: pair[0])
    assert len(seen) == 41 and torch.equal(best_x, kept) and report["kept_loss"] == lowest != seen[-1][0]

@pytest.mark.parametrize("losses, flag", [([1.0, 0.5, 0.7], None), ([1.0, 0.5, 2.0], "diverged"),
                                          ([1.0, 0.5, math.inf], "diverged"), ([1.0, 1.0, 1.0], "no step")])
def test_a_reconstruction_is_flagged_when_it_diverged_or_never_improved(losses, flag):
    values, x = iter(losses), torch.zeros(3, requires_grad=True)
    L_full = lambda x, lam: {"rec": 0 * x.sum() + next(values)}
    _, _, report = recl.reconstruct(L_full, x, torch.ones(3), [torch.optim.SGD([x], lr=0.1)], 2, QUIET)
    assert report["kept_loss"] == min(losses) and (report["failed"] or "").startswith(flag or "")
    assert bool(report["failed"]) == bool(flag)

def test_a_non_finite_training_loss_stops_the_run_and_the_record_says_where():
    tasks = synthetic_tasks()
    tasks[1] = tasks[1]._replace(x_train=tasks[1].x_train * math.inf)
    record = recl.run_continual(config("base", epochs=2), tasks, QUIET)
    assert "epoch 1 of task 2" in record["diverged"] and record["ACC"] is None
    assert record["acc_matrix"][1] == [None] * 3  # it stopped there

def test_a_run_whose_every_reconstruction_failed_is_marked_diverged_and_has_no_acc():
    record = recl.run_continual(config(epochs=1, n_rec=0, m=2), synthetic_tasks(), QUIET)  # 0 steps lower nothing
    assert record["failed_reconstructions"] == len(record["reconstructions"]) == 2
    assert record["diverged"] and (record["ACC"], record["BWT"]) == (None, None)


# ==== 3. Eq. 3 and the departures, on a trained network ==============================================================

def read(model, x, cfg, last=None):
    """recl.step1 after one old task of two classes whose training images are `x`: candidates, lambdas, report."""
    task = data.Task([0, 1], x, torch.zeros(len(x), dtype=torch.long), x, None)
    candidates, labels, lam, report = recl.step1(model, [task], cfg, last, QUIET)
    assert labels.tolist() == [0] * cfg.m + [1] * cfg.m
    return candidates, lam, report

def nearest_cosine(candidates, reference):  # for each reference image, its cosine similarity to the nearest candidate
    a, b = (F.normalize(t.flatten(1), dim=1) for t in (candidates, reference))
    return (b @ a.T).max(1).values

def test_eq3_as_written_recovers_the_training_images_of_a_trained_network(trained):
    model, _, x, _ = trained
    found, _, _ = read(model, x, config("recl", "--paper", "--n-rec", "100", m=8))
    similar, chance = nearest_cosine(found, x).mean(), nearest_cosine(randn(16, 1, 28, 28), x).mean()
    assert similar > 0.5 and similar > chance + 0.4

def test_the_displacement_target_is_theta_minus_theta0_scaled_by_its_size(trained):
    model, initial, _, _ = trained
    params = {k: v.detach() for k, v in model.named_parameters()}
    target, scale = recl.displacement_target(params, model)
    by_hand = {k: params[k] - initial[k] for k in params}
    for k in params:
        torch.testing.assert_close(target[k], by_hand[k])
    assert float(scale) == pytest.approx(1 / sum(float(v.pow(2).sum()) for v in by_hand.values()), rel=1e-5)

def test_freeze_old_keeps_earlier_candidates_and_lambdas_bit_for_bit(trained):
    model, _, x, _ = trained
    earlier = randn(5, 1, 28, 28, seed=3), torch.tensor([0, 0, 1, 1, 1]), torch.rand(5)  # 2 of class 0, 3 of 1
    found, lam, report = read(model, x, config(n_rec=5, m=3, freeze_old=True), last=earlier)
    kept = torch.tensor([0, 1, 3, 4, 5])  # class 0's first two slots, class 1's three
    assert torch.equal(found[kept], earlier[0]) and torch.equal(lam[kept], earlier[2])
    assert report["optimised"] == 1

def test_the_filter_keeps_exactly_the_candidates_the_model_classifies_as_their_label(trained):
    model, _, x, y = trained  # it fits its training images: right under their labels, wrong under the others
    kept = recl.classified_as_labelled(model, torch.cat([x, x]), torch.cat([y, 1 - y]))
    assert kept.tolist() == [True] * 8 + [False] * 8

def step2_rows(x_own, x_rec, cfg):
    """What step2's batches hold in one epoch: (rows, labels, replayed)."""
    task = data.Task(None, x_own, torch.zeros(len(x_own), dtype=torch.long), None, None)
    batches, _, _ = recl.step2(task, x_rec, torch.ones(len(x_rec), dtype=torch.long), cfg, 0)
    return list(batches())

def test_replay_noise_adds_fresh_noise_of_its_std_to_the_replayed_rows_only():
    own, rec = randn(64, 1, 8, 8) * 2.0, torch.zeros(64, 1, 8, 8)
    (xb, _, replayed), = step2_rows(own, rec, config(replay_noise=0.5, batch_size=128, replay_batch=0))
    assert sorted(xb[~replayed].flatten(1).tolist()) == sorted(own.flatten(1).tolist())  # own rows unchanged
    assert xb[replayed].std().item() == pytest.approx(0.5 * own.std().item(), rel=0.05)

def test_replay_batch_draws_n_reconstructions_into_each_batch_of_the_tasks_own_images():
    own, rec = randn(10, 1, 2, 2), 100 + randn(30, 1, 2, 2)
    batches = step2_rows(own, rec, config(replay_batch=3, replay_noise=0.0, batch_size=4))
    assert [int(replayed.sum()) for _, _, replayed in batches] == [3, 3, 3]
    assert sorted(torch.cat([xb[~r] for xb, _, r in batches]).flatten(1).tolist()) == sorted(own.flatten(1).tolist())

def old_head_rows_gradient(model, own, scope):
    """The gradient on the head rows of classes 0 and 1 of step2's loss, own images of classes 2, 3, two replayed."""
    rec, y = randn(2, 1, 28, 28, seed=5), torch.tensor([2, 3, 2, 3, 0, 1])
    task = data.Task(None, own, y[:4], None, None)
    _, loss_of, _ = recl.step2(task, rec, y[4:], config(ce_scope=scope, replay_noise=0.0), 2)
    model.zero_grad()
    loss_of(model, torch.cat([own, rec]), y, torch.arange(6) >= 4)[1].backward()
    return model.head.weight.grad[:2].clone()

@pytest.mark.parametrize("scope, moves", [("all", True), ("new", False)])
def test_scoped_cross_entropy_never_lets_the_tasks_own_images_move_old_head_rows(trained, scope, moves):
    model = copy.deepcopy(trained[0])
    models.grow_head(model, 4)
    first, other = (old_head_rows_gradient(model, randn(4, 1, 28, 28, seed=s), scope) for s in (1, 2))
    assert (not torch.equal(first, other)) == moves

def test_local_cross_entropys_step_is_the_grouped_one_plus_the_heads_alone_by_hand():
    model, x, y = mlp(4, 4, hidden=3), randn(6, 4), torch.tensor([2, 3, 2, 3, 0, 1])  # four own, two replayed
    mask = torch.where((torch.arange(6) < 4)[:, None], torch.arange(4) < 2, torch.arange(4) >= 2)
    features = model.act2(model.fc2(model.act1(model.fc1(x))))
    expected = torch.autograd.grad(F.cross_entropy(model.head(features).masked_fill(mask, -math.inf), y)
                                   + F.cross_entropy(model.head(features.detach()), y), list(model.parameters()))
    _, loss = recl.scoped_cross_entropy(model, x, y, torch.arange(6) >= 4, 2, "local")
    for got, want in zip(torch.autograd.grad(loss, list(model.parameters())), expected):
        torch.testing.assert_close(got, want)

def test_adams_first_step_moves_each_pixel_and_lambda_by_its_step_size(trained):
    model, _, x, _ = trained  # a small step: it lowers the loss, so it is the iterate handed back
    cfg = config(rec_optimizer="adam", lr_x=1e-4, lr_lambda=2e-4, n_rec=1, m=2, ce_weight=0.0)
    start_x, start_lam = recl.random_start(4, (1, 28, 28), cfg.sigma_x, cfg.seed)
    found, lam, _ = read(model, x, cfg)
    moved = (found - start_x).abs()  # lr g / (|g| + eps): a few gradients are not far above eps
    assert ((moved - 1e-4).abs() < 1e-6).float().mean() > 0.99
    torch.testing.assert_close((lam - start_lam).abs(), torch.full((4,), 2e-4), rtol=1e-2, atol=0)

def test_the_inversion_controls_loss_is_cross_entropy_plus_the_prior(trained):
    model, _, _, _ = trained
    net, labels = recl.with_smooth_relu(model, 100.0), torch.tensor([0, 1] * 3)
    x = (0.7 * randn(6, 1, 28, 28)).requires_grad_()  # some pixels outside [-1, 1]: the prior has a gradient
    terms = recl.inversion_loss(net, dict(net.named_parameters()), labels)(x, None)
    by_hand = F.cross_entropy(net(x), labels, reduction="sum") + F.relu(x.abs() - 1).pow(2).sum()
    assert set(terms) == {"ce", "prior"}
    torch.testing.assert_close(torch.autograd.grad(sum(terms.values()), x)[0], torch.autograd.grad(by_hand, x)[0])


# ==== 4. The stored arms, and Sec. 4.3's search ======================================================================

def test_the_real_arm_stores_m_distinct_training_images_of_each_class_under_its_label():
    task = synthetic_tasks(per_class=10)[1]
    x, y = recl.stored_images(task, 4, centroids=False, seed=0)
    rows = [[i for i, row in enumerate(task.x_train) if torch.equal(row, xi) and task.y_train[i] == yi]
            for xi, yi in zip(x, y)]
    assert y.tolist() == [2] * 4 + [3] * 4 and all(len(r) == 1 for r in rows) and len({r[0] for r in rows}) == 8

def test_the_centroid_arm_stores_each_classes_mean_image_in_its_m_slots():
    task = synthetic_tasks(per_class=10)[1]
    x, y = recl.stored_images(task, 4, centroids=True, seed=0)
    assert y.tolist() == [2] * 4 + [3] * 4
    torch.testing.assert_close(x, torch.stack([task.x_train[task.y_train == c].mean(0) for c in y]))

def searched(monkeypatch, losses, **changes):
    """search_reconstruction (unsup, 6 trials), Step 1 giving losses(lr_x) as (first, kept): trials, kept report."""
    tried = []
    def step1(model, old_tasks, cfg, last, log):
        tried.append({k: getattr(cfg, k) for k in recl.SEARCH_SPACE if getattr(cfg, k) is not None})
        return None, None, None, dict(zip(("first_loss", "kept_loss"), losses(cfg.lr_x)))
    monkeypatch.setattr(recl, "step1", step1)
    cfg = dataclasses.replace(recl.Config(), tuning="unsup", trials=6, **changes)
    return tried, recl.search_reconstruction(None, [None], cfg, None, QUIET)[-1]

OWN = dict(sigma_x=1e-3, lr_x=3.0, lr_lambda=0.1, lambda_min=0.05, alpha=100.0)  # Config's defaults

@pytest.mark.parametrize("changes", [{}, dict(lr_lambda=None, lambda_min=None)], ids=["recl", "inversion"])
def test_the_search_tries_the_runs_own_settings_first_and_draws_only_those(monkeypatch, changes):
    tried, _ = searched(monkeypatch, lambda lr_x: (2.0, 1.0), **changes)
    own = {k: v for k, v in OWN.items() if k not in changes}
    assert len(tried) == 6 and tried[0] == own and all(hp.keys() == own.keys() for hp in tried)

def test_the_unsupervised_search_keeps_the_lowest_final_loss(monkeypatch):
    tried, report = searched(monkeypatch, lambda lr_x: (1e9, abs(math.log(lr_x / 0.1))))
    assert report["hyperparameters"] == min(tried, key=lambda hp: abs(math.log(hp["lr_x"] / 0.1)))

def test_the_search_never_keeps_a_trial_that_did_not_lower_its_loss(monkeypatch):
    tried, report = searched(monkeypatch, lambda lr_x: (0.0, 0.0) if lr_x == 3.0 else (2.0, 1.0))  # own: no progress
    assert report["hyperparameters"] == tried[1]


# ==== 5. Strategies: EWC, GPM, A-GEM, LwF, UPGD, ER ==================================================================

def test_ewc_fisher_is_the_mean_of_per_sample_squared_gradients():
    model, x, y, state = mlp(12, 3, hidden=10), randn(150, 12), labels_of(150, 3), strategies.new_state("ewc")
    strategies.ewc_after_task(model, loader_of(x, y), state)
    names, params = zip(*model.named_parameters())
    each = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(150)]
    for j, name in enumerate(names):
        torch.testing.assert_close(state["fisher"][name], sum(g[j] ** 2 for g in each) / 150, atol=1e-6, rtol=1e-4)

def test_ewc_penalty_is_half_lambda_fisher_weighted_squared_change_of_old_rows_only():
    model, x, y, state = mlp(), randn(8, 6), labels_of(8, 2), strategies.new_state("ewc")
    strategies.ewc_after_task(model, loader_of(x, y), state)
    models.grow_head(model, 4)
    model.head.weight.data += torch.tensor([[0.5], [0.5], [5.0], [5.0]])  # old rows by 0.5; new rows: free
    expected = state["ewc_lambda"] / 2 * (state["fisher"]["head.weight"] * 0.5 ** 2).sum()
    assert strategies.ewc_loss(model, x, y, None, state).item() == pytest.approx(expected.item(), rel=1e-5)

def gpm_after_two_tasks():
    model, state = mlp(20, 3, hidden=16), strategies.new_state("gpm", gpm_threshold=0.9)
    for task in range(2):  # the second task extends the bases
        x = randn(30, 20, seed=task) @ randn(20, 20, seed=task + 5) * (task + 1)
        strategies.gpm_after_task(model, loader_of(x, torch.zeros(30)), state)
    return model, state

def test_gpm_bases_are_orthonormal():
    for basis in gpm_after_two_tasks()[1]["bases"].values():
        torch.testing.assert_close(basis.T @ basis, torch.eye(basis.shape[1]), atol=1e-5, rtol=0)

def test_gpm_projected_gradient_is_orthogonal_to_the_stored_basis():
    model, state = gpm_after_two_tasks()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    strategies.gpm_after_backward(model, state)
    for name, layer in strategies.projected_layers(model).items():
        assert (layer.weight.grad @ state["bases"][name]).abs().max() < 1e-5, name

def test_extend_basis_keeps_the_thresholds_energy_with_the_fewest_vectors():
    activations = randn(10, 40) * torch.linspace(3, 0.1, 10)[:, None]
    basis, kept = strategies.extend_basis(None, activations, 0.9), lambda b: (b.T @ activations).pow(2).sum()
    assert kept(basis) >= 0.9 * activations.pow(2).sum() > kept(basis[:, :-1])  # one vector fewer is not enough

def test_agem_projects_a_conflicting_gradient_as_eq11_writes_it():  # Chaudhry et al. 2019
    model, state = mlp(), strategies.new_state("agem", agem_batch=10)
    state["memory_x"], state["memory_y"], params = randn(10, 6, seed=1), labels_of(10, 2), list(model.parameters())
    g_ref = torch.autograd.grad(F.cross_entropy(model(state["memory_x"]), state["memory_y"]), params)
    for p, r in zip(params, g_ref):
        p.grad = -r + 0.1 * randn(*r.shape, seed=2)  # against the memory's gradient
    g, g_ref = flat(p.grad for p in params), flat(g_ref)
    strategies.agem_after_backward(model, state)
    assert g @ g_ref < 0
    torch.testing.assert_close(flat(p.grad for p in params), g - (g @ g_ref) / (g_ref @ g_ref) * g_ref)

@pytest.mark.parametrize("factor", [1.0, 3.0])  # 1: the old outputs unchanged, a loss of zero
def test_lwf_loss_is_lambda_t_squared_kl_from_the_teacher_on_its_own_outputs(factor):
    model, x, lwf = mlp(), randn(8, 6), strategies.new_state("lwf", lwf_lambda=0.5, lwf_temperature=2.0)
    strategies.lwf_after_task(model, None, lwf)
    p = F.softmax(model(x).detach() / 2.0, 1)
    models.grow_head(model, 4)  # CIL: the student has more outputs than its teacher
    model.head.weight.data[:2] *= factor
    q = F.softmax(model(x)[:, :2] / 2.0, 1)
    expected = 0.5 * 2.0 ** 2 * (p * (p.log() - q.log())).sum(1).mean()
    torch.testing.assert_close(strategies.lwf_loss(model, x, None, model(x), lwf), expected, atol=1e-6, rtol=1e-4)

def test_upgd_first_step_is_gradient_plus_decay_times_one_minus_scaled_utility():
    model, state = mlp(), strategies.new_state("upgd", upgd_beta=0.9, upgd_sigma=0.0, upgd_weight_decay=0.1)
    F.cross_entropy(model(randn(8, 6)), labels_of(8, 2)).backward()
    g, w = ({k: getattr(p, kind).clone() for k, p in model.named_parameters()} for kind in ("grad", "data"))
    strategies.upgd_after_backward(model, state)
    utility = {k: (1 - 0.9) * -g[k] * w[k] for k in g}  # the running mean after one step from zero; as in Elsayed
    top = max(u.max() for u in utility.values())  # and Mahmood's code, scaled by the max of the uncorrected mean
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (g[k] + 0.1 * w[k]) * (1 - torch.sigmoid(utility[k] / (1 - 0.9) / top)))

def test_er_buffer_grows_by_its_fraction_of_each_task_and_at_least_one():
    state, sizes = strategies.new_state("er", er_fraction=0.1), []
    for n in (150, 40, 3):
        strategies.er_after_task(None, loader_of(randn(n, 2), torch.zeros(n)), state)
        sizes.append(len(state["memory_x"]))
    assert sizes == [15, 15 + 4, 15 + 4 + 1]


# ==== 6. Judging a reconstruction (App. D.5) =========================================================================

def test_ssim_of_an_image_with_itself_is_one():
    a = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(recl.ssim(a, a), torch.ones(3))

@pytest.mark.parametrize("a, b", [[torch.full((1, 1, 11, 11), v, dtype=torch.float64) for v in (0.2, 0.6)],
                                  list(torch.rand(2, 1, 1, 11, 11, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(0)))],
                         ids=["constant-0.2-and-0.6", "random"])
def test_ssim_of_one_11x11_window_is_wang_et_als_formula_with_gaussian_weights(a, b):
    w = torch.outer(*[torch.tensor([math.exp(-(i - 5) ** 2 / 4.5) for i in range(11)], dtype=torch.float64)] * 2)
    mean = lambda t: (w * t).sum() / w.sum()
    mu_a, mu_b, cov = mean(a), mean(b), mean(a * b) - mean(a) * mean(b)
    var_a, var_b = mean(a * a) - mu_a ** 2, mean(b * b) - mu_b ** 2
    expected = (2 * mu_a * mu_b + 1e-4) * (2 * cov + 9e-4) / ((mu_a ** 2 + mu_b ** 2 + 1e-4) * (var_a + var_b + 9e-4))
    assert recl.ssim(a, b).item() == pytest.approx(expected.item(), rel=1e-9)

@pytest.mark.parametrize("scale, offset", [(1.0, 0.0), (0.01, 0.3), (50.0, -2.0)])
def test_the_quality_of_copies_is_one_whatever_their_scale_and_offset(scale, offset):
    reference = F.avg_pool2d(randn(20, 1, 16, 16), 5, stride=1) * 2 - 0.1  # smooth blobs, the judge's kind of input
    quality, _ = recl.reconstruction_quality(reference, scale * reference + offset, randn(1, 12, 12, seed=1).sigmoid())
    torch.testing.assert_close(quality, torch.ones(20), atol=1e-3, rtol=0)

@pytest.fixture(scope="module")
def digits():  # the first task of 50 real digits per class, and the training mean image
    tasks, _, mean_image, _ = data.make_tasks("mnist", 0, n_per_class=50)
    return tasks[0], mean_image

def test_the_memorisation_gap_of_copies_of_training_images_is_large(digits):
    task, mean_image = digits
    q = recl.report_reconstruction("t", [task], task.x_train[::2], task.y_train[::2], recl.Config(), mean_image,
                                   log=QUIET)
    assert q["memorisation_gap"] > 0.15

def test_the_memorisation_gap_of_class_means_is_about_zero(digits):
    (task, mean_image), classes = digits, digits[0].y_train.unique()
    means = torch.stack([task.x_train[task.y_train == c].mean(0) for c in classes])
    q = recl.report_reconstruction("t", [task], means, classes, recl.Config(), mean_image, log=QUIET)
    assert abs(q["memorisation_gap"]) < 0.03


# ==== 7. Data and networks ===========================================================================================

def test_make_tasks_fixes_the_class_order_per_seed():
    order = lambda seed: data.make_tasks("mnist", seed, n_per_class=5)[1]
    assert order(3) == order(3) != order(4) and sorted(order(3)) == list(range(10))

@pytest.mark.parametrize("scenario, labels", [("cil", [3, 2, 3, 2]), ("dil", [1, 0, 1, 0])])
def test_split_into_tasks_labels_a_class_by_its_place_in_the_order(scenario, labels):
    y = torch.arange(6).repeat(2)  # class order [3, 1, 4, 0, 5, 2]: task 2 holds 4 then 0
    task = data.split_into_tasks(y.float(), y, y.float(), y, [3, 1, 4, 0, 5, 2], 2, scenario)[1]
    assert task.classes == [4, 0] and task.x_train.tolist() == [0, 4, 0, 4] and task.y_test.tolist() == labels

def test_validation_split_parts_each_tasks_training_images_four_to_one_and_never_uses_a_test_image():
    tasks = synthetic_tasks(per_class=10)
    for old, new in zip(tasks, data.validation_split(tasks, fraction=0.2, seed=0)):
        both, own = torch.cat([new.x_train, new.x_test]).flatten(1), old.x_train.flatten(1)
        assert (len(new.x_train), len(new.x_test)) == (16, 4) and torch.equal(both.sort(0).values, own.sort(0).values)

def test_the_shipped_mnist_subset_matches_its_checksum():
    digest = hashlib.sha256(data.MNIST_SUBSET.read_bytes()).hexdigest()
    assert digest == "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"

def trained_on_32_digits(name, lr, epochs=30, batch_size=32):  # two classes of 16, downsampled to 14x14
    tasks, _, _, _ = data.make_tasks("mnist", 0, 16, "cil", 2)
    x, y = F.avg_pool2d(tasks[0].x_train, 2), tasks[0].y_train
    torch.manual_seed(0)
    model = models.build_model(name, x.shape[1:], 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for xb, yb in [b for _ in range(epochs) for b in data.loader(x, y, batch_size)]:
        optimizer.zero_grad(), F.cross_entropy(model.train()(xb), yb).backward(), optimizer.step()
    return model, x, y

@pytest.mark.parametrize("name, lr", [("mlp", 0.3), ("cnn", 0.1), ("alexnet", 0.01)])
def test_each_network_fits_32_real_digits_far_below_chance_loss(name, lr):
    model, x, y = trained_on_32_digits(name, lr)  # before models.he_init, the CNN and AlexNet stayed at ln 2
    assert F.cross_entropy(model.eval()(x), y).item() < 0.1 * math.log(2)

def test_resnet18_evaluates_as_it_trained_once_update_bn_reestimates_its_statistics():
    model, x, y = trained_on_32_digits("resnet18", 0.05, epochs=3, batch_size=16)
    torch.optim.swa_utils.update_bn([(xb,) for xb, _ in data.loader(x, y, 16)], model.eval())  # as run_continual does
    with torch.no_grad():  # without update_bn it evaluates at chance, 0.5
        accuracy = [(net(x).argmax(1) == y).float().mean().item() for net in (copy.deepcopy(model).train(), model)]
    assert accuracy[0] > 0.9 and accuracy[1] >= accuracy[0] - 0.05

def test_grow_head_keeps_the_old_classes_outputs():
    model, x = mlp(10, 2), randn(4, 10)
    before = model(x)
    models.grow_head(model, 5)
    torch.testing.assert_close(model(x)[:, :2], before)


# ==== 8. A run's values: the lookup order and the header =============================================================

def test_resolve_gives_a_replay_variant_its_networks_values():
    cfg, alone = resolved("--model", "cnn"), resolved("--model", "cnn", variant="base")
    assert (cfg.n_rec, cfg.set_by["n_rec"], alone.n_rec) == (recl.NETWORKS["cnn"]["cil"]["n_rec"], "network", None)

def test_resolve_puts_the_methods_values_over_the_networks():
    cfg = resolved("--model", "cnn", "--scenario", "dil", "--method", "gpm")  # the CNN's DIL noise is 1
    assert (cfg.replay_noise, cfg.set_by["replay_noise"]) == (recl.ARMS[("dil", "gpm")]["replay_noise"], "method")

@pytest.mark.parametrize("flags, field, table", [
    (["--method", "ewc"], "lr", 0.1),  # the method's table
    (["--model", "cnn"], "lr_x", 0.01),  # a value that follows --rec-optimizer adam
    (["--model", "cnn", "--scenario", "dil"], "epochs", 40)])  # the CNN's gentle budget in DIL
def test_a_flag_given_wins_over_every_table_and_every_value_that_depends_on_others(flags, field, table):
    flag = [f"--{field.replace('_', '-')}", "7"]
    assert (getattr(resolved(*flags), field), getattr(resolved(*flags, *flag), field)) == (table, 7)

@pytest.mark.parametrize("model, scenario, method", [("mlp", "cil", "ewc"), ("cnn", "cil", "er"),
                                                    ("cnn", "dil", "gpm"), ("alexnet", "cil", "lwf")])
def test_the_method_alone_at_recls_budget_trains_as_its_recl_run_without_replay(model, scenario, method):
    flags = ("--model", model, "--scenario", scenario, "--method", method, "--budget", "recl")
    alone, arm = resolved(*flags, variant="base"), resolved(*flags)
    scope = "new" if arm.ce_scope == "local" else arm.ce_scope  # local needs replayed rows
    assert (alone.lr, alone.epochs, alone.hp, alone.ce_scope, alone.m) == (arm.lr, arm.epochs, arm.hp, scope, None)

def test_the_method_alone_at_its_own_budget_trains_otherwise():
    assert resolved("--method", "ewc", variant="base").lr != resolved("--method", "ewc", "--budget", "recl").lr

def test_a_methods_tuned_values_are_step_2_values_only():
    rows = [(method, row) for table in strategies.TUNED.values() for method, row_of in table.items()
            for row in row_of.values()]
    assert all(set(row) <= {"lr", "epochs", *strategies.defaults(method)} for method, row in rows)

def test_the_header_names_where_each_resolved_value_came_from_in_one_word():
    header = recl.describe(resolved("--model", "cnn", "--method", "ewc", "--lr-x", "0.5"))
    for part in ("| default: batch_size 64,", "| network: ce_scope local, m 20, n_rec 30,",
                 "| method: lr 0.1, epochs 20, ewc_lambda 100 |", "| steps: lr_lambda 0.01 |", "| flag: lr_x 0.5 |"):
        assert part in header

# ==== 9. The command line: refusals, result files ====================================================================

REFUSED = [  # each refused by recl.UsageError in one line that names the line's last flag
    "--seed 2147483647 --seeds 2", "--seeds 0", "--out ''", "--scenario dil --classes-per-task 1",  # combinations
    "--method joint --variant recl", "--variant base --m 5", "--replay-source inversion --lambda-min 1", "--trials 3",
    "--replay-source real --lr-x 1", "--method joint --budget recl", "--ce-scope local", "--dataset foo",
    "--scenario dil --ce-scope new", "--data-root x", *["--device cuda"] * (not torch.cuda.is_available()),
    "--m 0", "--lr nan", "--lr 1e9", "--replay-noise -1", "--lambda-min 1e30", "--sigma-x 1e30",  # ranges
    "--replay-noise 1e30", "--alpha 1e30", "--ce-weight 1e30",
    "--ou x", "--hp foo=1"]  # parser, method
last_flag = lambda line: [w for w in shlex.split(line) if w.startswith("--")][-1]

@pytest.mark.parametrize("line, error, names", [(line, recl.UsageError, last_flag(line)) for line in REFUSED] + [
    ("--n-per-class all", data.DataError, "mnist"), ("--n-per-class 1 --validation", data.DataError, "--validation"),
    ("--dataset BAD.pt --n-per-class 4", data.DataError, "BAD.pt")])
def test_bad_input_is_refused_in_one_line_before_anything_is_written(line, error, names, tmp_path, monkeypatch):
    (tmp_path / "BAD.pt").write_bytes(b"not a torch file")
    monkeypatch.setattr(recl, "run_continual", lambda *a, **k: pytest.fail("it trained"))
    argv = [str(tmp_path / w) if w == "BAD.pt" else w for w in shlex.split(line)]
    with pytest.raises(error) as refused:
        recl.main(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "out")]))
    assert names in str(refused.value) and "\n" not in str(refused.value) and not (tmp_path / "out").exists()

def test_bad_input_exits_non_zero_with_one_line_and_no_traceback():
    code, _, err = command(sys.executable, "recl.py", "--m", "0")
    assert code != 0 and len(err.splitlines()) == 1 and "Traceback" not in err

TINY = ["--n-per-class", "10", "--epochs", "1", "--n-rec", "2"]

def test_main_writes_one_json_per_run_named_by_its_config_and_skip_done_skips_it(tmp_path, monkeypatch):
    argv = [*TINY, "--out", str(tmp_path), "--quiet"]
    recl.main(argv)
    cfgs = [resolved(*argv, variant=v) for v in ("base", "recl")]
    written = {p.name: json.loads(p.read_text())["digest"] for p in tmp_path.iterdir()}
    assert written == {data.result_path(tmp_path, c).name: data.digest(c) for c in cfgs}
    monkeypatch.setattr(recl, "run_continual", lambda *a, **k: pytest.fail("it ran again"))
    recl.main(argv + ["--skip-done"])

def test_a_dry_run_prints_its_command_only_while_a_run_of_it_is_left(tmp_path, monkeypatch, capsys):
    argv, printed = [*TINY, "--out", str(tmp_path)], []
    monkeypatch.setenv("PYTHON", "py")
    for variant in ("base", "recl", None):  # before each of its two runs' files is written, and after
        recl.main(argv + ["--dry-run"])
        printed.append(capsys.readouterr().out)
        if variant:
            data.write_json_atomically(data.result_path(tmp_path, resolved(*argv, variant=variant)), {})
    assert printed == [shlex.join(["py", "recl.py", *argv]) + "\n"] * 2 + [""]

def test_a_pt_dataset_counts_by_its_contents_so_a_copy_is_the_same_run(tmp_path):
    x, y = torch.randint(0, 256, (32, 1, 8, 8), dtype=torch.uint8), torch.arange(4).repeat(8)
    for name, images in (("a.pt", x), ("other.pt", 255 - x)):
        torch.save({"x_train": images, "y_train": y, "x_test": images, "y_test": y}, tmp_path / name)
    shutil.copy(tmp_path / "a.pt", tmp_path / "copy.pt")
    digest = lambda name: data.digest(resolved("--dataset", str(tmp_path / name)))
    assert digest("a.pt") == digest("copy.pt") != digest("other.pt")


# ==== 10. run_all.sh: every run checked first, resumable =============================================================

@pytest.mark.parametrize("knobs", [{"QUICK": "2"}, {"SCENARIOS": "cil cli"}, {"RESULTS": ""},
                                   {"METHODS": "joint", "VARIANTS": "recl"}])
def test_run_alls_knobs_are_checked_before_any_run(knobs, tmp_path):
    code, out, err = run_all(**{"METHODS": "finetune", "RESULTS": str(tmp_path / "r"), **knobs})
    assert (code, out, len(err.splitlines())) == (2, "", 1) and not (tmp_path / "r").exists()

def test_a_repeated_methods_word_runs_once(tmp_path):
    code, listed, err = run_all(DRY_RUN="1", METHODS="finetune finetune", SCENARIOS="cil", VARIANTS="base", SEEDS="1",
                                RESULTS=str(tmp_path))
    assert code == 0 and len(listed.splitlines()) == 1, err

def test_a_dry_run_list_through_xargs_runs_and_then_nothing_is_left(tmp_path):
    knobs = dict(QUICK="1", SEEDS="1", METHODS="finetune", SCENARIOS="cil", VARIANTS="recl inversion",
                 RESULTS=str(tmp_path), DRY_RUN="1")  # with base, --n-rec would be refused
    code, listed, err = run_all(*TINY, **knobs)
    assert code == 0 and len(listed.splitlines()) == 2, err
    code, _, err = command("xargs", "-d", "\n", "-P", "2", "-I{}", "bash", "-c", "{}", input=listed)
    assert code == 0 and len(list(tmp_path.glob("*.json"))) == 2, err
    assert run_all(*TINY, **knobs)[:2] == (0, "")


# ==== 11. tools/aggregate.py: the paired intervals, the README's tables ==============================================

def test_the_paired_interval_is_the_t_interval_of_the_differences_by_hand():
    a = {0: 3.0, 1: 5.0, 2: 4.0, 3: 6.0, 4: 2.0}
    b = {0: 1.0, 1: 2.0, 2: 3.0, 3: 2.0, 4: 2.0, 9: 7.0}  # seed 9: unpaired
    # differences 2, 3, 1, 4, 0: mean 2, sample variance 10 / 4, t(0.975, df 4) = 2.776; 4 of 5 above 0
    half = 2.776 * math.sqrt(10 / 4) / math.sqrt(5)
    assert aggregate_tool().paired(a, b) == pytest.approx((2.0, 2.0 - half, 2.0 + half, 4, 5))

@pytest.mark.parametrize("a, bold", [({0: 1.0, 1: 1.1, 2: 0.9}, True), ({0: -1.0, 1: -1.1, 2: -0.9}, True),
                                     ({0: 1.0, 1: -1.0, 2: 2.0}, False)])
def test_a_difference_is_bold_only_when_its_interval_excludes_zero(a, bold):
    aggregate = aggregate_tool()
    low, high = aggregate.paired(a, {0: 0.0, 1: 0.0, 2: 0.0})[1:3]
    assert aggregate.difference(a, {0: 0.0, 1: 0.0, 2: 0.0}).startswith("**") == bold == (not low <= 0 <= high)

@pytest.mark.parametrize("folder, page", [("table", "README.md"), ("sealed", "docs/evidence.md"),
                                          ("cnn-arms", "docs/evidence.md")])
def test_the_shown_arm_tables_are_what_their_runs_give(folder, page, tmp_path):
    shutil.copytree(HERE / "docs/runs" / folder, tmp_path / folder)  # aggregate may write files there
    blocks = aggregate_tool().aggregate(tmp_path / folder, QUIET).split("#### ")[1:]
    rows = [line for block in blocks for line in block.split("\n\n")[1].splitlines()[2:]]
    shown = (HERE / page).read_text().splitlines()
    assert rows and [row for row in rows if row not in shown] == []

def test_the_readmes_gpm_values_are_the_tables():
    text = " ".join((HERE / "README.md").read_text().split())
    assert f'`strategies.TUNED["cil"]["gpm"]` is `{strategies.TUNED["cil"]["gpm"]}`'.replace("'", '"') in text
    assert f'`recl.ARMS[("cil", "gpm")]` is `{recl.ARMS[("cil", "gpm")]}`'.replace("'", '"') in text
    assert f"gpm_samples {strategies.defaults('gpm')['gpm_samples']} is GPM's default" in text

def test_eq3_gives_back_the_training_images_not_unseen_images_of_the_same_digits():
    # tools/see_eq3_work.py made small: 10 MNIST images, one of each digit, even against odd. Each image's SSIM with
    # its nearest candidate (App. D.5), for the training images and for as many held-out images of the same classes:
    # candidates that are the training images pass; noise or class averages fit both alike and fail
    # (docs/see-eq3-work.md).
    r = see_eq3_work.demonstrate(per_digit=1, train_steps=300, rec_steps=150, seed=0, log=QUIET)
    assert r["trained"]["mean_ssim"] > r["unseen"]["mean_ssim"] + 0.15
    assert r["trained"]["recovered"] > r["unseen"]["recovered"]
