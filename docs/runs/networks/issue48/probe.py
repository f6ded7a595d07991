"""Issue 48's probes, written against the project as it is (recl.py's four parts, config.Config).

share: how much of theta - theta_0 can Eq. 3 explain after task 1 *with the real training images* as
       its points and the best lambda >= 0 (non-negative least squares on the Gram matrix of their margin
       gradients, as Step 1 sees them: eval mode, smooth ReLU backward). The least any reconstruction of
       these points can leave. `--train-eval` trains task 1 in eval mode (dropout off, batch norm on its
       running statistics), a diagnostic only: the shipped networks train in train mode.

    PYTHONPATH=. python docs/runs/networks/issue48/probe.py share --model cnn --lr 0.01 --epochs 40 [recl.py flags]

share2: (`--head-local`: with the lever head-local below) the same after task 2 of CIL, trained as +ReCL trains it but with an ideal replay (task 1's real training
       images in place of reconstructions), for all real images of tasks 1-2, with Eq. 3's margin over every class
       seen (as recl.py) and over the image's own task's classes only (the lever `scoped-margin`).

    PYTHONPATH=. python docs/runs/networks/issue48/probe.py share2 --model cnn --lr 0.01 --epochs 40 [recl.py flags]

lever: one recl.py run with a lever on probation patched in, written as recl.py writes it (same digest
       as the run without the lever, so give it its own --out). Levers (issue 48, item 3):
       task        Eq. 3 fits the last task's change theta_t - theta_(t-1), less the share of the kept
                   candidates with their earlier lambdas (departure 2's subtraction, as it is);
       task-refit  the same target, the kept candidates fixed but their lambdas fitted again to it;
       path        the target theta - theta_0 (as today), the new candidates' gradients summed at the
                   weights in the middle of the last task and at its end;
       scoped-margin  (second session) Eq. 3's margin of a candidate over its own task's classes only: its
                   logit less the best other logit of the same task, not of every class seen (CIL).
       head-local  (third session) departure 8's local cross-entropy in the head only (CIL, --ce-scope local): the
                   body learns from the paper's cross-entropy over every class (through the head's weights,
                   detached), the head from departure 8's two terms on detached features, so that the
                   body's change is the one Eq. 3's margin over every class describes;
       gentle-first  (third session) task 1 trains at lr 0.01 for 40 epochs, the later tasks at the run's budget:
                   the first reconstruction, of task 1's classes, is read from weights Eq. 3 can read, and
                   departure 2 keeps it through the sequence;
       train-eval  (third session) every task trains in eval mode, as `share --train-eval` trains task 1:
                   AlexNet's dropout off, ResNet18's batch norm on its running statistics (left at their
                   start, 0 and 1, and not re-estimated after a task); a diagnostic network variant, for
                   the method alone and +ReCL alike.

    PYTHONPATH=. python docs/runs/networks/issue48/probe.py lever task --dataset fashion-mnist --model cnn ...
"""
import sys

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import config
import models
import recl

sys.path.insert(0, "docs/runs/networks")


def flat(d):
    return torch.cat([v.reshape(-1) for v in d.values()])


def gram_of_margin_gradients(net, params, x, y, target, chunk=8):
    """G = J J^T and b = J v (float64) for J's rows grad_theta Phi(theta; x_i), a chunk of points at a time."""
    def margin_of_one(p, xi, yi):
        return recl.margins(net, p, xi[None], yi[None])[0]
    rows = []
    for xc, yc in zip(x.split(chunk), y.split(chunk)):
        g = vmap(grad(margin_of_one), in_dims=(None, 0, 0))(params, xc, yc)
        rows.append(torch.cat([g[k].reshape(len(xc), -1) for k in params], 1))
    J = torch.cat(rows)
    G, b = torch.zeros(len(J), len(J), dtype=torch.float64), torch.zeros(len(J), dtype=torch.float64)
    for i in range(0, J.shape[1], 500_000):
        Jc = J[:, i:i + 500_000].double()
        G += Jc @ Jc.T
        b += Jc @ target[i:i + 500_000].double()
    return G, b


