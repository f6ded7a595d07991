"""Judging a reconstruction (reporting only: training never sees these real images), and Sec. 4.3's search (at
the end). App. D.5: (1) standardise both sets and match each real image to its nearest candidate by L2; (2) add the
training mean image back, stretch each image to [0, 1]; (3) SSIM of each pair (Haim et al. 2022: > 0.4 is recovered).
In (2) the paper adds the mean to the *standardised* candidates, so even exact copies score well below 1; we first
give them the real set's mean image and spread: SSIM ignores only their scale and offset."""
import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def ssim(a, b, window=11, sigma=1.5):
    """Mean SSIM (Wang et al. 2004) of each image pair in [0, 1]; Gaussian window, valid borders."""
    channels, size = a.shape[1], min(window, a.shape[-2], a.shape[-1])
    g = torch.exp(-(torch.arange(size, dtype=a.dtype, device=a.device) - (size - 1) / 2) ** 2 / (2 * sigma ** 2))
    kernel = (torch.outer(g, g) / g.sum() ** 2).expand(channels, 1, size, size)
    blur = lambda t: F.conv2d(t, kernel, groups=channels)
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    index = (2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return index.flatten(1).mean(1)


def standardise(images):
    """Each image minus the set's mean image, divided by the set's spread around it."""
    centred = images - images.mean(0)
    return centred / centred.std().clamp_min(1e-12)


def nearest_candidates(reference, candidates):
    """Index of the nearest candidate for each reference image, each set standardised on its own."""
    return torch.cdist(standardise(reference).flatten(1), standardise(candidates).flatten(1)).argmin(1)


def on_reference_scale(candidates, reference):
    """Standardised candidates with the reference set's mean image and spread."""
    return standardise(candidates) * (reference - reference.mean(0)).std() + reference.mean(0)


def as_picture(x, mean_image):
    """Undo the mean subtraction and stretch each image to [0, 1]."""
    x = x + mean_image
    low, high = (m.view(-1, *[1] * (x.dim() - 1)) for m in x.flatten(1).aminmax(dim=1))
    return (x - low) / (high - low).clamp_min(1e-12)


def reconstruction_quality(reference, candidates, mean_image):
    """SSIM of every reference image with its nearest candidate, and those candidates' indices."""
    nearest = nearest_candidates(reference, candidates)
    shown = on_reference_scale(candidates, reference)[nearest]
    return ssim(as_picture(reference, mean_image), as_picture(shown, mean_image)), nearest


def save_pairs(path, reference, candidates, nearest, mean_image, n=32):
    """PNG grid: rows of real images, each row followed by the nearest reconstructions."""
    from torchvision.utils import save_image
    pick = torch.linspace(0, len(reference) - 1, min(n, len(reference))).long()  # spread over old classes
    real = as_picture(reference[pick], mean_image)
    found = as_picture(on_reference_scale(candidates, reference)[nearest[pick]], mean_image)
    rows = [t for pair in zip(real.split(16), found.split(16)) for t in pair]
    save_image(torch.cat(rows).cpu(), path, nrow=16, padding=1, pad_value=1.0)


def judge_reconstruction(old_tasks, x_rec, cfg, mean_image):
    """SSIM of the old real images with their nearest reconstructions, with as many of the random candidates they
    started from (a floor), and with held-out real images of the old classes (a ceiling: look-alikes, not copies)."""
    real = torch.cat([t.x_train for t in old_tasks])
    mean_image = mean_image.to(real.device)
    # the noise the candidates started from: the same draw as recl.random_start (the stored arms start from none)
    start = torch.randn(len(x_rec), *real.shape[1:], generator=torch.Generator().manual_seed(cfg.seed)) * (
        cfg.sigma_x or 0.0)
    held_out = torch.cat([t.x_test for t in old_tasks])
    pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(cfg.seed))[:len(x_rec)]
    found, nearest = reconstruction_quality(real, x_rec, mean_image)
    floor, _ = reconstruction_quality(real, start.to(real.device), mean_image)
    ceiling, _ = reconstruction_quality(real, held_out[pick.to(held_out.device)], mean_image)
    quality = {}
    for prefix, scores in (("", found), ("init_", floor), ("real_", ceiling)):
        quality[prefix + "mean_ssim"] = scores.mean().item()
        quality[prefix + "frac_ssim_above_0_4"] = (scores > 0.4).float().mean().item()
    quality.update(memorisation_gap(x_rec, real, held_out, mean_image, cfg.seed))
    return quality, real, nearest, mean_image


def memorisation_gap(x_rec, train, held_out, mean_image, seed):
    """Each reconstruction's SSIM with its nearest among n of the old classes' training images and among n of their
    held-out images (n the smaller set's size). Nearer its own training images than unseen ones, a reconstruction has
    read something of those samples; level, it has read what the class shares (a prototype)."""
    n, gen = min(len(train), len(held_out)), torch.Generator().manual_seed(seed)
    own = train[torch.randperm(len(train), generator=gen)[:n].to(train.device)]
    unseen = held_out[torch.randperm(len(held_out), generator=gen)[:n].to(held_out.device)]
    to_own = reconstruction_quality(x_rec, own, mean_image)[0].mean().item()
    to_unseen = reconstruction_quality(x_rec, unseen, mean_image)[0].mean().item()
    return {"ssim_to_training": to_own, "ssim_to_held_out": to_unseen, "memorisation_gap": to_own - to_unseen}


