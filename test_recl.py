"""Tests in the order the code teaches, each one claim against a reference: the paper's maths
(Eq. 1-6), its two loops, the departures, the task loop on trained networks; then data,
networks, strategies and judging; then the command line, run_all.sh and the tools.
Run with `python -m pytest -q`; everything runs on tiny problems on the CPU."""
import copy
import dataclasses
import gzip
import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.func import grad

import config
import data
import judging
import models
import recl
import strategies
from conftest import (HERE, QUIET, command, displaced, fake_record, nearest_cosine, resolved, run_all, run_config,
                      small_batch_norm_net, step1, synthetic_tasks, train)

# ==== 1. The paper's maths ==================================================================================

def test_the_margin_is_the_own_logit_minus_the_best_other():
    model = nn.Linear(3, 3, bias=False)
    nn.init.eye_(model.weight)
    params, x = dict(model.named_parameters()), torch.tensor([[1.0, 5.0, 2.0]] * 2)
    assert recl.margins(model, params, x, torch.tensor([1, 0])).tolist() == [3.0, -4.0]


def test_candidate_labels_are_m_per_old_class_and_in_dil_m_per_class_per_old_task():
    assert recl.candidate_labels(4, 3, 2, "cil").tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert recl.candidate_labels(2, 3, 2, "dil").tolist() == [0] * 6 + [1] * 6


def test_acc_and_bwt_are_eq1_and_eq2_by_hand():
    acc, bwt = recl.acc_and_bwt([[90.0, None, None], [60.0, 80.0, None], [50.0, 70.0, 95.0]])
    assert (acc, bwt) == (pytest.approx((50 + 70 + 95) / 3), pytest.approx(((50 - 90) + (70 - 80)) / 2))