def nnls_share(G, b, vv, iters=20000):
    """min over lambda >= 0 of |v - J^T lambda|^2 / |v|^2 (accelerated projected gradient, convex)."""
    step = 1.0 / torch.linalg.eigvalsh(G)[-1]
    lam = torch.zeros_like(b)
    z, t = lam.clone(), 1.0
    for _ in range(iters):
        new = (z - step * (G @ z - b)).clamp_min(0)
        t_new = (1 + (1 + 4 * t * t) ** 0.5) / 2
        z, lam, t = new + (t - 1) / t_new * (new - lam), new, t_new
    return float((vv - 2 * lam @ b + lam @ G @ lam) / vv)


def share(argv):
    train_eval = "--train-eval" in argv
    argv = [a for a in argv if a != "--train-eval"]
    args = config.make_parser().parse_args(["--validation", "--device", "cpu"] + argv)
    config.check(args, probe_out=False)
    cfg = config.resolve(args, args.seed, "recl")
    tasks, *_ = config.make_tasks(cfg)
    task = tasks[0]
    torch.manual_seed(cfg.seed)  # as run_continual: the same init and shuffles
    model = models.build_model(cfg.model, task.x_train.shape[1:], len(task.classes))
    batches, loss_of, clean = recl.step2(task, task.x_train[:0], task.y_train[:0], cfg, 0)
    if train_eval:
        model.eval()
        model.train = lambda mode=True: model  # train_task's model.train() leaves it in eval mode
    recl.train_task(model, batches, loss_of, torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg.epochs, {}, {})
    if train_eval:
        del model.train  # nn.Module's own again, for the copy that reads it
    if not train_eval:  # as run_continual (in eval mode it would reset the statistics it cannot re-estimate)
        torch.optim.swa_utils.update_bn(((xb,) for xb, _, _ in clean()), model)
    model.eval()
    acc = recl.accuracy(model, task.x_test, task.y_test)
    net = models.with_smooth_relu(model, cfg.alpha).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    start = models.start_weights(model)
    v = flat({k: params[k] - start[k] for k in params})
    G, b = gram_of_margin_gradients(net, params, task.x_train, task.y_train, v)
    left = nnls_share(G, b, float(v.double() @ v.double()))
    print(f"{cfg.model} {cfg.scenario} seed {cfg.seed}, lr {cfg.lr:g} x {cfg.epochs} epochs"
          f"{' (trained in eval mode)' if train_eval else ''}: task-1 acc {acc:.1f}; the {len(task.x_train)} real "
          f"training images leave {left:.1%} of |theta - theta_0|^2 unexplained (lambda >= 0)", flush=True)


