#!/usr/bin/env bash
# Each arm's own knob, chosen on validation (seeds 0-2, Finetune; GPM's replay noise on or off, as +ReCL's was):
# the replay noise of the real and centroids arms, and the inversion control's lr_x. From the repository root:
#   JOBS=2 bash docs/runs/arms/tune.sh ; python tools/aggregate.py docs/runs/arms/validation/NAME
set -euo pipefail
out=docs/runs/arms/validation
for noise in 0 1 2.5 5; do
  RESULTS=$out/noise-$noise METHODS=finetune VARIANTS="real centroids" SEEDS=3 bash run_all.sh --validation --replay-noise $noise
done
for noise in 0 2.5; do
  RESULTS=$out/gpm-noise-$noise METHODS=gpm VARIANTS="real centroids" SEEDS=3 bash run_all.sh --validation --replay-noise $noise
done
for lr in 0.001 0.003 0.01 0.03; do
  RESULTS=$out/inversion-cil-lr_x-$lr SCENARIOS=cil METHODS=finetune VARIANTS=inversion SEEDS=3 bash run_all.sh --validation --lr-x $lr
done
for lr in 0.1 0.3 1 3; do
  RESULTS=$out/inversion-dil-lr_x-$lr SCENARIOS=dil METHODS=finetune VARIANTS=inversion SEEDS=3 bash run_all.sh --validation --lr-x $lr
done
