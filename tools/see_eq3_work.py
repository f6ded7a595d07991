"""See Eq. 3 work: read training images back out of a network's weights, in the regime its theory is about.
(Haim et al. 2022, Buzaglo et al. 2023; what it shows, and its numbers: docs/see-eq3-work.md.)"""
import argparse, copy, sys  # noqa: E401
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules, from any folder
import data, models, recl, torch  # noqa: E401, E402
HIDDEN, TRAIN_LR = 500, 0.1  # 784-500-500-2: the paper's MLP, narrower than its 1000 for speed; plain gradient descent
PER_IMAGE, ALPHA, LR_X, RECOVERED = 2, 150.0, 1.0, 0.4  # Haim et al.'s candidates per image and MNIST alpha; lr_x 1

def demonstrate(per_digit=2, train_steps=4000, rec_steps=3000, seed=0, log=print):
    """Steps 1-4; per candidate set (trained, untrained, held_out) its SSIM scores, and the unseen images' against the
    trained network's candidates; and x and mean_image."""
    torch.manual_seed(seed)
    # 1. per_digit MNIST images of each digit, even (class 0) against odd (1): two classes, one lambda per image (Eq. 9)
    tasks, class_order, mean_image, _ = data.make_tasks("mnist", seed, n_per_class=per_digit)
    odd, pool = torch.tensor(class_order) % 2, lambda part: torch.cat([getattr(task, part) for task in tasks])
    x, y, x_held, y_held = pool("x_train"), odd[pool("y_train")], pool("x_test"), odd[pool("y_test")]  # y by the digit
    x, y, n = x[y.argsort(stable=True)], y.sort(stable=True).values, PER_IMAGE * len(x)  # even first: a tidier PNG
    log(f"{len(x)} training images ({per_digit} of each digit; class 0 even, class 1 odd), {n} candidates")
    # 2. Full-batch gradient descent until the loss is tiny: theta nears App. B.2's KKT point, Eq. 9-10 (Lyu & Li 2020)
    model = models.MLP(x[0].numel(), 2, hidden=HIDDEN)  # fc1 and its bias (the only one) ~ N(0, 1e-4^2): small
    untrained, optimizer = copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    log(f"training {x[0].numel()}-{HIDDEN}-{HIDDEN}-2 by full-batch gradient descent, lr {TRAIN_LR}:")
    for step in range(train_steps + 1):  # the last pass only reports
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step % max(1, train_steps // 4) == 0 or step == train_steps:
            margin = recl.margins(model, dict(model.named_parameters()), x, y).min().item()
            log(f"    step {step}/{train_steps}: loss {loss.item():.2e}, smallest margin {margin:.2f}")
        if step < train_steps:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    # 3. Step 1 as a --paper run does it (Eq. 3 fits theta itself), and before training: control (a), is it training's?
    cfg = recl.Config(**recl.PAPER, m=n // 2, n_rec=rec_steps, lr_x=LR_X, alpha=ALPHA, seed=seed)  # n/2 per class
    r = {"x": x, "mean_image": mean_image}
    for name, net in (("trained", model), ("untrained", untrained)):
        log(f"Eq. 3-6 on the {name} network's weights, {rec_steps} steps:")
        c, labels, lam, report = recl.step1(net, tasks, cfg, log=log)
        net = recl.with_smooth_relu(net, ALPHA).eval()  # step1's copy, backward sigmoid(alpha z): Eq. 3's gradient
        combination = recl.weighted_gradient_sum(net, dict(net.named_parameters()), c, labels, lam)  # the sum in Eq. 3
        left = {k: ((p - combination[k]).pow(2).sum() / p.pow(2).sum()).item() for k, p in net.named_parameters()}
        log(f"    L_full {report['first_loss']:.4g} -> {report['kept_loss']:.4g}; share of each layer Eq. 3 leaves "
            "unexplained: " + ", ".join(f"{k} {v:.1%}" for k, v in left.items()))
        r[name] = {"candidates": c, "left": left}
    g, picks = torch.Generator().manual_seed(seed), [(y_held == k).nonzero()[:, 0] for k in (0, 1)]  # control (b)
    drawn = [p[torch.randperm(len(p), generator=g)[:n // 2]] for p in picks]  # unseen images, n/2 of each class
    r["held_out"] = {"candidates": x_held[torch.cat(drawn)]}
    unseen = x_held[torch.cat([d[:len(x) // 2] for d in drawn])]  # (c): as many as the training images, as balanced
    score = lambda ssim: dict(mean_ssim=ssim.mean().item(), recovered=(ssim > RECOVERED).float().mean().item())
    for s in r["trained"], r["untrained"], r["held_out"]:  # 4. each training image's SSIM with its nearest candidate
        ssim, s["nearest"] = recl.reconstruction_quality(x, s["candidates"], mean_image)  # (App. D.5)
        s.update(score(ssim))
    r["unseen"] = score(recl.reconstruction_quality(unseen, r["trained"]["candidates"], mean_image)[0])  # (c), alike
    return r

if __name__ == "__main__":
    parser = argparse.ArgumentParser(usage=argparse.SUPPRESS, description=__doc__.splitlines()[0])  # errors: 1 line
    parser.add_argument("--seed", type=int, default=0, help="of the images drawn and of both starts (default 0)")
    parser.add_argument("--per-digit", type=int, default=2, help="training images of each digit (default 2: 20)")
    parser.add_argument("--out", type=Path, default=Path("results/see-eq3-work.png"), help="the PNG (%(default)s)")
    args = parser.parse_args()
    if (not 0 <= args.seed < 2 ** 31 or not 1 <= args.per_digit <= 100 or args.out.suffix != ".png"
            or any(p.is_file() for p in args.out.parents)):
        parser.error(f"want --seed in 0..{2 ** 31 - 1}, --per-digit in 1..100 and --out a .png file in a folder; got "
                     f"{args.seed}, {args.per_digit}, {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the minute of work, so that a bad --out fails at once
    torch.set_num_threads(1)  # small matrices: as fast, and the same numbers on every run
    r = demonstrate(args.per_digit, seed=args.seed, log=lambda *a: print(*a, flush=True))
    t, u, h, c, n = r["trained"], r["untrained"], r["held_out"], r["unseen"], len(r["held_out"]["candidates"])
    recl.save_pairs(args.out, r["x"], t["candidates"], t["nearest"], r["mean_image"])  # 5. the PNG
    line = lambda s, word="recovered": f"{s['recovered']:.0%} {word}, mean SSIM {s['mean_ssim']:.2f}"
    beats = all(t[k] > max(u[k], h[k], c[k]) + (0.05 if k == "mean_ssim" else 0) for k in ("mean_ssim", "recovered"))
    print(f"trained network:      {line(t)} ({len(r['x'])} training images, SSIM > {RECOVERED} with the nearest of {n} "
          f"candidates; first layer {1 - t['left']['fc1.weight']:.0%} explained by Eq. 3)\n"
          f"unseen images:        {line(c, 'matched')} (as many held-out images of the same classes, each with its "
          f"nearest candidate: the memorisation gap is {100 * (t['recovered'] - c['recovered']):+.0f} points)\n"
          f"untrained network:    {line(u)} (same reconstruction from the network before training)\n"
          f"held-out look-alikes: {line(h)} ({n} unseen images of the same digits in the candidates' place)\nverdict: "
          + ("Eq. 3 read training images out of the trained weights: its candidates beat all three controls." if beats
             else "Eq. 3's candidates did NOT clearly beat all three controls here.") + "\ntraining images over their "
          f"nearest candidates (trained network): {args.out}")
