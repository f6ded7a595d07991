#!/usr/bin/env bash
# The attribution ladder of docs/attribution.md: Finetune+ReCL from the paper as
# written (--paper) to today's defaults, one departure at a time, each rung with
# the stationarity objective, the inversion control and --n-rec 1, 5 seeds, test set.
# Resumable like run_all.sh. Usage: JOBS=2 bash docs/runs/attribution/ladder.sh
# The last rung's two objectives are today's defaults (rung 6 in CIL, 5 in DIL):
# the README's table runs them (docs/runs/table-bf16), as it runs the inversion
# control at rungs 5 and 6 (the CE weight does not enter inversion). Inversion
# ignores what L_rec fits, so rung 1's inversion column is rung 0's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${LADDER_OUT:-docs/runs/attribution/ladder}
rung() {  # rung NAME SCENARIO VARIANTS FLAGS...: the objectives asked for, then the --n-rec 1 control
  local name=$1 scenario=$2 variants=$3; shift 3
  if [ -n "$variants" ]; then
    SCENARIOS=$scenario METHODS=finetune SEEDS=5 VARIANTS=$variants RESULTS=$out/$name bash run_all.sh "$@"
  fi
  SCENARIOS=$scenario METHODS=finetune SEEDS=5 VARIANTS=recl RESULTS=$out/$name-n-rec-1 \
    bash run_all.sh "$@" --n-rec 1
}
for scenario in cil dil; do
  budget=(--lr 0.1 --epochs 20)  # the +ReCL variant's own training (config.PRESETS, second column)
  [ "$scenario" = dil ] && budget=(--lr 0.05 --epochs 20)
  rung 0-paper "$scenario" "recl inversion" --paper
  rung 1-displacement "$scenario" recl --paper --rec-target displacement
  rung 2-kept "$scenario" "recl inversion" --paper --rec-target displacement --freeze-old
  rung 3-filter "$scenario" "recl inversion" --paper --rec-target displacement --freeze-old --filter
  rung 4-budget "$scenario" "recl inversion" --paper --rec-target displacement --freeze-old --filter "${budget[@]}"
  noise=(--paper --rec-target displacement --freeze-old --filter "${budget[@]}" --replay-noise 2.5)
  if [ "$scenario" = dil ]; then  # DIL's defaults end here
    rung 5-noise dil "" "${noise[@]}"
  else  # CIL's go on to departure 5
    rung 5-noise cil recl "${noise[@]}"
    rung 6-ce cil "" "${noise[@]}" --ce-weight 3e-4
  fi
done