def report_reconstruction(name, old_tasks, x_rec, cfg, mean_image, image_path=None, log=print, labels=None):
    """Log how close the reconstructions made before task len(old_tasks) + 1 are; given the run's JSON path RUN.json
    as `image_path`, save their image grid as RUN-taskT.png and RUN-taskT.pt: the candidates as the network takes them
    ("x"), as pixels in [0, 1] (the training mean image added back) and their labels. Returns the figures."""
    task = len(old_tasks) + 1
    quality, real, nearest, mean_image = judge_reconstruction(old_tasks, x_rec, cfg, mean_image)
    log(f"  [{name}] task {task}: SSIM to nearest real image {quality['mean_ssim']:.3f} "
        f"(random candidates {quality['init_mean_ssim']:.3f}, held-out real {quality['real_mean_ssim']:.3f}), "
        f"{100 * quality['frac_ssim_above_0_4']:.0f}% above 0.4")
    if image_path is not None:
        path = Path(image_path).with_name(f"{Path(image_path).stem}-task{task}.png")  # RUN.json -> RUN-taskT.png
        path.parent.mkdir(parents=True, exist_ok=True)
        save_pairs(path, real, x_rec, nearest, mean_image)
        torch.save({"x": x_rec.cpu(), "pixels": (x_rec + mean_image).clamp(0, 1).cpu(),
                    "labels": None if labels is None else labels.cpu()}, path.with_suffix(".pt"))
        log(f"  [{name}] task {task}: images in {path} and {path.with_suffix('.pt')}")
    return {"task": task, **quality}


# --- Tuning the reconstruction during training (Sec. 4.3) ----------------------------------
# naive: the run's own values. unsup: a random search before each task, keeping the trial with the lowest final L_full.
# sup: scored by SSIM against a few stored real old images. Trial 1 is the run's own values; each draw is log-uniform
# within a factor of them, where App. B.3 gives fixed ranges (docs/departures.md, "The search space of Sec. 4.3").
SEARCH_SPACE = {"sigma_x": 10.0, "lr_x": 10.0, "lr_lambda": 10.0, "lambda_min": 3.0, "alpha": 3.0}


def random_search(candidates, evaluate):
    """Score each settings dict by evaluate(settings) -> (score, summary, payload); return every (score, settings,
    summary), best first (ties: the earlier; non-finite: last), and the best trial's payload."""
    trials, best = [], None
    for settings in candidates:
        score, summary, payload = evaluate(settings)
        score = score if math.isfinite(score) else -math.inf
        trials.append((score, settings, summary))
        if best is None or score > best[0]:
            best = (score, payload)
    return sorted(trials, key=lambda trial: -trial[0]), best[1]  # sorted() is stable: ties keep their order


def sample_hyperparameters(gen, centre):
    """One draw: each hyperparameter of `centre` log-uniform in [centre / factor, centre * factor]."""
    return {name: centre[name] * SEARCH_SPACE[name] ** (2 * torch.rand(1, generator=gen).item() - 1) for name in centre}


def search_reconstruction(reconstruct_with, old_tasks, cfg, log=print, mean_image=None):
    """Step 1 with a search: `cfg.trials` reconstructions, `reconstruct_with(cfg)` each; the one
    the score rates highest, as (x, y, lambdas, report)."""
    seed = cfg.seed * 100 + len(old_tasks)  # the search's own draws, new before each task
    if cfg.tuning == "unsup":  # the lowest final L_full; needs no old data
        score = lambda x, report: -report["kept_loss"]
    else:  # sup: SSIM against a few stored real images of each old task
        draws = torch.Generator().manual_seed(seed)
        few = lambda n: torch.randperm(n, generator=draws)[:max(1, round(0.1 * n))]  # a tenth of each old task
        buffer = torch.cat([t.x_train[few(len(t.x_train))] for t in old_tasks])
        mean = torch.zeros(buffer.shape[1:]) if mean_image is None else mean_image
        score = lambda x, report: reconstruction_quality(buffer, x, mean.to(x.device))[0].mean().item()
    gen = torch.Generator().manual_seed(seed)
    own = {k: getattr(cfg, k) for k in SEARCH_SPACE if getattr(cfg, k) is not None}
    candidates = [own] + [sample_hyperparameters(gen, own) for _ in range(cfg.trials - 1)]
    def evaluate(hp):
        x, y, lam, report = reconstruct_with(dataclasses.replace(cfg, **hp))
        useless = not math.isfinite(report["kept_loss"]) or report["kept_loss"] >= report["first_loss"]
        value = -math.inf if useless else score(x, report)
        log(f"    trial {candidates.index(hp) + 1}/{cfg.trials}: " + " ".join(f"{k} {v:.3g}" for k, v in hp.items())
            + f" -> score {value:.4g}")
        return value, None, (x, y, lam, {**report, "hyperparameters": hp, "score": value})
    return random_search(candidates, evaluate)[1]
