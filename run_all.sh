#!/usr/bin/env bash
# The full results table: every method alone (base), alone at +ReCL's budget (budget), with ReCL
# (recl), with the inversion control (inversion), with m real old images (real, the ceiling) and with
# class centroids (centroids, the floor), and the joint upper bound, in CIL and DIL, over 5 seeds.
#
#   bash run_all.sh [recl.py flags]         every run, JOBS at a time, then RESULTS/table.md
#   QUICK=1 bash run_all.sh                 1 seed, 5 epochs, 20 steps: a smoke test, its numbers mean nothing
#   JOBS=2 METHODS="finetune gpm" bash run_all.sh --epochs 30    your flags go to every run that takes them
#
# Knobs: DATASETS (mnist; or fashion-mnist cifar10, or your .pt files),
#   SCENARIOS (cil dil), METHODS (all), VARIANTS (base budget recl inversion real centroids: the method
#   alone, alone at +ReCL's budget, +ReCL, and the inversion, real-image and centroid arms), SEEDS (5),
#   FIRST_SEED (0: seeds FIRST_SEED .. FIRST_SEED+SEEDS-1), JOBS (1, or one per
#   GPU in DEVICES), DEVICES ("0 1": the workers take the GPUs in turn), RESULTS (results, or
#   results/FLAGS for other flags), DATA_ROOT (data), QUICK, DRY_RUN, PYTHON (python).
# Every run is checked before any starts: one line and exit 2 for a bad knob or flag.
# Resumable: a run writes its JSON atomically, named by its config's digest, and the list holds
# only the runs without one, so an interrupted run_all.sh loses at most the runs in flight.
# DRY_RUN=1 prints that list, one command per line, for xargs, GNU parallel or a SLURM array
# (docs/running.md). A run that fails is named in one line; the others go on, exit 1.
# A sweep is a loop:  for m in 10 25 50; do RESULTS=results/m-$m bash run_all.sh --m $m; done
# The methods' validation search: python tools/tune.py --method ewc --scenario cil (docs/hyperparameters.md).
set -euo pipefail
if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
PYTHON=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
plan=$("$PYTHON" "$here/tools/plan.py" "$@") || exit 2  # from your folder: your paths are read there
results=$(head -n 1 <<< "$plan") todo=$(tail -n +2 <<< "$plan")
if [ "${DRY_RUN:-0}" = 1 ]; then
  [ -z "$todo" ] || printf '%s\n' "$todo"
  exit 0
fi
cd "$here"
read -r -a devices <<< "${DEVICES:-}"
JOBS=${JOBS:-$(( ${#devices[@]} > 1 ? ${#devices[@]} : 1 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))}  # yours wins
export DEVICES; start=$(date +%s) failed=0
if [ -n "$todo" ]; then
  set -m  # the runs in a process group of their own, which a signal to run_all stops whole
  # xargs runs JOBS lines at a time; worker SLOT takes GPU DEVICES[SLOT mod n], if any are listed
  printf '%s\n' "$todo" | xargs -d '\n' -P "$JOBS" --process-slot-var=SLOT -I{} bash -c '
    read -r -a gpus <<< "$DEVICES"
    [ ${#gpus[@]} -eq 0 ] || export CUDA_VISIBLE_DEVICES=${gpus[$((SLOT % ${#gpus[@]}))]}
    eval "$1" || { echo "run_all: FAILED: $1" >&2; exit 1; }' _ {} &
  trap 'kill -- -$(jobs -p) 2>/dev/null; echo "run_all: interrupted; finished runs are kept" >&2; exit 130' INT TERM
  wait $! || failed=1
fi
echo "run_all: finished in $(( $(date +%s) - start ))s" >&2
"$PYTHON" tools/aggregate.py "$results" | tee "$results/table.md"
[ "$failed" = 0 ] || { echo "run_all: runs named FAILED above failed; the table holds the others" >&2; exit 1; }
