"""Tests in the order the code teaches, each one claim against a reference: the paper's maths
(Eq. 1-6), its two loops, the departures, the task loop on trained networks; then data,
networks, strategies and judging; then the command line, run_all.sh and the tools.
Run with `python -m pytest -q`; everything runs on tiny problems on the CPU."""
import ast
import copy
import dataclasses
import json
import math
import os
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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


def test_the_papers_part_takes_values_and_reads_no_setting():
    source = (HERE / "recl.py").read_text()
    part1 = source[source.index("# 1. The paper"):source.index("# 2. A run")]
    assert "cfg" not in {n.id for n in ast.walk(ast.parse(part1)) if isinstance(n, ast.Name)}


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


def test_backtracking_undoes_a_step_that_raised_the_loss_and_halves_the_step():
    runs = {}
    for backtrack in (False, True):
        x = torch.full((4,), 1.0).requires_grad_()
        runs[backtrack] = recl.reconstruct(bowl([]), x, torch.rand(4), [torch.optim.SGD([x], lr=1.5)], 30, QUIET,
                                           backtrack)[2]
    assert runs[False]["failed"] and runs[False]["kept_loss"] == runs[False]["first_loss"]
    assert runs[True]["failed"] is None and runs[True]["backtracks"] > 0
    assert runs[True]["kept_loss"] == pytest.approx(-0.25, abs=1e-3)  # the bottom: 4 x (x^2 - x / 2) at x = 1/4


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
    model, labels = displaced(models.remember_start(small_batch_norm_net())).eval(), torch.arange(3).repeat_interleave(4)
    for lr_x in (1e-2, 1e4):
        x, _, report = step1(model, labels, (1, 8, 8), run_config(rec_optimizer=optimizer, lr_x=lr_x, n_rec=20))
        assert torch.isfinite(x).all() and report["kept_loss"] <= report["first_loss"]


@pytest.mark.parametrize("optimizer, lr_x, lr_lambda", [("sgd", 1e-6, 0.1), ("adam", 1e4, 0.01)])
def test_backtracking_rescues_a_batch_norm_reconstruction_that_overflows(optimizer, lr_x, lr_lambda):
    model, labels = displaced(models.remember_start(small_batch_norm_net())), torch.arange(3).repeat_interleave(4)
    for layer in model.modules():  # tiny running variances: huge margin gradients (docs/networks.md)
        if isinstance(layer, nn.BatchNorm2d):
            layer.running_var.mul_(1e-4)
    run = lambda backtrack: step1(model.eval(), labels, (1, 8, 8), run_config(
        rec_optimizer=optimizer, lr_x=lr_x, lr_lambda=lr_lambda, n_rec=40, backtrack=backtrack))[2]
    plain, rescued = run(False), run(True)
    assert plain["failed"] and plain["kept_loss"] == plain["first_loss"]
    assert rescued["failed"] is None and rescued["kept_loss"] < 0.9 * rescued["first_loss"]


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
