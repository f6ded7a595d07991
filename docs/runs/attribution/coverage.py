"""Which old tasks do the reconstructions stand for? For every run's candidates made
before the last task (saved by --save-images), assign each candidate to the old task
of its nearest real training image (the standardised L2 of App. E), and score each
old task's real images by the SSIM of their nearest candidate.

    for s in 0 1 2 3 4; do for o in stationarity inversion; do
      python recl.py --scenario dil --method finetune --variant recl --rec-objective $o --seed $s \\
        --save-images --quiet --out OUT; done; done
    python docs/runs/attribution/coverage.py OUT dil

In DIL every label covers one class of every old task, so a reconstruction can
stand for any of them; in CIL each label is one old task's class.
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import data  # noqa: E402
import judging  # noqa: E402
import recl  # noqa: E402

folder, scenario = Path(sys.argv[1]), sys.argv[2]
print(f"| objective | seeds | candidates nearest to task 1 / 2 / 3 / 4 (%) | SSIM of task 1 / 2 / 3 / 4 |")
print("|---|---|---|---|")
for name in ("finetune+recl", "finetune+inversion"):
    shares, scores = [], []
    for path in sorted(folder.glob(f"mnist-{scenario}-{name}-*-seed*-task5.pt")):
        seed = int(path.stem.split("-seed")[1].split("-")[0])
        tasks, _, mean_image, _ = data.make_tasks("mnist", seed, 100, scenario)
        real = torch.cat([t.x_train for t in tasks[:4]])
        task_of = torch.arange(4).repeat_interleave(torch.tensor([len(t.x_train) for t in tasks[:4]]))
        found = torch.load(path, weights_only=True)
        found = found["x"] if isinstance(found, dict) else found  # today's files hold x, pixels and labels
        nearest_real = judging.nearest_candidates(found, real)  # for each candidate, its nearest real image
        shares.append(torch.bincount(task_of[nearest_real], minlength=4).float() / len(found) * 100)
        ssim, _ = judging.reconstruction_quality(real, found, mean_image)
        scores.append(torch.stack([ssim[task_of == t].mean() for t in range(4)]))
    if shares:
        share, score = torch.stack(shares).mean(0), torch.stack(scores).mean(0)
        print(f"| {name} | {len(shares)} | " + " / ".join(f"{v:.0f}" for v in share) + " | "
              + " / ".join(f"{v:.3f}" for v in score) + " |")
