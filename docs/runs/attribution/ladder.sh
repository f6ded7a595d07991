#!/usr/bin/env bash
# The attribution ladder of docs/attribution.md: Finetune+ReCL from the paper as
# written (--paper) to today's defaults, one departure at a time, each rung with
# the stationarity objective, the inversion control and --n-rec 1, 5 seeds, test set.
# Resumable like run_all.sh. Usage: JOBS=2 bash docs/runs/attribution/ladder.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/runs/attribution/ladder
rung() {  # rung NAME SCENARIO FLAGS...: the two objectives, then the --n-rec 1 control
  local name=$1 scenario=$2; shift 2
  SCENARIOS=$scenario METHODS=finetune SEEDS=5 VARIANTS="recl inversion" RESULTS=$out/$name \
    bash run_all.sh "$@"
  SCENARIOS=$scenario METHODS=finetune SEEDS=5 VARIANTS=recl RESULTS=$out/$name-n-rec-1 \
    bash run_all.sh "$@" --n-rec 1
}
for scenario in cil dil; do
  budget=(--lr 0.1 --epochs 20)  # the +ReCL variant's own training (strategies.TUNED_RECL)
  [ "$scenario" = dil ] && budget=(--lr 0.05 --epochs 20)
  rung 0-paper "$scenario" --paper
  rung 1-displacement "$scenario" --paper --rec-target displacement
  rung 2-kept "$scenario" --paper --rec-target displacement --freeze-old
  rung 3-filter "$scenario" --paper --rec-target displacement --freeze-old --filter
  rung 4-budget "$scenario" --paper --rec-target displacement --freeze-old --filter "${budget[@]}"
  rung 5-noise "$scenario" --paper --rec-target displacement --freeze-old --filter "${budget[@]}" --replay-noise 2.5
done
