#!/usr/bin/env bash
# The full results table: every method alone, with ReCL and with the inversion
# control (VARIANTS), and the joint upper bound, in CIL and DIL,
# over several seeds (JOBS worker processes working through one list of runs),
# then one table.
#
#   bash run_all.sh                      # everything, 5 seeds
#   QUICK=1 bash run_all.sh              # 1 seed, few epochs and steps: minutes
#                                        # (SEEDS=3 QUICK=1, QUICK=1 ... --epochs 10: yours win)
#   JOBS=2 METHODS="finetune gpm" bash run_all.sh --epochs 30   # args pass through
#   TUNE=1 JOBS=2 bash run_all.sh        # the validation search behind the methods' rows
#   SWEEP="m 10 25 50 75 125" METHODS=finetune bash run_all.sh   # a sensitivity study:
#                                        # one folder per value, RESULTS/m-10, ..., each run with --m 10, ...
#
# QUICK=1 is a smoke test: its numbers mean nothing.
# Resumable: each run writes its own JSON atomically, named by its config's
# digest, and a run whose JSON exists is skipped, so an interrupted run_all.sh
# loses at most the runs in flight. After a default changes, the same command
# is another config, so it runs again beside the old result.
# A run that fails is named in one line; the others go on, the table is made
# from what finished, and run_all.sh exits non-zero.
# Without RESULTS=..., QUICK=1 and extra arguments choose their own folder.
# Datasets that cannot be loaded (say, CIFAR10 on a machine without internet)
# are skipped with one line saying why; if none can, nothing runs (exit 2).
# Knobs: DATASETS SCENARIOS METHODS VARIANTS SEEDS JOBS DEVICES RESULTS DATA_ROOT QUICK TUNE SWEEP PYTHON DRY_RUN.
# DEVICES="0 1": worker j runs on GPU DEVICES[j mod n] (CUDA_VISIBLE_DEVICES); each JSON names its device.
# DRY_RUN=1 prints one runnable command per line on stdout (the count goes to stderr), for xargs -P,
# GNU parallel or a SLURM job array: every run skips a result that exists and writes atomically.
set -euo pipefail
refuse() { echo "run_all: $1" >&2; exit 2; }
# Your own .pt files, RESULTS and DATA_ROOT are read from where you are, wherever run_all.sh lives.
for knob in RESULTS DATA_ROOT; do
  [ -n "${!knob:-}" ] && [[ "${!knob}" != /* ]] && printf -v "$knob" '%s' "$(pwd)/${!knob}"
done
datasets=()
for dataset in ${DATASETS:-mnist}; do
  if [[ "$dataset" == *.pt ]]; then
    [ -f "$dataset" ] || refuse "DATASETS: the file $dataset does not exist (from $(pwd))"
    dataset=$(cd "$(dirname "$dataset")" && pwd)/$(basename "$dataset")
  fi
  datasets+=("$dataset")  # an array: the path of your .pt may hold spaces
done
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python}
SCENARIOS=${SCENARIOS:-cil dil}
# the methods and datasets the code knows (strategies.STRATEGIES, data.DATASETS)
read -r ALL_METHODS ALL_DATASETS_LINE < <("$PYTHON" -c 'import config, data; print(",".join(config.METHODS), ",".join(data.DATASETS))') \
  || { echo "run_all: $PYTHON cannot import the project (pip install -r requirements.txt)" >&2; exit 2; }
ALL_METHODS=${ALL_METHODS//,/ }
ALL_DATASETS=${ALL_DATASETS_LINE//,/ }
METHODS=${METHODS:-$ALL_METHODS}
VARIANTS=${VARIANTS:-base recl inversion}  # inversion: ReCL's pipeline with the model-inversion control
SEEDS_GIVEN=${SEEDS:-}
SEEDS=${SEEDS:-5}
read -r -a DEVICE_LIST <<< "${DEVICES:-}"
JOBS=${JOBS:-$(( ${#DEVICE_LIST[@]} > 1 ? ${#DEVICE_LIST[@]} : 1 ))}  # one worker per GPU listed, unless given
TUNE=${TUNE:-0}
DATA_ROOT=${DATA_ROOT:-data}
EXTRA=("$@")
within() {  # within KNOB "VALUES" "ALLOWED": every value is one of the allowed words
  local value
  for value in $2; do
    [[ " $3 " == *" $value "* ]] || refuse "$1=\"$2\": $value is not one of: $3"
  done
  [ -n "${2// /}" ] || refuse "$1 is empty; it takes some of: $3"
}
[[ "$SEEDS" =~ ^[1-9][0-9]*$ ]] || refuse "SEEDS must be a whole number of seeds, at least 1, got \"$SEEDS\""
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || refuse "JOBS must be a whole number of workers, at least 1, got \"$JOBS\""
for device in ${DEVICE_LIST[@]+"${DEVICE_LIST[@]}"}; do
  [[ "$device" =~ ^[0-9]+$ ]] || refuse "DEVICES must list GPU numbers, like DEVICES=\"0 1\", got \"$DEVICES\""
done
within METHODS "$METHODS" "$ALL_METHODS"
within VARIANTS "$VARIANTS" "base recl inversion"
within SCENARIOS "$SCENARIOS" "cil dil"
for knob in QUICK TUNE DRY_RUN; do
  [[ "${!knob:-0}" =~ ^[01]$ ]] || refuse "$knob must be 0 or 1, got \"${!knob}\""
done
[ "$TUNE" = 1 ] && [ -n "${SWEEP:-}" ] && refuse "TUNE=1 runs one search per method; it takes no SWEEP"
[ ${#DEVICE_LIST[@]} -gt "$JOBS" ] && refuse "DEVICES lists ${#DEVICE_LIST[@]} GPUs, more than JOBS=$JOBS workers use: \
give JOBS=${#DEVICE_LIST[@]} or more, or leave JOBS unset"
[ ${#DEVICE_LIST[@]} -gt 0 ] && [ "${DRY_RUN:-0}" = 1 ] && refuse "DEVICES places run_all's own workers; \
DRY_RUN=1 only lists runs (give each runner its CUDA_VISIBLE_DEVICES)"
for word in ${EXTRA[@]+"${EXTRA[@]}"}; do  # what run_all sets per run is a knob, not a flag
  case "${word%%=*}" in
    --out|--method|--variant|--scenario|--dataset|--seed|--seeds|--rec-objective|--data-root)
      refuse "${word%%=*} is run_all's to set per run: use RESULTS, METHODS, VARIANTS, SCENARIOS, DATASETS, SEEDS or DATA_ROOT";;
  esac
done
for dataset in "${datasets[@]}"; do
  [[ "$dataset" == *.pt ]] || within DATASETS "$dataset" "$ALL_DATASETS"
done
# Runs with other settings get their own default folder (results/quick,
# results/epochs_30, ...), so a finished run is never mistaken for one made
# with different settings and skipped.
SETTINGS=$(printf '%s ' "$@" | sed -E 's/(^| )--/\1/g; s/[^A-Za-z0-9.=-]+/_/g; s/_$//')
QUICK=${QUICK:-0}
if [ "$QUICK" = 1 ]; then  # presets; a knob, flag or SWEEP value given explicitly wins over them
  SEEDS=${SEEDS_GIVEN:-1}
  SETTINGS=quick${SETTINGS:+_$SETTINGS}
fi
DEFAULT_RESULTS=results
[ "$TUNE" = 1 ] && DEFAULT_RESULTS=results/tuning
RESULTS=${RESULTS:-$DEFAULT_RESULTS${SETTINGS:+/$SETTINGS}}
read -r -a SWEEP_VALUES <<< "${SWEEP:-}"
SWEEP_FLAG=${SWEEP_VALUES[0]:-}
SWEEP_VALUES=("${SWEEP_VALUES[@]:1}")
if [ -n "$SWEEP_FLAG" ] && [ ${#SWEEP_VALUES[@]} -eq 0 ]; then
  echo "run_all: SWEEP needs a flag and its values, like SWEEP=\"m 10 25\"" >&2
  exit 2
fi
folders() {  # "folder<TAB>extra-flag value" per sweep point (a folder may hold spaces); just RESULTS without a sweep
  if [ -z "$SWEEP_FLAG" ]; then echo "$RESULTS"; return; fi
  for value in "${SWEEP_VALUES[@]}"; do printf '%s\t%s\n' "$RESULTS/$SWEEP_FLAG-$value" "--$SWEEP_FLAG $value"; done
}
# Share the cores between parallel runs instead of oversubscribing them; a thread
# count set by the caller wins (two run_all.sh side by side: OMP_NUM_THREADS=1 each).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))}

every_run() {  # one shell command per run, finished or not
  for dataset in "${datasets[@]}"; do
    root=(--data-root "$DATA_ROOT")  # only the datasets that live in a data folder take it
    [ "$dataset" = mnist ] || [[ "$dataset" == *.pt ]] && root=()
    for scenario in $SCENARIOS; do
      for method in $METHODS; do
        if [ "$TUNE" = 1 ]; then  # one validation search per method, on seed 0
          printf '%q ' "$PYTHON" experiments.py tune --dataset "$dataset" --scenario "$scenario" \
            --method "$method" --seed 0 --out "$RESULTS" --quiet ${root[@]+"${root[@]}"} \
            ${EXTRA[@]+"${EXTRA[@]}"}
          echo
          continue
        fi
        while IFS=$'\t' read -r out point; do
          for variant in $VARIANTS; do
            [ "$method" = joint ] && [ "$variant" != base ] && continue  # the bound has no +ReCL
            flags=(--variant "$variant")
            [ "$variant" = inversion ] && flags=(--variant recl --rec-objective inversion)
            [ "$method" = joint ] && flags=()
            quick=()  # QUICK's presets: fewer epochs, and fewer steps where there is a reconstruction
            [ "$QUICK" = 1 ] && quick=(--epochs 5)
            [ "$QUICK" = 1 ] && [ "$variant" != base ] && [ "$method" != joint ] && quick+=(--n-rec 20)
            for ((seed = 0; seed < SEEDS; seed++)); do
              # later flags win in recl.py: QUICK's presets, then yours, then the sweep's value
              printf '%q ' "$PYTHON" recl.py --dataset "$dataset" --scenario "$scenario" \
                --method "$method" ${flags[@]+"${flags[@]}"} --seed "$seed" --out "$out" --quiet --skip-done \
                ${root[@]+"${root[@]}"} ${quick[@]+"${quick[@]}"} \
                ${EXTRA[@]+"${EXTRA[@]}"} ${point:+$point}
              echo
            done
          done
        done < <(folders)
      done
    done
  done
}

# experiments.py pending keeps the runs without a result for their config, skips the
# datasets that cannot be loaded (saying why), and takes the +ReCL flags out of the
# lines of the methods alone, which would refuse them.
# Every line is checked first: a flag or SWEEP value a run would refuse stops them all, in one line.
[ -e "$RESULTS" ] && [ ! -d "$RESULTS" ] && refuse "RESULTS=$RESULTS is a file; it must name a folder"
todo=$(every_run | "$PYTHON" experiments.py pending) || exit 2
count=$(printf '%s' "$todo" | grep -c . || true)
runs=$([ "$count" = 1 ] && echo run || echo runs)
echo "run_all: $count $runs to do in $RESULTS/ with $JOBS job(s)" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then  # one runnable command per line, for xargs -P, GNU parallel or a job array
  [ "$count" -gt 0 ] && printf '%s\n' "$todo"
  exit 0
fi
start=$(date +%s)
failed=0
if [ "$count" -gt 0 ]; then
  # JOBS worker processes share the list, each claiming the next unclaimed run
  # (experiments.py queue): torch is imported once per worker, not once per run.
  queue=$(mktemp -d)
  workers=()
  trap 'rm -rf "$queue"' EXIT
  # Background processes of a script ignore Ctrl-C, so stop the workers here
  # (a run in flight is lost; results are written atomically, none is half-written).
  # (every job, not just the workers listed: a signal can come before the last one is)
  trap 'kill $(jobs -p) 2>/dev/null; wait; echo "run_all: interrupted; finished runs are saved, rerun to do the rest" >&2; exit 130' INT TERM
  printf '%s\n' "$todo" > "$queue/commands"
  for ((job = 0; job < JOBS; job++)); do
    if [ ${#DEVICE_LIST[@]} -gt 0 ]; then  # spread the workers over the GPUs
      CUDA_VISIBLE_DEVICES=${DEVICE_LIST[$((job % ${#DEVICE_LIST[@]}))]} "$PYTHON" experiments.py queue "$queue" &
    else
      "$PYTHON" experiments.py queue "$queue" &
    fi
    workers+=($!)
  done
  for worker in "${workers[@]}"; do wait "$worker" || failed=1; done
fi
echo "run_all: finished in $(( $(date +%s) - start ))s"
if [ -z "$SWEEP_FLAG" ]; then
  "$PYTHON" experiments.py aggregate "$RESULTS" | tee "$RESULTS/table.md"
else
  while IFS=$'\t' read -r out point; do
    echo "## $point"; echo; "$PYTHON" experiments.py aggregate "$out"; echo
  done < <(folders) | tee "$RESULTS/table-$SWEEP_FLAG.md"
fi
if [ "$failed" = 1 ]; then
  echo "run_all: some runs failed (each named above as FAILED); the table holds the others" >&2
  exit 1
fi