def small_problem(n=6):
    torch.manual_seed(0)
    model = models.with_smooth_relu(models.MLP(12, 3, hidden=7), alpha=50.0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return model, params, torch.randn(n, 12), torch.arange(n) % 3, torch.rand(n)


def test_eq3s_sum_in_one_backward_equals_one_gradient_per_candidate():
    model, params, x, y, lam = small_problem()
    fast, literal = recl.weighted_gradient_sum(model, params, x, y, lam), recl.weighted_gradient_sum_vmap(
        model, params, x, y, lam)
    each = [grad(lambda p: recl.margins(model, p, x[i:i + 1], y[i:i + 1])[0])(params) for i in range(len(x))]
    for k in params:
        by_loop = sum(lam[i] * each[i][k] for i in range(len(x))) / len(x)
        torch.testing.assert_close(fast[k], by_loop, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(literal[k], by_loop, rtol=1e-5, atol=1e-7)


def test_taking_the_fixed_candidates_share_off_the_target_once_gives_the_same_loss_and_gradients():
    model, params, x, y, lam = small_problem()
    target = {k: torch.randn_like(v) for k, v in params.items()}
    fixed = torch.tensor([True, True, False, True, False, False])
    free_x, free_lam = x[~fixed].clone().requires_grad_(), lam[~fixed].clone().requires_grad_()
    rest = recl.less_share_of(model, params, target, x[fixed], y[fixed], lam[fixed], 6)
    once = recl.stationarity_loss(model, params, y[~fixed], rest, 0.05, n=6)(free_x, free_lam)["rec"]
    all_x, all_lam = x.clone(), lam.clone()
    all_x[~fixed], all_lam[~fixed] = free_x, free_lam
    whole = recl.stationarity_loss(model, params, y, target, 0.05)(all_x, all_lam)["rec"]
    torch.testing.assert_close(once, whole, rtol=1e-5, atol=0)
    for a, b in zip(torch.autograd.grad(once, (free_x, free_lam)), torch.autograd.grad(whole, (free_x, free_lam))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_the_displacement_target_is_theta_minus_theta0_scaled_by_its_size():
    model = models.remember_start(models.MLP(4, 2, hidden=3))
    params = {k: v + 0.5 for k, v in model.start.items()}
    target, scale = recl.displacement_target(params, model)
    assert all(torch.allclose(v, torch.full_like(v, 0.5)) for v in target.values())
    assert float(scale) == pytest.approx(1 / (0.25 * sum(v.numel() for v in params.values())))
    with pytest.raises(ValueError, match="initial weights"):
        recl.displacement_target(params, models.MLP(4, 2, hidden=3))


def test_the_relative_l_rec_is_the_share_of_the_displacement_left_unexplained():
    torch.manual_seed(0)
    model = models.remember_start(models.MLP(4, 2, hidden=3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, labels, lam = torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 0]), torch.rand(5)
    combination = recl.weighted_gradient_sum(model, params, x, labels, lam)
    model.start = {k: params[k] - combination[k] for k in params}  # theta - theta_0 is exactly that combination
    target, scale = recl.displacement_target(params, model)
    share = lambda lam_: float(recl.stationarity_loss(model, params, labels, target, 0.0, scale=scale)(x, lam_)["rec"])
    assert (share(torch.zeros(5)), share(0.5 * lam), share(lam)) == (
        pytest.approx(1.0), pytest.approx(0.25, rel=1e-4), pytest.approx(0.0, abs=1e-6))


def ce_and_prior_gradient(model, x, labels, alpha, prior=1.0):
    """By hand: the gradient of sum_i CE(f(x_i), y_i) (+ L_prior) in the candidates."""
    x = x.clone().requires_grad_()
    loss = F.cross_entropy(models.with_smooth_relu(model, alpha)(x), labels, reduction="sum")
    return torch.autograd.grad(loss + prior * F.relu(x.abs() - 1).pow(2).sum(), x)[0]


def test_the_inversion_controls_loss_is_cross_entropy_plus_the_prior():
    torch.manual_seed(0)
    model, labels = displaced(models.remember_start(models.MLP(16, 3, hidden=12))), torch.tensor([0, 1, 2] * 2)
    net = models.with_smooth_relu(model, 100.0)
    x = (0.7 * torch.randn(6, 16)).requires_grad_()  # some pixels outside [-1, 1]: the prior has a gradient
    terms = recl.inversion_loss(net, dict(net.named_parameters()), labels)(x, None)
    assert set(terms) == {"ce", "prior"}
    torch.testing.assert_close(torch.autograd.grad(sum(terms.values()), x)[0],
                               ce_and_prior_gradient(model, x.detach(), labels, 100.0))


def test_the_inversion_term_adds_its_weight_times_the_cross_entropys_gradient():
    torch.manual_seed(0)
    model, labels = displaced(models.remember_start(models.MLP(16, 3, hidden=12))), torch.tensor([0, 1, 2] * 2)
    net = models.with_smooth_relu(model, 100.0)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, lam = torch.randn(6, 16).requires_grad_(), torch.rand(6)
    eq6 = recl.stationarity_loss(net, params, labels, params, 0.05)
    plain, mixed = eq6(x, lam), recl.plus_inversion_term(eq6, net, params, labels, 0.25)(x, lam)
    assert set(mixed) == {"rec", "lambda", "prior", "ce"}
    difference = torch.autograd.grad(sum(mixed.values()), x)[0] - torch.autograd.grad(sum(plain.values()), x)[0]
    torch.testing.assert_close(difference, 0.25 * ce_and_prior_gradient(model, x.detach(), labels, 100.0, 0))


# ==== 2. The two loops ======================================================================================

def bowl(seen):
    """x^2 - 0.5 x, summed: momentum carries the candidates past its bottom and back."""
    def L_full(x, lam):
        value = (x.pow(2) - 0.5 * x).sum()
        seen.append((value.item(), x.detach().clone()))
        return {"rec": value}
    return L_full


@pytest.mark.parametrize("steps", [1, 5, 40])
def test_a_reconstruction_hands_back_its_lowest_loss_iterate_the_last_steps_included(steps):
    seen, x = [], torch.randn(2, 4).requires_grad_()
    best_x, _, report = recl.reconstruct(bowl(seen), x, torch.rand(2), [torch.optim.SGD([x], lr=0.9, momentum=0.9)],
                                         steps, QUIET)
    lowest, kept = min(seen, key=lambda pair: pair[0])
    assert len(seen) == steps + 1 and torch.equal(best_x, kept)
    assert (report["kept_loss"], report["last_step_loss"]) == (lowest, seen[-1][0])


@pytest.mark.parametrize("losses, failed", [
    ([1.0, 0.5, 0.7], None), ([1.0, 0.5, 2.0], "diverged: the last step's loss 2 is above the start's 1"),
    ([1.0, 1.0, 1.0], "no step lowered the loss"), ([1.0, 0.5, math.inf], "diverged at step 2")])
def test_a_reconstruction_is_flagged_when_it_diverged_or_never_improved(losses, failed):
    lowest = min(v for v in losses if math.isfinite(v))
    report = recl.reconstruction_report(losses, (lowest, None, None, {"rec": torch.tensor(lowest)}),
                                        {"rec": torch.tensor(losses[0])})
    assert report["failed"] == failed


def test_a_reconstruction_that_overflows_hands_back_its_start():
    x = torch.randn(8, 16)
    start, free = x.clone(), x.clone().requires_grad_()
    best_x, _, report = recl.reconstruct(lambda x, lam: {"rec": x.pow(2).sum()}, free, torch.rand(8),
                                         [torch.optim.SGD([free], lr=2.0, momentum=0.9)], 500, QUIET)
    assert torch.equal(best_x, start) and report["failed"].startswith("diverged") and report["steps"] < 500


def test_a_reconstruction_prints_its_progress_at_each_quarter():
    lines, x = [], torch.randn(2).requires_grad_()
    recl.reconstruct(bowl([]), x, torch.rand(2), [torch.optim.SGD([x], lr=0.1)], 8, lines.append)
    assert [line.split(":")[0].strip() for line in lines] == ["step 2/8", "step 4/8", "step 6/8"]


def test_a_training_step_is_sgd_on_the_cross_entropy():
    torch.manual_seed(0)
    model, x, y = nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), torch.randn(6, 1, 2, 2), torch.tensor([0, 1, 2] * 2)
    expected = copy.deepcopy(model)
    F.cross_entropy(expected(x), y).backward()
    train(model, x, y, run_config("base", epochs=1, batch_size=6, lr=0.5))
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q - 0.5 * q.grad)


def test_a_non_finite_training_loss_stops_the_run_and_says_where():
    model, x, y = nn.Sequential(nn.Flatten(), nn.Linear(4, 2)), torch.randn(4, 1, 2, 2), torch.tensor([0, 1] * 2)
    with pytest.raises(recl.Diverged, match="in epoch 1"):
        train(model, x * math.inf, y, run_config("base", epochs=2, batch_size=4))


# ==== 3. On trained networks: reconstruction recovers data ==================================================

def test_eq3_as_written_recovers_training_images(trained_on_eight_digits):
    model, x = trained_on_eight_digits
    found, _, _ = step1(model, recl.candidate_labels(2, 8, 1, "cil"), (1, 28, 28), run_config(n_rec=100, paper=True))
    similar, chance = nearest_cosine(found, x).mean(), nearest_cosine(torch.randn(16, 1, 28, 28), x).mean()
    assert similar > 0.5 and similar > chance + 0.4  # margins: docs/test-margins.md


def test_the_displacement_is_nearly_a_combination_of_margin_gradients_and_theta_is_not(trained_on_eight_digits):
    model, _ = trained_on_eight_digits
    labels, left = recl.candidate_labels(2, 8, 1, "cil"), {}
    for name, cfg in (("theta", run_config(n_rec=100, paper=True)),
                      ("displacement", run_config(n_rec=100, rec_target="displacement", ce_weight=0.0))):
        report = step1(model, labels, (1, 28, 28), cfg)[2]
        left[name] = report["kept_terms"]["rec"] / report["first_terms"]["rec"]
    assert left["displacement"] < 0.1 < 0.5 < left["theta"], left


def test_bfloat16_products_fit_the_displacement_as_well_as_float32(trained_on_eight_digits):
    model, x = trained_on_eight_digits
    found, left = {}, {}
    for precision in ("float32", "bfloat16"):
        cfg = run_config(n_rec=100, rec_target="displacement", rec_precision=precision)
        found[precision], _, report = step1(model, recl.candidate_labels(2, 8, 1, "cil"), (1, 28, 28), cfg)
        left[precision] = report["kept_terms"]["rec"] / report["first_terms"]["rec"]
    assert not torch.equal(found["float32"], found["bfloat16"]) and abs(left["bfloat16"] - left["float32"]) < 0.01


def test_the_inversion_controls_candidates_are_classified_as_their_labels(trained_on_eight_digits):
    model, _ = trained_on_eight_digits
    labels = recl.candidate_labels(2, 8, 1, "cil")
    start, _ = recl.random_start(16, (1, 28, 28), 1e-3, 0)
    x, _, report = step1(model, labels, (1, 28, 28), run_config(rec_objective="inversion"))
    before, after = (recl.classified_as_labelled(model, v, labels).float().mean().item() for v in (start, x))
    assert (before, after) == (0.5, 1.0) and "rec" not in report["kept_terms"]


def test_freeze_old_keeps_earlier_candidates_and_lambdas_bit_for_bit_and_moves_the_rest():
    torch.manual_seed(0)
    model = displaced(models.remember_start(models.MLP(16, 4, hidden=8)))
    labels = recl.candidate_labels(4, 3, 1, "cil")
    earlier_x, earlier_labels, earlier_lam = torch.randn(5, 16), torch.tensor([0, 0, 0, 1, 1]), torch.rand(5)
    x, lam, report = step1(model, labels, (16,), run_config(n_rec=20), last=(earlier_x, earlier_labels, earlier_lam))
    assert report["optimised"] == 7
    assert torch.equal(x[:5], earlier_x) and torch.equal(lam[:5], earlier_lam)
    start, _ = recl.random_start(12, (16,), 1e-3, 0)
    assert ((x[5:] - start[5:]).flatten(1).norm(dim=1) > 1e-2).all()


def test_filter_keeps_exactly_the_candidates_classified_as_their_label():
    model = nn.Linear(3, 3, bias=False)
    nn.init.eye_(model.weight)  # predicts the index of the largest input
    x = torch.tensor([[1.0, 0, 0], [0, 2, 0], [0, 0, 3], [5, 0, 1], [0, 1, 0]])
    kept = recl.classified_as_labelled(model, x, torch.tensor([0, 1, 0, 0, 2]))
    assert kept.tolist() == [True, True, False, True, False]


def epoch_batches(x_own, x_rec, cfg):
    """What step2's batches hold in one epoch: (rows, labels, replayed)."""
    task = data.Task(None, x_own, torch.zeros(len(x_own), dtype=torch.long), None, None)
    batches, _, clean = recl.step2(task, x_rec, torch.ones(len(x_rec), dtype=torch.long), cfg, 0)
    return list(batches()), list(clean())


def test_replay_noise_adds_fresh_noise_of_its_std_to_the_replayed_rows_only():
    torch.manual_seed(0)
    own, rec = torch.randn(64, 1, 8, 8) * 2.0, torch.zeros(64, 1, 8, 8)
    (xb, _, replayed), = epoch_batches(own, rec, run_config(replay_noise=0.5, batch_size=128))[0]
    assert sorted(xb[~replayed].flatten(1).tolist()) == sorted(own.flatten(1).tolist())  # own rows unchanged
    assert xb[replayed].std().item() == pytest.approx(0.5 * own.std().item(), rel=0.05)


def test_replay_batch_draws_n_reconstructions_into_each_batch_of_the_tasks_own_images():
    own, rec = torch.randn(10, 1, 2, 2), 100 + torch.randn(30, 1, 2, 2)
    batches, _ = epoch_batches(own, rec, run_config(replay_batch=3, replay_noise=0.0, batch_size=4))
    assert [int(replayed.sum()) for _, _, replayed in batches] == [3, 3, 3]
    assert sorted(torch.cat([xb[~r] for xb, _, r in batches]).flatten(1).tolist()) == sorted(own.flatten(1).tolist())


def old_head_rows_change(scope, n_replayed):
    torch.manual_seed(0)
    model = models.MLP(16, 4, hidden=8, first_init_scale=1.0)
    x, y = torch.randn(12, 16), torch.tensor([2, 3] * 6)
    y[len(y) - n_replayed:] = 0
    before = model.head.weight[:2].clone()
    train(model, x, y, run_config(ce_scope=scope, epochs=2, batch_size=4, replay_noise=0.0), None, n_replayed, 2)
    return (model.head.weight[:2] - before).abs().max().item()


@pytest.mark.parametrize("scope, n_replayed, moves", [("all", 0, True), ("new", 0, False), ("new", 4, True),
                                                      ("local", 0, False)])
def test_local_cross_entropy_never_lets_the_tasks_own_images_move_old_head_rows(scope, n_replayed, moves):
    assert (old_head_rows_change(scope, n_replayed) > 0) == moves


def test_local_cross_entropys_step_is_the_grouped_one_plus_the_heads_alone_by_hand():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(4, 3), nn.Linear(3, 4, bias=False)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(6, 4), torch.tensor([2, 3, 2, 3, 0, 1])  # four own rows, two replayed
    expected = copy.deepcopy(model)
    mask = torch.where((torch.arange(6) < 4)[:, None], torch.arange(4) < 2, torch.arange(4) >= 2)
    features = torch.tanh(expected.body(x))
    (F.cross_entropy(expected.head(features).masked_fill(mask, float("-inf")), y)
     + F.cross_entropy(expected.head(features.detach()), y)).backward()
    train(model, x, y, run_config(ce_scope="local", epochs=1, batch_size=6, lr=0.5, replay_noise=0.0), None, 2, 2)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q - 0.5 * q.grad, atol=1e-6, rtol=0)


