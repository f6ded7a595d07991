#!/usr/bin/env bash
# The full results table: each method alone (base), alone at +ReCL's budget (budget), +ReCL (recl), +inversion,
# +real old images (real, the ceiling), +class centroids (centroids, the floor), and joint; CIL and DIL; 5 seeds.
#   [KNOB=VALUE ...] bash run_all.sh [recl.py flags, to every run; a replay arm's needs VARIANTS without base, budget]
# Knobs: DATASETS (mnist; fashion-mnist, cifar10, .pt files), SCENARIOS, METHODS, VARIANTS, SEEDS (5), FIRST_SEED (0),
# JOBS (1, or one per GPU), DEVICES ("0 1"), RESULTS (results/FLAGS), DATA_ROOT (data), PYTHON, QUICK=1 (a smoke test:
# 1 seed, 5 epochs, 20 steps), DRY_RUN=1 (print the runs left; docs/running.md). A run whose JSON exists is skipped.
set -euo pipefail
[[ " $* " != *" -h "* && " $* " != *" --help "* ]] || { sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0"; exit 0; }
fail() { echo "run_all: error: $*" >&2; exit 2; }
words() { local name=$1 allowed=$2 w out=(); for w in ${!name}; do  # the knob's words, each once, each allowed
  [[ " $allowed " == *" $w "* || -z $allowed ]] || fail "$name: $w is not one of: $allowed"
  [[ " ${out[*]-} " == *" $w "* ]] || out+=("$w"); done
  [ ${#out[@]} -gt 0 ] || fail "$name is empty"; printf -v "$name" '%s' "${out[*]}"; }  # written back to the knob
[[ ${QUICK:=0} =~ ^[01]$ && ${DRY_RUN:=0} =~ ^[01]$ ]] || fail "QUICK and DRY_RUN are 0 or 1"
PYTHON=${PYTHON:-python} arms="base budget recl inversion real centroids" SCENARIOS=${SCENARIOS-cil dil}
METHODS=${METHODS-$(cd "$(dirname "$0")" && "$PYTHON" -c 'import strategies; print(*strategies.STRATEGIES)')}
DATASETS=${DATASETS-mnist} VARIANTS=${VARIANTS-$arms} SEEDS=${SEEDS:-$((QUICK ? 1 : 5))} FIRST_SEED=${FIRST_SEED:-0}
words METHODS ""; words SCENARIOS "cil dil"; words VARIANTS "$arms"; words DATASETS ""
[[ $SEEDS =~ ^[1-9][0-9]{0,2}$ && $FIRST_SEED =~ ^[0-9]{1,9}$ ]] || fail "SEEDS is 1-999 and FIRST_SEED a whole number"
[[ ${DEVICES:-0} =~ ^[0-9\ ]+$ ]] || fail "DEVICES lists GPU numbers, like \"0 1\""
read -r -a devices <<< "${DEVICES:-}"
[[ ${JOBS:=$(( ${#devices[@]} ? ${#devices[@]} : 1 ))} =~ ^[1-9][0-9]{0,2}$ ]] || fail "JOBS is a whole number from 1"
ours='^--(seeds?|method|scenario|dataset|variant|replay-source|budget|out|data-root|device|quiet|skip-done|dry-run)$'
for a in "$@"; do [[ ! ${a%%=*} =~ $ours ]] || fail "${a%%=*} is run_all's to set per run: use its knobs"; done
name=$( (((QUICK)) && echo quick; [ $# = 0 ] || printf '%s\n' "$@") | sed 's/^--//; s/[^A-Za-z0-9._-]/_/g' | paste -sd_)
[ -n "${RESULTS=results${name:+/$name}}" ] || fail "RESULTS is empty; it must name a folder"  # "=": if unset
RESULTS=$(realpath -m -- "$RESULTS") DATA_ROOT=$(realpath -m -- "${DATA_ROOT:-data}")  # your paths, from your folder
lines=() cuda=(${devices[0]:+--device cuda}) quick=() steps=()  # then QUICK's, where no flag of yours says
[[ $QUICK = 0 || " $* " == *" --epochs "* ]] || quick=(--epochs 5)
[[ $QUICK = 0 || " $* " == *" --n-rec "* ]] || steps=(--n-rec 20)
arm() { case $1 in base) echo --variant base;; budget) echo --variant base --budget recl;; recl) echo --variant recl;;
  *) echo --variant recl --replay-source "$1";; esac; }  # inversion, real, centroids
for d in $DATASETS; do [[ $d != *.pt ]] || d=$(realpath -m -- "$d")
  for ((seed = FIRST_SEED; seed < FIRST_SEED + SEEDS; seed++)); do for s in $SCENARIOS; do for m in $METHODS; do
    for v in $VARIANTS; do [ "$m" != joint ] || [ "$v" = base ] || continue  # seed first: its data loads once
    line=(--dataset "$d" --scenario "$s" --method "$m" $(arm "$v") --seed "$seed" --out "$RESULTS" --quiet --skip-done)
    [[ $d == mnist || $d == *.pt ]] || line+=(--data-root "$DATA_ROOT")
    [[ $v == recl || $v == inversion ]] && line+=("${steps[@]}")
    lines+=("$(printf '%q ' "${line[@]}" "${cuda[@]}" "${quick[@]}" "$@")")
done; done; done; done; done
[ ${#lines[@]} -gt 0 ] || fail "no run: joint runs only with VARIANTS base"
cd "$(dirname "$0")" && export PYTHON  # one process checks every line (a refusal names it), keeps those with runs left
todo=$(printf '%s\n' "${lines[@]}" | "$PYTHON" -c 'import sys
try:
    import shlex, recl
    for line in sys.stdin:
        try:
            recl.main(shlex.split(line) + ["--dry-run"])
        except (recl.UsageError, recl.data.DataError) as err:
            sys.exit(f"run_all: error: {err} (nothing was run; refused: {line.strip()})")
except KeyboardInterrupt:
    sys.exit("run_all: interrupted while checking the runs; nothing was run")') || exit 2
echo "run_all: $(grep -c . <<< "$todo" || true) runs to do in $RESULTS/ with $JOBS job(s)" >&2
if [ "$DRY_RUN" = 1 ]; then [ -z "$todo" ] || printf '%s\n' "$todo"; exit 0; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))} DEVICES  # yours wins
start=$(date +%s) failed=0
set -m  # the runs in a process group of their own, which a signal to run_all stops whole ('%s': none if no line)
printf '%s' "$todo" | xargs -d '\n' -P "$JOBS" --process-slot-var=SLOT -I{} bash -c '
  read -r -a gpus <<< "$DEVICES"; [ ${#gpus[@]} -eq 0 ] || export CUDA_VISIBLE_DEVICES=${gpus[$((SLOT % ${#gpus[@]}))]}
  eval "$1" || { echo "run_all: FAILED: $1" >&2; exit 1; }' _ {} &
trap 'kill -- -$(jobs -p) 2>/dev/null; echo "run_all: interrupted; finished runs are kept" >&2; exit 130' INT TERM
wait $! || failed=1
echo "run_all: finished in $(( $(date +%s) - start ))s" >&2
mkdir -p "$RESULTS" && "$PYTHON" tools/aggregate.py "$RESULTS" | tee "$RESULTS/table.md"
[ "$failed" = 0 ] || { echo "run_all: runs named FAILED above failed; the table holds the others" >&2; exit 1; }
