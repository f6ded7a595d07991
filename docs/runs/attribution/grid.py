"""The README's side-by-side figure: real old images, their nearest stationarity
reconstructions and their nearest inversion reconstructions.

    python recl.py --scenario S --method finetune --variant recl --save-images --out OUT
    python recl.py --scenario S --method finetune --variant recl --rec-objective inversion --save-images --out OUT
    python docs/runs/attribution/grid.py OUT S docs/stationarity-vs-inversion-S-seed0-task5.png

Each reconstruction was made by its own run before task 5 of seed 0, from the
model that run had trained; the real images are the training images of tasks 1-4,
two of each old class (CIL) or of each class of each old task (DIL).
"""
import sys
from pathlib import Path

import torch
from torchvision.utils import save_image

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import data  # noqa: E402
import judging  # noqa: E402
import recl  # noqa: E402

folder, scenario, target = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tasks, _, mean_image, _ = data.make_tasks("mnist", 0, 100, scenario)
real = torch.cat([t.x_train for t in tasks[:4]])
pick = torch.linspace(0, len(real) - 1, 16).long()  # two images from each block of 100: each old class
rows = [judging.as_picture(real[pick], mean_image)]
for name in ("finetune+recl", "finetune+inversion"):
    (path,) = folder.glob(f"mnist-{scenario}-{name}-*-seed0-task5.pt")  # NAME-DIGEST-seed0-task5.pt
    found = torch.load(path, weights_only=True)
    found = found["x"] if isinstance(found, dict) else found  # today's files hold x, pixels and labels
    nearest = judging.nearest_candidates(real, found)
    shown = judging.on_reference_scale(found, real)[nearest[pick]]
    ssim = judging.reconstruction_quality(real, found, mean_image)[0].mean().item()
    print(f"{name}: {len(found)} reconstructions, mean nearest-pair SSIM {ssim:.3f}")
    rows.append(judging.as_picture(shown, mean_image))
save_image(torch.cat(rows), target, nrow=16, padding=1, pad_value=1.0)
print(f"rows: real, stationarity (ReCL), inversion -> {target}")