def test_adams_first_step_moves_every_pixel_and_lambda_by_its_step_size():
    model, labels = models.remember_start(small_batch_norm_net().eval()), torch.arange(3)
    cfg = run_config(rec_optimizer="adam", lr_x=0.05, lr_lambda=0.02, n_rec=1, rec_target="weights")
    start_x, start_lam = recl.random_start(3, (1, 8, 8), cfg.sigma_x, cfg.seed)
    x, lam, _ = step1(model, labels, (1, 8, 8), cfg)
    moved = (x - start_x).abs()
    assert (moved > 0).float().mean() > 0.9 and torch.allclose(moved[moved > 0], torch.tensor(0.05), rtol=1e-3)
    assert torch.allclose((lam - start_lam).abs(), torch.tensor(0.02), rtol=1e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_batch_norm_networks_reconstruction_never_ends_above_its_start(optimizer):
    model = displaced(models.remember_start(small_batch_norm_net())).eval()
    labels = torch.arange(3).repeat_interleave(4)
    for lr_x in (1e-2, 1e4):
        x, _, report = step1(model, labels, (1, 8, 8), run_config(rec_optimizer=optimizer, lr_x=lr_x, n_rec=20))
        assert torch.isfinite(x).all() and report["kept_loss"] <= report["first_loss"]


# ==== 4. The task loop =====================================================================================

def test_each_reconstruction_builds_on_the_last_with_freeze_old(monkeypatch):
    seen, real = [], recl.step1
    monkeypatch.setattr(recl, "step1", lambda *a: seen.append(a[3]) or seen.append(real(*a)) or seen[-1])
    recl.run_continual(run_config(epochs=2, n_rec=3, m=2, filter=False), synthetic_tasks("cil"), QUIET)
    first_last, made_before_2, second_last, made_before_3 = seen
    assert first_last is None and torch.equal(second_last[0], made_before_2[0])
    assert torch.equal(made_before_3[0][:4], made_before_2[0])  # classes 0 and 1 kept as they were


def test_the_task_trains_on_the_filtered_reconstructions_only(monkeypatch):
    monkeypatch.setattr(recl, "classified_as_labelled", lambda model, x, y: torch.arange(len(x)) % 2 == 0)
    sizes, real = [], recl.step2
    monkeypatch.setattr(recl, "step2", lambda task, x, y, *a: sizes.append(len(x)) or real(task, x, y, *a))
    (report,) = recl.run_continual(run_config(epochs=1, n_rec=2, m=4), synthetic_tasks("cil")[:2], QUIET)[
        "reconstructions"]
    assert (report["candidates"], report["kept"], sizes) == (8, 4, [0, 4])


def test_the_real_arm_stores_m_distinct_training_images_of_each_class_under_its_label():
    task = synthetic_tasks("cil", per_class=10)[1]
    x, y = recl.stored_images(task, 4, centroids=False, seed=0)
    own = [[i for i, row in enumerate(task.x_train) if torch.equal(row, xi) and task.y_train[i] == yi]
           for xi, yi in zip(x, y)]
    assert y.tolist() == [2] * 4 + [3] * 4 and all(len(o) == 1 for o in own) and len({o[0] for o in own}) == 8


def test_the_centroid_arm_stores_each_classes_mean_image_in_its_m_slots():
    task = synthetic_tasks("cil", per_class=10)[1]
    x, y = recl.stored_images(task, 4, centroids=True, seed=0)
    assert torch.allclose(x, torch.stack([task.x_train[task.y_train == c].mean(0) for c in y]))


@pytest.mark.parametrize("source", ["real", "centroids"])
def test_a_stored_arm_replays_m_images_of_every_old_class_before_each_task(source, monkeypatch):
    monkeypatch.setattr(recl, "classified_as_labelled", lambda model, x, y: torch.ones(len(x), dtype=torch.bool))
    replayed, real = [], recl.step2
    monkeypatch.setattr(recl, "step2", lambda task, x, y, *a: replayed.append(y.tolist()) or real(task, x, y, *a))
    record = recl.run_continual(run_config(source, "--variant", "recl", "--replay-source", source, epochs=1, m=3),
                                synthetic_tasks("cil", per_class=6), QUIET)
    assert replayed == [[], [0] * 3 + [1] * 3, [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3]
    assert record["stored_images"] == (12 if source == "real" else 4)


@pytest.mark.parametrize("scenario, outputs", [("cil", 6), ("dil", 2)])
def test_joint_trains_one_model_on_every_task_at_once(scenario, outputs):
    record = recl.run_continual(run_config("base", scenario=scenario, method="joint", epochs=10),
                                synthetic_tasks(scenario), QUIET)
    assert (record["BWT"], len(record["acc_matrix"]), record["ACC"]) == (None, 1, 100.0)


def test_recl_helps_finetune_remember_on_synthetic_cil():
    tasks = synthetic_tasks("cil", per_class=20)
    cfg = run_config(epochs=10, n_rec=20, m=20, lr_x=1.0, ce_weight=0.0)  # docs/test-margins.md
    base = recl.run_continual(run_config("base", epochs=10), tasks, QUIET)
    with_recl, noise = (recl.run_continual(c, tasks, QUIET) for c in (cfg, dataclasses.replace(cfg, n_rec=0)))
    assert with_recl["BWT"] > max(noise["BWT"], base["BWT"]), (with_recl["BWT"], noise["BWT"], base["BWT"])


@pytest.mark.parametrize("scenario", ["cil", "dil"])
@pytest.mark.parametrize("method", [m for m in strategies.STRATEGIES if m != "joint"])
def test_every_method_with_recl_gives_the_same_numbers_for_the_same_seed(method, scenario):
    cfg = run_config(method=method, scenario=scenario, epochs=2, n_rec=3, m=2)
    first, second = (recl.run_continual(cfg, synthetic_tasks(scenario), QUIET) for _ in range(2))
    assert first["acc_matrix"] == second["acc_matrix"] and len(first["reconstructions"]) == 2


@pytest.mark.parametrize("tuning", ["unsup", "sup"])
def test_the_sec43_search_records_the_hyperparameters_it_chose(tuning):
    cfg = run_config(epochs=1, n_rec=2, m=2, tuning=tuning, trials=2)
    record = recl.run_continual(cfg, synthetic_tasks("cil"), QUIET)
    assert all(set(r["hyperparameters"]) == set(judging.SEARCH_SPACE) for r in record["reconstructions"])


NO_LOG = lambda *a: None
randn = lambda *shape, seed=0: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
labels_of = lambda n, k, seed=1: torch.randint(0, k, (n,), generator=torch.Generator().manual_seed(seed))
flat = lambda tensors: torch.cat([t.flatten() for t in tensors])
loader_of = lambda x, y: data.loader(x, y, 64, shuffle=False)
same = lambda got, expected: all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

def blob_tasks(per_class=6, shape=(1, 4, 4), n_tasks=3):  # separated blobs, two classes a task, as data.py lays out
    g, y = torch.Generator().manual_seed(0), torch.arange(2 * n_tasks).repeat_interleave(per_class)
    centres = torch.randn(2 * n_tasks, *shape, generator=g)
    x_train, x_test = (0.5 * centres[y] + 0.05 * torch.randn(len(y), *shape, generator=g) for _ in range(2))
    return data.split_into_tasks(x_train, y, x_test, y, list(range(2 * n_tasks)), 2, "cil")

def mlp(in_dim=6, n_classes=2, hidden=5):
    torch.manual_seed(0)
    return models.MLP(in_dim, n_classes, hidden=hidden, first_init_scale=1.0)

# ==== 5. Data, networks, strategies and judging ==================================================

# ---- strategies.py: GPM, EWC, LwF, A-GEM, ER, UPGD

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

def test_gpm_samples_every_class_of_a_class_sorted_task():
    x = torch.zeros(800, 6)  # class 0 lives in inputs 0-2, class 1 in 3-5: the first 300 rows would miss class 1
    x[:400, :3], x[400:, 3:] = randn(400, 3), randn(400, 3, seed=1)
    model, state = mlp(6, 2, hidden=8), strategies.new_state("gpm", gpm_samples=300)
    strategies.gpm_after_task(model, loader_of(x, torch.arange(800) // 400), state)
    basis, class_1 = state["bases"]["fc1"], x[400:].T
    assert (basis @ (basis.T @ class_1)).norm() / class_1.norm() > 0.9

def test_gpm_projects_a_convolution_over_its_input_patches():
    torch.manual_seed(0)
    model, state = models.build_model("cnn", (3, 12, 12), 4), strategies.new_state("gpm", gpm_threshold=0.95)
    strategies.gpm_after_task(model, loader_of(torch.randn(20, 3, 12, 12), torch.zeros(20)), state)
    model.conv2.weight.grad, basis = torch.randn_like(model.conv2.weight), state["bases"]["conv2"]
    strategies.gpm_after_backward(model, state)  # the basis: a row per input channel and kernel position
    assert basis.shape[0] == 160 * 3 * 3 and (model.conv2.weight.grad.view(160, -1) @ basis).abs().max() < 1e-4

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

def agem_projection(conflict):  # a gradient set against the memory's g_ref (or along it): before and after the hook
    model, state = mlp(), strategies.new_state("agem", agem_batch=10)
    state["memory_x"], state["memory_y"], params = randn(10, 6, seed=1), labels_of(10, 2), list(model.parameters())
    g_ref = torch.autograd.grad(F.cross_entropy(model(state["memory_x"]), state["memory_y"]), params)
    for p, r in zip(params, g_ref):
        p.grad = -r + 0.1 * randn(*r.shape, seed=2) if conflict else r.clone()
    before = flat(p.grad for p in params)
    strategies.agem_after_backward(model, state)
    return before, flat(p.grad for p in params), flat(g_ref)

def test_agem_projects_a_conflicting_gradient_to_a_non_negative_dot_with_g_ref():  # Chaudhry et al. 2019, Eq. 11
    g, after, g_ref = agem_projection(conflict=True)
    torch.testing.assert_close(after, g - (g @ g_ref) / (g_ref @ g_ref) * g_ref)
    assert g @ g_ref < 0 <= after @ g_ref + 1e-6

def test_agem_leaves_a_gradient_that_agrees_with_the_memory_alone():
    before, after, _ = agem_projection(conflict=False)
    torch.testing.assert_close(after, before)

@pytest.mark.parametrize("method, size", [("er", 15), ("agem", 50)])  # er: 10% of 150; agem: 50 per task
def test_after_task_memory_holds_the_rows_sample_rows_draws(method, size):
    model, x, y, state = mlp(12, 3), randn(150, 12), labels_of(150, 3), strategies.new_state(method)
    torch.manual_seed(1)
    strategies.STRATEGIES[method]["hooks"]["after_task"](model, loader_of(x, y), state)
    torch.manual_seed(1)
    assert same((state["memory_x"], state["memory_y"]), strategies.sample_rows(x, y, size))

def test_er_buffer_grows_by_its_fraction_of_each_task_and_at_least_one():
    state, sizes = strategies.new_state("er", er_fraction=0.1), []
    for n in (150, 40, 3):
        strategies.er_after_task(None, loader_of(randn(n, 2), torch.zeros(n)), state)
        sizes.append(len(state["memory_x"]))
    assert sizes == [15, 15 + 4, 15 + 4 + 1]

def test_upgd_first_step_is_gradient_plus_decay_times_one_minus_scaled_utility():
    model, state = mlp(), strategies.new_state("upgd", upgd_beta=0.9, upgd_sigma=0.0, upgd_weight_decay=0.1)
    F.cross_entropy(model(randn(8, 6)), labels_of(8, 2)).backward()
    g, w = ({k: getattr(p, kind).clone() for k, p in model.named_parameters()} for kind in ("grad", "data"))
    strategies.upgd_after_backward(model, state)
    utility = {k: (1 - 0.9) * -g[k] * w[k] for k in g}  # the running mean after one step from zero; as in Elsayed
    top = max(u.max() for u in utility.values())  # and Mahmood's code, scaled by the max of the uncorrected mean
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (g[k] + 0.1 * w[k]) * (1 - torch.sigmoid(utility[k] / (1 - 0.9) / top)))

# ---- judging.py: SSIM, matching, the judge, its files, the searches

def test_ssim_of_an_image_with_itself_is_one():
    a = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(judging.ssim(a, a), torch.ones(3))
CONSTANT = [torch.full((1, 1, 11, 11), v, dtype=torch.float64) for v in (0.2, 0.6)]  # SSIM: the luminance term
RANDOM = list(torch.rand(2, 1, 1, 11, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))

@pytest.mark.parametrize("a, b", [CONSTANT, RANDOM], ids=["constant-0.2-and-0.6", "random"])
def test_ssim_of_one_11x11_window_is_wang_et_als_formula_with_gaussian_weights(a, b):
    w = torch.outer(*[torch.tensor([math.exp(-(i - 5) ** 2 / 4.5) for i in range(11)], dtype=torch.float64)] * 2)
    mean = lambda t: (w * t).sum() / w.sum()
    mu_a, mu_b, cov = mean(a), mean(b), mean(a * b) - mean(a) * mean(b)
    var_a, var_b = mean(a * a) - mu_a ** 2, mean(b * b) - mu_b ** 2
    expected = (2 * mu_a * mu_b + 1e-4) * (2 * cov + 9e-4) / ((mu_a ** 2 + mu_b ** 2 + 1e-4) * (var_a + var_b + 9e-4))
    assert judging.ssim(a, b).item() == pytest.approx(expected.item(), rel=1e-9)

def test_nearest_candidates_finds_shuffled_rescaled_copies():
    reference, order = randn(10, 1, 8, 8), torch.randperm(10, generator=torch.Generator().manual_seed(0))
    candidates = torch.cat([3.0 * reference[order] + 0.01 * randn(10, 1, 8, 8, seed=1), randn(5, 1, 8, 8, seed=2)])
    assert torch.equal(order[judging.nearest_candidates(reference, candidates)], torch.arange(10))

def quality_against_smooth_blobs(candidates):  # smooth blobs around a shared mean image, the judge's kind of input
    reference = F.avg_pool2d(randn(20, 1, 16, 16), 5, stride=1) * 2 - 0.1
    return judging.reconstruction_quality(reference, candidates(reference), randn(1, 12, 12, seed=1).sigmoid())[0]

def test_quality_of_copies_is_one_whatever_their_scale_and_offset():
    quality = quality_against_smooth_blobs(lambda reference: 0.01 * reference + 0.3)
    torch.testing.assert_close(quality, torch.ones(20), atol=1e-3, rtol=0)

def test_quality_of_noise_is_low_whatever_its_size():
    small, large = (quality_against_smooth_blobs(lambda r: s * randn(20, 1, 12, 12, seed=3)) for s in (1e-3, 1.0))
    torch.testing.assert_close(small, large)
    assert large.mean() < 0.5

def test_judge_scores_copies_one_above_the_held_out_ceiling_above_the_noise_floor():
    tasks = blob_tasks(shape=(1, 12, 12))[:2]  # the reconstructions: the old real images themselves
    real = torch.cat([t.x_train for t in tasks])
    quality = judging.judge_reconstruction(tasks, real, config.Config(), 0 * real[0])[0]
    assert quality["mean_ssim"] == pytest.approx(1.0, abs=1e-4)
    assert quality["mean_ssim"] > quality["real_mean_ssim"] > quality["init_mean_ssim"]

def real_digits(n_per_class=50):  # two digits' training and held-out images, and the training mean image
    (task, *_), _, mean_image, _ = data.make_tasks("mnist", 0, n_per_class=n_per_class)
    return task.x_train, task.y_train, task.x_test, task.y_test, mean_image


def test_the_memorisation_gap_of_copies_of_training_images_is_large():
    x, _, held_out, _, mean_image = real_digits()
    assert judging.memorisation_gap(x[::2], x, held_out, mean_image, seed=0)["memorisation_gap"] > 0.15


def test_the_memorisation_gap_of_class_means_is_about_zero():
    x, y, held_out, _, mean_image = real_digits()
    means = torch.stack([x[y == c].mean(0) for c in y.unique()])
    assert abs(judging.memorisation_gap(means, x, held_out, mean_image, seed=0)["memorisation_gap"]) < 0.03


def test_report_saves_a_png_grid_and_the_candidates_as_x_pixels_and_labels(tmp_path):
    tasks, x, y, mean = blob_tasks(8, (1, 12, 12))[:2], 0.4 * randn(8, 1, 12, 12), torch.arange(8) % 4, randn(1, 12, 12)
    judging.report_reconstruction("t", tasks, x, config.Config(), mean, tmp_path / "run.json", NO_LOG, y)
    saved = torch.load(tmp_path / "run-task3.pt", weights_only=True)
    assert same([saved["x"], saved["pixels"], saved["labels"]], [x, (x + mean).clamp(0, 1), y])
    # the grid: 32 real images in 2 rows of 16, each followed by a row of their matches; 12 pixels + 1 of padding
    assert Image.open(tmp_path / "run-task3.png").size == (16 * 13 + 1, 4 * 13 + 1)

@pytest.mark.parametrize("scores, kept", [([1.0, 1.0, 0.0], 0), ([1.0, 3.0, 2.0], 1), ([math.nan, 1.0, 2.0], 2),
                                          ([math.inf, 0.5], 1), ([math.nan, -math.inf], 0)])

def test_random_search_keeps_the_best_payload_the_earliest_on_ties(scores, kept):
    assert judging.random_search(range(len(scores)), lambda i: (scores[i], None, i))[1] == kept

def test_random_search_ranks_non_finite_scores_last():
    trials, _ = judging.random_search(range(4), lambda i: ([math.nan, 1.0, math.inf, 2.0][i], None, i))
    assert [settings for _, settings, _ in trials] == [3, 1, 0, 2]

def searched(losses, **settings):  # search_reconstruction (unsup, 6 trials), the (first, kept) losses losses(lr_x)
    tried, cfg = [], config.Config(tuning="unsup", trials=6, **settings)
    def reconstruct_with(c):
        tried.append({k: getattr(c, k) for k in judging.SEARCH_SPACE if getattr(c, k) is not None})
        return None, None, None, dict(zip(("first_loss", "kept_loss"), losses(c.lr_x)))
    return tried, judging.search_reconstruction(reconstruct_with, [None], cfg, NO_LOG)[-1]
OWN = dict(sigma_x=1e-3, lr_x=3.0, lr_lambda=0.1, lambda_min=0.05, alpha=100.0)  # Config's defaults

@pytest.mark.parametrize("settings, own", [({}, OWN), (dict(lr_lambda=None, lambda_min=None),  # inversion's
                                                       dict(sigma_x=1e-3, lr_x=3.0, alpha=100.0))])

def test_search_tries_the_runs_own_settings_first_and_draws_only_those(settings, own):
    tried, _ = searched(lambda lr_x: (2.0, 1.0), **settings)
    assert len(tried) == 6 and tried[0] == own and all(hp.keys() == own.keys() for hp in tried)

def test_unsupervised_search_keeps_the_lowest_final_loss():
    tried, report = searched(lambda lr_x: (1e9, abs(math.log(lr_x / 0.1))))
    assert report["hyperparameters"] == min(tried, key=lambda hp: abs(math.log(hp["lr_x"] / 0.1)))

def test_search_never_keeps_a_trial_that_did_not_lower_its_loss():
    tried, report = searched(lambda lr_x: (0.0, 0.0) if lr_x == 3.0 else (2.0, 1.0))  # the defaults: no progress
    assert report["hyperparameters"] == tried[1] and report["score"] == -1.0

def test_supervised_search_keeps_the_trial_that_looks_like_the_stored_real_images():
    tasks, tried = blob_tasks(shape=(1, 12, 12))[:2], []
    real = torch.cat([t.x_train for t in tasks])
    def reconstruct_with(cfg):  # the third trial hands back the real images, the others noise
        tried.append(cfg.lr_x)
        x = real if len(tried) == 3 else randn(*real.shape, seed=len(tried))
        return x, None, None, {"first_loss": 2.0, "kept_loss": 1.0}
    *_, report = judging.search_reconstruction(reconstruct_with, tasks, config.Config(tuning="sup", trials=4), NO_LOG)
    assert report["hyperparameters"]["lr_x"] == tried[2]

def test_sample_hyperparameters_lie_within_the_search_factor_on_both_sides():
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([list(judging.sample_hyperparameters(gen, OWN).values()) for _ in range(99)])
    ratio, factor = draws / torch.tensor(list(OWN.values())), torch.tensor(list(judging.SEARCH_SPACE.values()))
    assert (1 / factor <= ratio).all() and (ratio <= factor).all()
    assert (ratio.min(0).values < 1).all() and (ratio.max(0).values > 1).all()

# ---- data.py: tasks, the shipped subset, each dataset from its own files

@pytest.mark.parametrize("scenario, labels", [("cil", [3, 2, 3, 2]), ("dil", [1, 0, 1, 0])])
def test_split_into_tasks_labels_a_class_by_its_place_in_the_order(scenario, labels):
    y = torch.arange(6).repeat(2)  # class order [3, 1, 4, 0, 5, 2]: task 2 holds 4 then 0
    task = data.split_into_tasks(y.float(), y, y.float(), y, [3, 1, 4, 0, 5, 2], 2, scenario)[1]
    assert task.classes == [4, 0] and task.x_train.tolist() == [0, 4, 0, 4] and task.y_test.tolist() == labels

def test_make_tasks_fixes_the_class_order_per_seed():
    order = lambda seed: data.make_tasks("mnist", seed, n_per_class=5)[1]
    assert order(3) == order(3) != order(4) and sorted(order(3)) == list(range(10))

def test_make_tasks_holds_out_the_rest_of_each_shipped_class_of_500_for_testing():
    tasks, _, _, _ = data.make_tasks("mnist", 0, n_per_class=20)
    assert [(len(t.x_train), len(t.x_test)) for t in tasks] == [(2 * 20, 2 * (500 - 20))] * 5

def test_make_tasks_subtracts_the_training_mean_image_into_minus_one_one():
    tasks, _, mean_image, _ = data.make_tasks("mnist", 0, n_per_class=20)
    x = torch.cat([t.x_train for t in tasks])
    pixels = (x + mean_image) * 255  # the mean added back gives the images' own bytes
    assert x.mean(0).abs().max() < 1e-5 and x.abs().max() <= 1 and (pixels - pixels.round()).abs().max() < 1e-3

def test_validation_split_parts_each_tasks_training_images_four_to_one_and_never_uses_a_test_image():
    for old, new in zip(blob_tasks(10), data.validation_split(blob_tasks(10), fraction=0.2, seed=0)):
        both, own = torch.cat([new.x_train, new.x_test]).flatten(1), old.x_train.flatten(1)
        assert len(new.x_test) == 4 and torch.equal(both.sort(0).values, own.sort(0).values)  # each image once

def test_shipped_mnist_subset_matches_its_checksum():
    digest = hashlib.sha256(data.MNIST_SUBSET.read_bytes()).hexdigest()
    assert digest == "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"

def test_a_parsed_csv_is_reused_by_content_and_never_shared(tmp_path):
    path = written(tmp_path, "two.csv.gz", gzip.compress(csv_row(7, 3) + csv_row(9, 4)))
    for _ in range(2):  # a caller that writes into what it got, parsed or from the cache
        data.load_mnist_subset(path)[0].zero_()
    again, labels = data.load_mnist_subset(path)
    assert again[:, 0, 0, 0].tolist() == [7, 9] and labels.tolist() == [3, 4]
    assert data.load_mnist_subset(written(tmp_path, "two.csv.gz", gzip.compress(csv_row(1, 0))))[0].max() == 1

idx_bytes = lambda t: bytes([0, 0, 8, t.dim()]) + b"".join(k.to_bytes(4, "big") for k in t.shape) + t.numpy().tobytes()

@pytest.mark.parametrize("pack", [gzip.compress, bytes], ids=["gzip", "plain"])
def test_read_idx_gives_the_shape_of_its_header_and_its_bytes(tmp_path, pack):
    t = torch.arange(24, dtype=torch.uint8).view(2, 3, 4)
    assert torch.equal(data.read_idx(written(tmp_path, "f", pack(idx_bytes(t)))), t)

def write_idx(folder, n_train, n_test, seed=0):  # MNIST's four gzipped IDX files; returns what a loader should give
    g, held = torch.Generator().manual_seed(seed), folder.mkdir(parents=True) or []
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images, labels = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8), torch.arange(n) % 10
        for kind, t in (("images-idx3", images), ("labels-idx1", labels.to(torch.uint8))):
            written(folder, f"{prefix}-{kind}-ubyte.gz", gzip.compress(idx_bytes(t)))
        held += [images[:, None], labels]
    return held

def write_fashion(t, mp, torchvisions_too):  # in torchvision's folder and Debian's, or Debian's alone
    mp.setattr(data, "DEBIAN_FASHION_MNIST", t / "debian")
    debians = write_idx(t / "debian", 20, 10, seed=2)
    return write_idx(t / "FashionMNIST" / "raw", 20, 10, seed=1) if torchvisions_too else debians

def write_cifar(root, n=20):  # CIFAR10's six batches, in Python 2's pickle protocol like the real ones
    (root / "cifar-10-batches-py").mkdir(parents=True, exist_ok=True)
    x = torch.randint(0, 256, (6, n, 3072), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        batch = pickle.dumps({b"data": x[i].numpy(), b"labels": list(range(10)) * (n // 10)}, protocol=2)
        written(root / "cifar-10-batches-py", name, batch)
    return x[:5].reshape(-1, 3, 32, 32), torch.arange(5 * n) % 10, x[5].view(-1, 3, 32, 32), torch.arange(n) % 10

def write_pt_of_vectors(t, mp):
    content = dict(x_train=randn(6, 5).sigmoid(), y_train=torch.arange(6) % 3, x_test=randn(3, 5).sigmoid(),
                   y_test=torch.arange(3))
    torch.save(content, t / "my.data.pt")
    return content["x_train"][:, None, None], content["y_train"], content["x_test"][:, None, None], content["y_test"]


@pytest.mark.parametrize("dataset, write", [
    ("cifar10", lambda t, mp: write_cifar(t)),
    ("fashion-mnist", lambda t, mp: write_fashion(t, mp, True)),
    ("fashion-mnist", lambda t, mp: write_fashion(t, mp, False)),
    ("my.data.pt", write_pt_of_vectors)],
    ids=["cifar10", "fashion-torchvision-first", "fashion-debian", "pt-of-vectors"])

def test_each_dataset_is_read_from_its_own_files(tmp_path, monkeypatch, dataset, write):
    monkeypatch.chdir(tmp_path)
    expected = write(tmp_path, monkeypatch)
    assert same(data.load(dataset, tmp_path), expected)

def test_a_failed_download_removes_the_folders_it_made_and_only_those(tmp_path):
    (tmp_path / "had" / "old").mkdir(parents=True)
    for root in (tmp_path / "had", tmp_path / "new" / "data"):  # torchvision makes its folders, then fails offline
        with pytest.raises(data.DataError, match=r"could not be downloaded \(OSError\)"):
            data.fetch("MNIST", root, lambda: ((root / "MNIST" / "raw").mkdir(parents=True), offline()))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["had", "had/old"]

# ---- models.py

def test_grow_head_keeps_the_old_classes_outputs():
    model, x = mlp(10, 2), randn(4, 10)
    before = model(x)
    models.grow_head(model, 5)
    torch.testing.assert_close(model(x)[:, :2], before)

def test_grow_head_starts_theta_0s_new_rows_where_they_were_initialised():
    torch.manual_seed(0)
    model = models.build_model("mlp", (10,), 2)
    model.head.weight.data += 1.0  # "training" moves the old rows
    models.grow_head(model, 5)
    moved = model.head.weight - models.start_weights(model)["head.weight"]
    torch.testing.assert_close(moved, torch.cat([torch.ones(2, 1000), torch.zeros(3, 1000)]))

Z = torch.linspace(-1, 1, 9)
S = torch.sigmoid(10.0 * Z)

def smooth_backward_relu(z, alpha):
    """The reference, with detach: the value is relu(z) (the two softplus terms cancel) and
    every derivative is softplus_alpha's (the detached terms have none)."""
    soft = F.softplus(z, beta=alpha)
    return z.clamp_min(0).detach() + soft - soft.detach()

@pytest.mark.parametrize("order, expected", [(0, torch.relu(Z)), (1, S), (2, 10.0 * S * (1 - S))],
                         ids=["value", "first", "second"])

@pytest.mark.parametrize("form", [lambda u: models.SmoothBackwardReLUFunction.apply(u, 10.0),
                                  lambda u: smooth_backward_relu(u, 10.0)], ids=["function", "detach"])

def test_smooth_relu_is_relu_forward_with_the_sigmoids_derivatives(form, order, expected):
    for _ in range(order):
        form = (lambda f: grad(lambda u: f(u).sum()))(form)
    torch.testing.assert_close(form(Z), expected)

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
    torch.optim.swa_utils.update_bn([(xb,) for xb, _ in data.loader(x, y, 16)], model)  # as recl.run_continual does
    with torch.no_grad():  # without update_bn it evaluates at chance, 0.5
        accuracy = [(net(x).argmax(1) == y).float().mean().item() for net in (copy.deepcopy(model).train(),
                                                                              model.eval())]
    assert accuracy[0] > 0.9 and accuracy[1] >= accuracy[0] - 0.05

# ---- every refusal of bad input: the words of its one-line message

def offline(*args, **kwargs): raise OSError("no network")  # noqa: E704

class CallsSystem:  # unpickling this calls os.system, which would create the file `ran`
    __reduce__ = lambda self: (os.system, ("touch ran",))
written = lambda folder, name, raw: [(folder / name).write_bytes(raw), folder / name][1]  # the path written

def tasks_of_pt(content, name="bad.pt"):  # a row's action: write `content` (torch.save unless bytes), make tasks
    return lambda t, mp: (written(t, name, content) if isinstance(content, bytes) else torch.save(content, t / name),
                          data.make_tasks(str(t / name), 0, n_per_class=1))

def offline_load(dataset, where, name, *patches):
    return lambda t, mp: ([mp.setattr(*p) for p in patches], mp.setattr(where, name, offline), data.load(dataset, t))
GOOD = dict(x_train=torch.rand(4, 3, generator=torch.Generator().manual_seed(0)), y_train=torch.arange(4),
            x_test=torch.rand(4, 3, generator=torch.Generator().manual_seed(1)), y_test=torch.arange(4))
PT = lambda **changes: tasks_of_pt(dict(GOOD, **changes))
NAN = torch.tensor([[0.5, math.nan, 0.5]] * 4)
csv_row = lambda value, label: (",".join([str(value)] * 784 + [str(label)]) + "\n").encode()
subset = lambda raw: lambda t, mp: data.load_mnist_subset(written(t, "a.csv.gz", raw))
cifar_with = lambda name, raw: lambda t, mp: (write_cifar(t), written(t / "cifar-10-batches-py", name, raw),
                                              data.load("cifar10", t))
DE, VE = data.DataError, ValueError
REFUSALS = [  # id, words, error, action(tmp_path, monkeypatch)
    ("csv-missing", "not found", DE, lambda t, mp: data.load_mnist_subset(t / "nope.csv.gz")),
    ("csv-not-gzip", "not a gzip CSV", DE, subset(b"plain")),
    ("csv-short", "not a gzip CSV", DE, subset(gzip.compress(b"1,2,3\n"))),
    ("csv-range", "pixel values outside 0-255", DE, subset(gzip.compress(csv_row(300, 1)))),
    ("csv-corrupt", r"corrupt \(sha256 mismatch\)", DE,
     lambda t, mp: (mp.setattr(data, "MNIST_SUBSET_SHA256", "0" * 64), data.load_mnist_subset())),
    ("idx-kind", "not an unsigned-byte IDX", DE, lambda t, mp: data.read_idx(written(t, "i", b"\0\0\x0d\x01\0\0\0\1"))),
    ("idx-short", "truncated", DE, lambda t, mp: data.read_idx(written(t, "i", b"\0\0\x08\x01\0\0\0\x09abc"))),
    ("pt-missing", "not found", DE, lambda t, mp: data.make_tasks(str(t / "missing.pt"), 0)),
    ("pt-folder", "is a folder", DE, lambda t, mp: ((t / "x.pt").mkdir(), data.make_tasks(str(t / "x.pt"), 0))),
    ("pt-corrupt", "not a torch.save file", DE, tasks_of_pt(b"not a torch file")),
    ("pt-keys", "must hold a dict with keys", DE, tasks_of_pt({"x_train": GOOD["x_train"]})),
    ("pt-not-dict", "must hold a dict with keys", DE, tasks_of_pt([1, 2])),
    ("pt-not-tensor", "y_train is a list, not a tensor", DE, PT(y_train=[0, 1, 2, 3])),
    ("pt-dims", r"x_train must be \[N, C, H, W\] or \[N, D\]", DE, PT(x_train=torch.rand(4, 3, 2))),
    ("pt-rows", "one label per row", DE, PT(y_train=torch.arange(3))),
    ("pt-no-images", "x_train holds no images", DE, PT(x_train=torch.rand(0, 3), y_train=torch.arange(0))),
    ("pt-no-pixels", "no pixels", DE, PT(x_train=torch.rand(4, 1, 0, 0))),
    ("pt-float-labels", "integer labels", DE, PT(y_train=torch.rand(4))),
    ("pt-negative", "negative labels", DE, PT(y_train=-torch.arange(4))),
    ("pt-not-0-to-k", r"labels 0..K-1", DE, PT(y_train=torch.arange(4) + 5)),
    ("pt-unseen", r"y_test has labels that y_train lacks: \[4\]", DE, PT(y_test=torch.arange(4) + 1)),
    ("pt-nan", "x_train has NaN", DE, PT(x_train=NAN)),
    ("pt-inf", "x_test has NaN or infinite pixels", DE, PT(x_test=NAN.nan_to_num(nan=math.inf))),
    ("pt-range", r"uint8 \(0-255\) or float in \[0, 1\]", DE, PT(x_train=5 * GOOD["x_train"])),
    ("pt-shapes", "differ in shape", DE, PT(x_test=torch.rand(4, 5))),
    ("one-class", "too few for two tasks", DE, PT(y_train=torch.zeros(4).long(), y_test=torch.zeros(4).long())),
    ("n-per-class", "has only 6 training images, fewer than --n-per-class 7", DE, lambda t, mp: (
        write_idx(t / "FashionMNIST" / "raw", 60, 10), data.make_tasks("fashion-mnist", 0, 7, data_root=t))),
    ("none-to-test", "leaves none to test on", DE, lambda t, mp: data.make_tasks("mnist", 0, n_per_class=500)),
    ("all-no-test", "cannot train on all images", DE, lambda t, mp: data.make_tasks("mnist", 0, n_per_class=None)),
    ("validation", "cannot spare", DE, lambda t, mp: data.validation_split(blob_tasks(), fraction=1.0)),
    ("fashion-offline", "apt-get install dataset-fashion-mnist", DE, offline_load(
        "fashion-mnist", torchvision.datasets, "FashionMNIST", (data, "DEBIAN_FASHION_MNIST", "/nowhere"))),
    ("cifar-offline", "CIFAR10 is not under", DE, offline_load("cifar10", torchvision.datasets, "CIFAR10")),
    ("cifar-crafted", "asks to call posix.system, .* nothing was run", DE,
     cifar_with("data_batch_3", pickle.dumps({b"data": CallsSystem()}))),
    ("cifar-garbage", "is missing or not a CIFAR10 batch", DE, cifar_with("test_batch", b"garbage")),
    ("small-image", "cnn needs images of at least 7 pixels", VE, lambda t, mp: models.build_model("cnn", (1, 6, 6), 2)),
    ("unknown-hp", r"ewc has no hyperparameter \['bogus'\]", VE, lambda t, mp: strategies.new_state("ewc", bogus=1)),
]

@pytest.mark.parametrize("words, error, act", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_input_is_refused_in_one_line_that_names_the_problem(tmp_path, monkeypatch, words, error, act):
    monkeypatch.chdir(tmp_path)  # where a crafted pickle's command would leave `ran`
    with pytest.raises(error, match=words) as refused:
        act(tmp_path, monkeypatch)
    assert "\n" not in str(refused.value) and not (tmp_path / "ran").exists()


# ==== 6. The command line: each setting once, refusals in one line, results on disk ========================

def test_resolve_gives_a_replay_variant_its_networks_values():
    assert (resolved("--model", "cnn").n_rec, resolved("--model", "cnn").set_by["n_rec"]) == (30, "network")


def test_resolve_puts_the_methods_values_over_the_networks():
    cfg = resolved("--model", "cnn", "--scenario", "dil", "--method", "gpm")  # the CNN's DIL noise is 1
    assert (cfg.replay_noise, cfg.set_by["replay_noise"]) == (0.0, "method")


def test_a_flag_given_wins_over_every_table_and_every_value_that_depends_on_others():
    assert resolved("--method", "ewc", "--lr", "0.2").lr == 0.2  # the method's table says 0.1
    assert (resolved("--model", "cnn").lr_x, resolved("--model", "cnn", "--lr-x", "0.5").lr_x) == (0.01, 0.5)


def test_the_header_names_where_each_resolved_value_came_from_in_one_word():
    header = config.describe(resolved("--model", "cnn", "--method", "ewc", "--lr-x", "0.5"))
    for part in ("| default: batch_size 64,", "| network: ce_scope local, m 20, n_rec 30,",
                 "| method: lr 0.1, epochs 20, ewc_lambda 100 |", "| steps: lr_lambda 0.01 |", "| flag: lr_x 0.5 |"):
        assert part in header


def test_reconstruction_is_float32_on_any_cpu_unless_bfloat16_is_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": True})
    assert (resolved().rec_precision, resolved("--rec-precision", "bfloat16").rec_precision) == ("float32", "bfloat16")


def test_a_removed_departure_leaves_the_names_of_records_made_without_it():
    """Departure 11 is gone (config.REMOVED): the README's two runs keep the digests they printed with it off."""
    readme = ("--scenario", "cil", "--method", "gpm")
    assert [config.digest(resolved(*readme, variant=v)) for v in ("base", "recl")] == ["9f25a803", "d876c85c"]


def test_a_flag_of_the_recl_variant_never_changes_the_method_alones_run():
    plain, given = (config.digest(resolved(*flags, variant="base")) for flags in ([], ["--m", "5", "--n-rec", "3"]))
    assert plain == given


def test_every_default_resolves_as_the_dump_made_before_the_restructuring():
    """docs/runs/defaults-3bb579d.json: 1,088 command lines, each config or refusal. On purpose since:
    --paper --rec-optimizer adam on ResNet18 takes ResNet18's Adam step; departure 11 is gone;
    the CNN's +ReCL variants train at lr 0.01 for 40 epochs in DIL; --rec-objective is now --replay-source."""
    dump, differ = json.loads((HERE / "docs/runs/defaults-3bb579d.json").read_text()), []
    for line, before in dump.items():
        argv = line.replace("--rec-objective", "--replay-source").split()  # the flag's name since the dump
        variant = "inversion" if "inversion" in argv else "base" if "base" in argv or "joint" in argv else "recl"
        try:
            now = dataclasses.asdict(resolved(*argv, variant=variant))
        except config.UsageError as err:
            now = {"refused": str(err)}
        before = {k: v for k, v in before.items() if k not in config.REMOVED}
        if {"--paper", "resnet18", "adam"} <= set(argv) and "refused" not in before:
            before = {**before, "lr_x": 0.001}
        if {"cnn", "dil"} <= set(argv) and variant != "base" and "--paper" not in argv and "refused" not in before:
            before = {**before, "lr": 0.01, "epochs": 40}
        if "refused" in before:
            before = {"refused": now.get("refused", "accepted")}  # the wording is new
        if {k: now.get(k) for k in before if k != "device"} != {k: v for k, v in before.items() if k != "device"}:
            differ.append((line, {k: (v, now.get(k)) for k, v in before.items() if now.get(k) != v}))
    assert len(dump) == 1088 and not differ, (len(differ), differ[:3])


@pytest.mark.parametrize("argv, words", [
    (["--m", "0"], "--m must be > 0"), (["--lr", "1e9"], "above 10"), (["--lr", "nan"], "finite"),
    (["--replay-noise", "-1"], ">= 0"), (["--seeds", "2000"], "--seeds"), (["--ou", "x"], "unrecognized"),
    (["--variant", "base", "--m", "5"], "+ReCL variant only"), (["--variant", "inversion"], "--replay-source"),
    (["--replay-source", "inversion", "--lambda-min", "1"], "part of Eq. 3-6"),
    (["--replay-source", "real", "--lr-x", "1"], "reconstructs nothing"), (["--method", "joint", "--budget", "recl"],
                                                                          "at its own"),
    (["--ce-scope", "local"], "needs replayed rows"), (["--scenario", "dil", "--ce-scope", "new"], "class-incremental"),
    (["--trials", "3"], "needs --tuning"), (["--dataset", "foo"], "--dataset must be"),
    (["--data-root", "x"], "leave it out"), (["--n-per-class", "500"], "more than mnist allows"),
    (["--hp", "foo=1"], "--hp foo"), (["--scenario", "dil", "--classes-per-task", "1"], "one label"),
    (["--model", "cnn", "--variant", "recl", "--replay-batch", "100000"], "GiB"),
    (["--n-per-class", "1", "--validation"], "no training images left"), (["--out", "FILE"], "is a file")])
def test_bad_input_is_refused_in_one_line_before_anything_trains(argv, words, tmp_path, monkeypatch):
    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(recl, "run_continual", lambda *a: pytest.fail("it trained"))
    with pytest.raises((config.UsageError, data.DataError), match=words.replace("+", r"\+")):
        recl.main([w.replace("FILE", str(tmp_path / "FILE")) for w in argv]
                  + ([] if "--out" in argv else ["--out", str(tmp_path / "out")]))


def test_the_method_alone_at_recls_budget_takes_its_recl_runs_lr_epochs_and_hyperparameters():
    alone, with_recl = resolved("--method", "ewc", "--budget", "recl", variant="base"), resolved("--method", "ewc")
    assert (alone.lr, alone.epochs, alone.hp, alone.m) == (with_recl.lr, with_recl.epochs, with_recl.hp, None)


def test_the_method_alone_at_recls_budget_scores_only_the_new_classes_where_recl_uses_local_cross_entropy():
    assert resolved("--model", "cnn", "--budget", "recl", variant="base").ce_scope == "new"


def test_bad_input_exits_non_zero_with_one_line_and_no_traceback():
    code, out, err = command(sys.executable, "recl.py", "--m", "0")
    assert code != 0 and err.strip().count("\n") == 0 and err.startswith("recl.py: error:")


def test_main_writes_one_json_per_run_named_by_its_config_and_skip_done_skips_it(tmp_path, capsys):
    argv = ["--epochs", "1", "--n-per-class", "5", "--n-rec", "2", "--out", str(tmp_path), "--quiet"]
    recl.main(argv)
    files = sorted(p.name for p in tmp_path.iterdir())
    cfgs = [config.resolve(config.make_parser().parse_args(argv), 0, v) for v in ("base", "recl")]
    assert files == sorted(config.result_path(tmp_path, c).name for c in cfgs)
    record = json.loads(config.result_path(tmp_path, cfgs[1]).read_text())
    assert record["digest"] == config.digest(cfgs[1]) and len(record["reconstructions"]) == 4
    recl.main(argv + ["--skip-done"])
    assert capsys.readouterr().out.count("done before, skipped") == 2


def test_a_diverged_run_is_marked_in_its_json_and_exits_non_zero(tmp_path):
    with pytest.raises(config.RunFailed, match="diverged"):
        recl.main(["--variant", "base", "--lr", "10", "--epochs", "3", "--n-per-class", "5", "--out", str(tmp_path)])
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["diverged"] and record["ACC"] is None


def write_pt(path, n=8, side=8, classes=4):
    torch.manual_seed(0)
    x, y = torch.randint(0, 256, (n * classes, 1, side, side), dtype=torch.uint8), torch.arange(classes).repeat(n)
    torch.save({"x_train": x, "y_train": y, "x_test": x, "y_test": y}, path)
    return str(path)


def test_your_pt_counts_by_its_contents_so_a_copy_is_the_same_run(tmp_path):
    first = write_pt(tmp_path / "a.pt")
    shutil.copy(first, tmp_path / "b.pt")
    digests = {config.digest(resolved("--dataset", str(p), "--n-per-class", "4")) for p in (first, tmp_path / "b.pt")}
    assert len(digests) == 1


def test_a_refused_pt_leaves_no_results_folder_behind(tmp_path):
    (tmp_path / "bad.pt").mkdir()
    with pytest.raises(data.DataError, match="is a folder"):
        recl.main(["--dataset", str(tmp_path / "bad.pt"), "--out", str(tmp_path / "new" / "out")])
    assert not (tmp_path / "new").exists()


# ==== 7. run_all.sh: every run checked first, then JOBS at a time; resumable ==================================

sys.path.insert(0, str(HERE / "tools"))
import plan  # noqa: E402
from tools import aggregate  # noqa: E402


def planned(monkeypatch, tmp_path, *flags, **knobs):
    for name in ("SEEDS", "JOBS", "METHODS", "VARIANTS", "SCENARIOS", "DATASETS", "RESULTS", "DEVICES", "QUICK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    return plan.plan(list(flags), tmp_path)


@pytest.mark.parametrize("knobs, flags, words", [
    ({"SEEDS": "100000"}, [], "SEEDS must be"), ({"JOBS": "100000"}, [], "JOBS must be"),
    ({"METHODS": "fine"}, [], "fine is not one of"), ({"VARIANTS": "base"}, ["--m", "5"], "VARIANTS has none"),
    ({}, ["--out", "x"], "run_all's to set"), ({"QUICK": "2"}, [], "QUICK must be"),
    ({"RESULTS": "FILE/under"}, [], "cannot write"), ({"DEVICES": "0 1", "JOBS": "1"}, [], "DEVICES"),
    ({}, ["--lr", "-1"], "--lr must be > 0")])
def test_run_alls_knobs_and_flags_are_checked_before_any_run(knobs, flags, words, monkeypatch, tmp_path):
    (tmp_path / "FILE").write_text("")
    with pytest.raises(config.UsageError, match=words):
        planned(monkeypatch, tmp_path, *flags, **knobs)


def test_a_results_folder_is_named_by_the_settings_not_their_spelling(monkeypatch, tmp_path):
    names = {planned(monkeypatch, tmp_path, *flags, METHODS="joint", SCENARIOS="cil")[0]
             for flags in (["--epochs", "5"], ["--epochs=5"], ["--epochs", "5", "--quiet"])}
    assert names == {str(tmp_path / "results" / "epochs_5")}


def test_the_readmes_table_has_no_run_left_to_do(monkeypatch):
    assert planned(monkeypatch, HERE, RESULTS="docs/runs/table") == [str(HERE / "docs/runs/table")]


def test_run_all_h_prints_its_usage():
    code, out, _ = run_all("-h")
    assert code == 0 and "Knobs:" in out and "DRY_RUN" in out


def test_a_dry_run_list_through_xargs_gives_the_runs_run_all_makes_and_then_nothing_is_left(tmp_path):
    knobs = dict(METHODS="finetune", SCENARIOS="cil", VARIANTS="base", SEEDS="2", JOBS="2")
    flags = ["--epochs", "1", "--n-per-class", "5"]
    code, _, err = run_all(*flags, RESULTS=str(tmp_path / "a"), **knobs)
    assert code == 0, err
    _, listed, _ = run_all(*flags, RESULTS=str(tmp_path / "b"), DRY_RUN="1", **knobs)
    assert len(listed.splitlines()) == 2
    code, _, err = command("xargs", "-d", "\n", "-P", "2", "-I{}", "bash", "-c", "{}", input=listed)
    assert code == 0, err
    matrices = [sorted(json.loads(p.read_text())["acc_matrix"] for p in (tmp_path / f).glob("*.json")) for f in "ab"]
    assert matrices[0] == matrices[1] and len(matrices[0]) == 2
    assert run_all(*flags, RESULTS=str(tmp_path / "a"), DRY_RUN="1", **knobs)[1] == ""


def stand_in_python(tmp_path, body):
    """A PYTHON for run_all that runs the tools for real and `body` for each recl.py line."""
    script = tmp_path / "python"
    script.write_text(f'#!/bin/bash\nif [ "$1" = recl.py ]; then {body}; else exec {sys.executable} "$@"; fi\n')
    script.chmod(0o755)
    return str(script)


def test_devices_spreads_the_workers_over_the_gpus(tmp_path):
    python = stand_in_python(tmp_path, f'echo "$CUDA_VISIBLE_DEVICES" >> {tmp_path}/seen; sleep 0.3')
    run_all(PYTHON=python, DEVICES="0 1", METHODS="finetune ewc", SCENARIOS="cil", VARIANTS="base", SEEDS="2",
            RESULTS=str(tmp_path / "r"))
    assert sorted(set((tmp_path / "seen").read_text().split())) == ["0", "1"]


def process_state(pid):
    """A process's state letter (Z: ended, not yet reaped), or "gone"."""
    try:
        return open(f"/proc/{pid}/stat").read().split()[2]
    except OSError:
        return "gone"


def test_an_interrupted_run_all_stops_every_run_and_says_so(tmp_path):
    python = stand_in_python(tmp_path, f'echo $$ >> {tmp_path}/pids; sleep 60')
    env = {**os.environ, "PYTHON": python, "METHODS": "finetune", "SCENARIOS": "cil", "VARIANTS": "base", "SEEDS": "2",
           "JOBS": "2", "RESULTS": str(tmp_path / "r")}
    process = subprocess.Popen(["bash", HERE / "run_all.sh"], env=env, stderr=subprocess.PIPE, text=True)
    for _ in range(600):  # until both runs have started
        if (tmp_path / "pids").exists() and len((tmp_path / "pids").read_text().split()) == 2:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 130 and "interrupted" in process.stderr.read()
    running = lambda: [p for p in (tmp_path / "pids").read_text().split() if process_state(p) not in ("gone", "Z")]
    for _ in range(100):  # the runs end as their signal arrives
        time.sleep(0.05 * bool(running()))
    assert running() == []


def test_a_failing_run_is_named_and_stops_no_other(tmp_path):
    python = stand_in_python(tmp_path, f'[[ "$*" == *" ewc "* ]] && exit 1; echo "$*" >> {tmp_path}/ran')
    code, _, err = run_all(PYTHON=python, METHODS="finetune ewc", SCENARIOS="cil", VARIANTS="base", SEEDS="2",
                           RESULTS=str(tmp_path / "r"))
    assert code != 0 and err.count("run_all: FAILED:") == 2 and len((tmp_path / "ran").read_text().splitlines()) == 2

# ==== 8. The tools: tables and charts, tuning, the benchmark ===================================================

def test_aggregate_averages_each_config_over_its_seeds(tmp_path):
    for seed, (acc, bwt) in enumerate([(50, -40), (60, -30), (70, -20)]):
        config.write_json_atomically(tmp_path / f"ewc-{seed}.json", fake_record("ewc", "base", seed, acc, bwt))
    config.write_json_atomically(tmp_path / "recl.json", fake_record("ewc", "recl", 0, 80, -5))
    summary = aggregate.aggregate(tmp_path, QUIET).split("####")[0]  # before the arms' table
    rows = [line for line in summary.splitlines() if line.startswith("| ewc")]
    assert rows == ["| ewc | 3 | 60.00 (10.00) | -30.00 (10.00) | 60.00 (10.00) |  |  |  |  | 1.0 |  |",
                    "| ewc+recl | 1 | 80.00 | -5.00 | 80.00 |  |  |  | 0.0 | 1.0 |  |"]


def test_aggregate_skips_a_malformed_file_and_a_record_whose_bwt_is_not_a_number(tmp_path):
    config.write_json_atomically(tmp_path / "good.json", fake_record("ewc", "base", 0, 50, -40))
    config.write_json_atomically(tmp_path / "joint.json", fake_record("joint", "base", 0, 90, None))  # no BWT: fine
    config.write_json_atomically(tmp_path / "text.json", fake_record("ewc", "base", 1, 60, "-30"))
    (tmp_path / "broken.json").write_text('{"ACC"')
    said = []
    rows = [line.split(" | ")[:3] for line in aggregate.aggregate(tmp_path, said.append).splitlines()
            if line.startswith(("| ewc", "| joint"))]
    skipped = [line for line in said if line.startswith("skipping")]
    assert (skipped, rows) == ([f"skipping {tmp_path / 'broken.json'}: unreadable (Expecting ':' delimiter: "
                                "line 1 column 7 (char 6))", f"skipping {tmp_path / 'text.json'}: BWT is not a number "
                                "('-30')"],
                               [["| ewc", "1", "50.00"], ["| joint", "1", "90.00"]])  # each counted once


def test_the_chart_draws_each_variant_at_its_mean_over_seeds(tmp_path):
    for seed, acc in enumerate([50.0, 52.0]):
        config.write_json_atomically(tmp_path / f"b{seed}.json", fake_record("finetune", "base", seed, acc, -10.0))
    config.write_json_atomically(tmp_path / "r.json", fake_record("finetune", "recl", 0, 70.0, -5.0))
    aggregate.aggregate(tmp_path, QUIET)
    bars = [r for r in ET.parse(tmp_path / "chart-mnist.svg").getroot().iter("{http://www.w3.org/2000/svg}rect")
            if r.get("class") == "bar"]
    assert {(b.get("data-method"), b.find("{http://www.w3.org/2000/svg}title").text, float(b.get("height")))
            for b in bars} == {("finetune", "finetune CIL: 51.00 (1.41), 2 seeds", 122.4),
                               ("finetune+recl", "finetune+recl CIL: 70.00, 1 seed", 168.0)}  # 240 px: 100%


@pytest.mark.parametrize("argv, error", [
    (["tools/aggregate.py", "/nonexistent"], "aggregate.py: error: /nonexistent is not a folder"),
    (["tools/tune.py", "--lr", "0.1"], "tune.py: error: tune chooses --lr itself; leave it out"),
    (["tools/benchmark.py", "--out", "README.md/x.json"], "benchmark.py: error: --out README.md is a file; it must "
                                                          "name a folder")])
def test_each_tool_refuses_in_one_line(argv, error):
    code, _, err = command(sys.executable, *argv)
    assert (code != 0, err.splitlines()) == (True, [error])


def test_the_paired_interval_is_the_t_interval_of_the_differences_by_hand():
    a = {0: 3.0, 1: 5.0, 2: 4.0, 3: 6.0, 4: 2.0}
    b = {0: 1.0, 1: 2.0, 2: 3.0, 3: 2.0, 4: 2.0, 9: 7.0}  # seed 9: unpaired
    # differences 2, 3, 1, 4, 0: mean 2, sample variance 10 / 4, t(0.975, df 4) = 2.776; 4 of 5 above 0
    half = 2.776 * math.sqrt(10 / 4) / math.sqrt(5)
    assert aggregate.paired(a, b) == pytest.approx((2.0, 2.0 - half, 2.0 + half, 4, 5))


@pytest.mark.parametrize("a, bold", [({0: 1.0, 1: 1.1, 2: 0.9}, True), ({0: 1.0, 1: -1.0, 2: 2.0}, False)])
def test_a_difference_is_bold_only_when_its_interval_excludes_zero(a, bold):
    assert aggregate.difference(a, {0: 0.0, 1: 0.0, 2: 0.0}).startswith("**") == bold


def test_the_accuracy_matrix_draws_one_line_per_task_and_variant(tmp_path):
    for variant, acc in (("base", 50.0), ("recl", 70.0)):
        config.write_json_atomically(tmp_path / f"{variant}.json", fake_record("finetune", variant, 0, acc, -1.0))
    aggregate.aggregate(tmp_path, QUIET)
    lines = ET.parse(tmp_path / "matrix-mnist-cil-finetune.svg").getroot().iter("{http://www.w3.org/2000/svg}polyline")
    assert {(line.get("data-panel"), line.get("data-task")) for line in lines} == {("method", "1"), ("+ReCL", "1")}

def arm_rows(folder):
    """The rows of aggregate's arms tables (mean ACC per arm, ReCL − inversion) for the records in `folder`."""
    blocks = aggregate.aggregate(folder, QUIET).split("#### ")[1:]
    return [line for block in blocks for line in block.split("\n\n")[1].splitlines()[2:]]


@pytest.mark.parametrize("folder, page", [("table", "README.md"), ("sealed", "README.md"),
                                          ("cnn-arms", "docs/evidence.md")])
def test_the_shown_arm_tables_are_what_their_runs_give(folder, page, tmp_path):
    shutil.copytree(HERE / "docs/runs" / folder, tmp_path / folder)  # aggregate draws its charts there
    rows, shown = arm_rows(tmp_path / folder), (HERE / page).read_text().splitlines()
    assert rows and [row for row in rows if row not in shown] == []


def test_see_eq3_work_reads_the_training_images_out_of_the_trained_network_not_the_untrained_one():
    # tools/see_eq3_work.py --quick: 10 MNIST images, the same Eq. 3-6 read-out from the network after and before
    # training; the trained network's candidates are far nearer the training images (it gives 0.58 against 0.14)
    from tools import see_eq3_work
    r = see_eq3_work.demonstrate(**see_eq3_work.QUICK, seed=0, log=QUIET)
    assert r["trained"]["mean_ssim"] > r["untrained"]["mean_ssim"] + 0.2