def scoped_margins(model, params, x, y, per_task=2):
    """Phi over the candidate's own task's classes only (classes per task: the shipped 2)."""
    logits = functional_call(model, params, (x,))
    group = torch.arange(logits.shape[1], device=logits.device)[None] // per_task
    logits = logits.masked_fill(group != (y // per_task)[:, None], float("-inf"))
    own = logits.gather(1, y[:, None]).squeeze(1)
    return own - logits.scatter(1, y[:, None], float("-inf")).amax(1)


def head_local_cross_entropy(model, xb, yb, replayed, n_old_classes, scope):
    """The lever head-local, in place of recl.scoped_cross_entropy (its scope "local" only)."""
    seen = []
    hook = model.head.register_forward_hook(lambda layer, inputs, out: seen.append(inputs[0]))
    try:
        logits = model(xb)
    finally:
        hook.remove()
    if scope != "local":
        raise ValueError("head-local replaces --ce-scope local only")
    body = F.cross_entropy(F.linear(seen[0], model.head.weight.detach()), yb)  # the head has no bias
    head = model.head(seen[0].detach())
    old, own = (torch.arange(head.shape[1], device=head.device) < n_old_classes)[None], ~replayed[:, None]
    grouped = head.masked_fill(torch.where(own, old, ~old), float("-inf"))
    return logits, body + F.cross_entropy(grouped, yb) + F.cross_entropy(head, yb)


def share2(argv):
    if "--head-local" in argv:
        argv = [a for a in argv if a != "--head-local"]
        recl.scoped_cross_entropy = head_local_cross_entropy
    args = config.make_parser().parse_args(["--validation", "--device", "cpu", "--scenario", "cil"] + argv)
    config.check(args, probe_out=False)
    cfg = config.resolve(args, args.seed, "recl")
    tasks, *_ = config.make_tasks(cfg)
    torch.manual_seed(cfg.seed)  # as run_continual
    per = len(tasks[0].classes)
    model = models.build_model(cfg.model, tasks[0].x_train.shape[1:], per)
    for t in (0, 1):  # task 1 alone, then task 2 with task 1's real images as the replayed rows
        x_rec, y_rec = (tasks[0].x_train, tasks[0].y_train) if t else (tasks[0].x_train[:0], tasks[0].y_train[:0])
        models.grow_head(model, per * (t + 1))
        batches, loss_of, clean = recl.step2(tasks[t], x_rec, y_rec, cfg, per * t)
        recl.train_task(model, batches, loss_of, torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg.epochs, {}, {})
        torch.optim.swa_utils.update_bn(((xb,) for xb, _, _ in clean()), model)
        model.eval()
    acc = [recl.accuracy(model, task.x_test, task.y_test) for task in tasks[:2]]
    net = models.with_smooth_relu(model, cfg.alpha).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    start = models.start_weights(model)
    v = flat({k: params[k] - start[k] for k in params})
    x, y = torch.cat([task.x_train for task in tasks[:2]]), torch.cat([task.y_train for task in tasks[:2]])
    plain, left = recl.margins, []
    for name, margins in (("every class seen", plain), ("its own task's classes", scoped_margins)):
        recl.margins = margins  # gram_of_margin_gradients reads recl.margins
        G, b = gram_of_margin_gradients(net, params, x, y, v)
        left.append(f"{nnls_share(G, b, float(v.double() @ v.double())):.1%} (margin over {name})")
    recl.margins = plain
    print(f"{cfg.model} cil seed {cfg.seed}, lr {cfg.lr:g} x {cfg.epochs} epochs, ce_scope {cfg.ce_scope}"
          f"{' (head-local)' if recl.scoped_cross_entropy is head_local_cross_entropy else ''}, replay noise "
          f"{cfg.replay_noise:g}, replay batch {cfg.replay_batch}: acc after task 2 {acc[0]:.1f} {acc[1]:.1f}; the "
          f"{len(x)} real training images leave " + ", ".join(left) + " of |theta_2 - theta_0|^2", flush=True)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def lever(name, argv):
    """Patch recl's step1 and train_task for lever `name`, then run recl.main(argv)."""
    train_task, step1 = recl.train_task, recl.step1

    def train_task_noting(model, batches, loss_of, optimizer, epochs, hooks, state):
        model.task_start, calls = snapshot(model), [0]  # theta_(t-1), new head rows as initialised

        def counting():
            calls[0] += 1
            if calls[0] == epochs // 2 + 1:  # half the epochs done: the middle of the task
                model.middle = snapshot(model)
            return batches()
        return train_task(model, counting, loss_of, optimizer, epochs, hooks, state)

    def step1_with_lever(model, old_tasks, cfg, last=None, log=print):
        if name == "task":  # departure 1 measured from the last task's start; the rest as it is
            keep, model.start = model.start, model.task_start
            try:
                return step1(model, old_tasks, cfg, last, log)
            finally:
                model.start = keep
        return step1_refit_or_path(model, old_tasks, cfg, last, log, name)

    if name == "scoped-margin":
        recl.margins = scoped_margins
    elif name == "head-local":
        recl.scoped_cross_entropy = head_local_cross_entropy
    elif name == "gentle-first":
        def train_task_gentle_first(model, batches, loss_of, optimizer, epochs, hooks, state):
            if not getattr(model, "trained_a_task", False):  # the first task: lr 0.01, 40 epochs
                model.trained_a_task = True
                for group in optimizer.param_groups:
                    group["lr"] = 0.01
                epochs = 40
            return train_task(model, batches, loss_of, optimizer, epochs, hooks, state)
        recl.train_task = train_task_gentle_first
    elif name == "train-eval":
        def train_task_in_eval_mode(model, batches, loss_of, optimizer, epochs, hooks, state):
            model.eval()
            model.train = lambda mode=True: model  # train_task's model.train() leaves it in eval mode
            try:
                return train_task(model, batches, loss_of, optimizer, epochs, hooks, state)
            finally:
                del model.train  # nn.Module's own again, for the copies that read it
        recl.train_task = train_task_in_eval_mode
        torch.optim.swa_utils.update_bn = lambda *args, **kwargs: None  # the running statistics stay at their start
    else:
        recl.train_task, recl.step1 = train_task_noting, step1_with_lever
    recl.main(argv)


def step1_refit_or_path(model, old_tasks, cfg, last, log, name):
    """recl.step1 for the levers `task-refit` and `path` (written at 9bf197b, when reconstruct also took
    departure 11's `backtrack`, off in every run here)."""
    device = next(model.parameters()).device
    labels = recl.candidate_labels(model.head.out_features, cfg.m, len(old_tasks), cfg.scenario).to(device)
    net = models.with_smooth_relu(model, cfg.alpha).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, lam = (v.to(device) for v in recl.random_start(len(labels), old_tasks[0].x_train.shape[1:], cfg.sigma_x,
                                                        cfg.seed))
    fixed = torch.zeros(len(labels), dtype=torch.bool, device=device)
    if cfg.freeze_old and last is not None:
        fixed = recl.keep_earlier(labels, x, lam, *last)
    n = len(labels)
    if name == "task-refit":
        target = {k: params[k] - model.task_start[k] for k in params}
        scale = 1.0 / sum(v.pow(2).sum() for v in target.values())
        whole = recl.stationarity_loss(net, params, labels, target, cfg.lambda_min, n, scale)
        kept_x = x.clone()

        def L_rec(free_x, all_lam):  # the kept rows fixed in x, every lambda free
            xx = kept_x.clone()
            xx[~fixed] = free_x
            return whole(xx, all_lam)
        free_x, free_lam = x[~fixed].clone().requires_grad_(), lam.clone().requires_grad_()
    else:  # path: the new candidates' gradients at the middle and the end of the last task
        target, scale = recl.displacement_target(params, model)
        if last is not None and cfg.freeze_old:
            target = recl.less_share_of(net, params, target, x[fixed], labels[fixed], lam[fixed], n)
        middle = {k: v.detach() for k, v in model.middle.items()}
        free_labels = labels[~fixed]

        def L_rec(free_x, free_lam):
            combination = recl.weighted_gradient_sum(net, params, free_x, free_labels, free_lam, n)
            at_middle = recl.weighted_gradient_sum(net, middle, free_x, free_labels, free_lam, n)
            return {"rec": scale * sum((target[k] - combination[k] - at_middle[k]).pow(2).sum() for k in params),
                    "lambda": 5 * torch.relu(cfg.lambda_min - free_lam).pow(2).sum(),
                    "prior": recl.image_prior(free_x)}
        free_x, free_lam = x[~fixed].clone().requires_grad_(), lam[~fixed].clone().requires_grad_()
    L_full = L_rec
    if cfg.ce_weight:
        L_full = recl.plus_inversion_term(L_rec, net, params, labels[~fixed], cfg.ce_weight)
    opt = recl.adam if cfg.rec_optimizer == "adam" else (lambda v, lr: torch.optim.SGD([v], lr=lr, momentum=0.9))
    optimizers = [opt(free_x, cfg.lr_x), opt(free_lam, cfg.lr_lambda)]
    best_x, best_lam, report = recl.reconstruct(L_full, free_x, free_lam, optimizers, cfg.n_rec, log)
    x[~fixed] = best_x
    if name == "task-refit":
        lam = best_lam
    else:
        lam[~fixed] = best_lam
    return x, labels, lam, {"candidates": len(x), "optimised": int((~fixed).sum()), "rec_scale": float(scale),
                            **report}


if __name__ == "__main__":
    if sys.argv[1] == "share":
        share(sys.argv[2:])
    elif sys.argv[1] == "share2":
        share2(sys.argv[2:])
    else:
        lever(sys.argv[2], sys.argv[3:])
