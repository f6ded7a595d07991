#!/usr/bin/env bash
# Issue 48, third session: the one GPU call (an H200 or H100 with 16 cores), run from the repository root as
#   bash docs/runs/networks/issue48/gpu/run.sh        (OUT: where everything goes; DEADLINE: seconds for all of it)
# 0. a smoke run of each kind of job, tiny (a failure ends the call at once, so that it can be fixed and rerun);
# 1. docs/cost.md's pair: Finetune and Finetune+ReCL on SplitMNIST, seed 0, alone on the machine;
# 2. run_all's SplitMNIST table for Finetune (30 runs), JOBS=16, alone on the machine, at most 150 s;
# 3. cnn-jobs.txt, 16 processes at a time (each runs its seeds in turn), in the time left;
# then one archive of every record: $OUT/results.tgz.
set -u
T0=$(date +%s) DEADLINE=${DEADLINE:-545}
left() { echo $(( T0 + DEADLINE - $(date +%s) )); }
# python: the image's venv (/opt/torch/.venv/bin comes first on PATH there; a link to it would lose the venv)
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
R=$OUT/r; mkdir -p "$R"
finish() { tar czf "$OUT/results.tgz" -C "$OUT" r; echo "done at $(( $(date +%s) - T0 ))s"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "import torch; print(torch.__version__, torch.cuda.is_available())"; git rev-parse HEAD; git status --short; nproc; } > "$R/machine.txt" 2>&1
cat "$R/machine.txt"

echo "== 0. smoke at $(( $(date +%s) - T0 ))s"
S="--epochs 1 --n-rec 2 --seed 0 --quiet --data-root .gpu-data --out /tmp/smoke"
smoke=("python recl.py --variant recl ${S/--data-root .gpu-data /}" "python docs/runs/networks/issue48/probe.py lever head-local --dataset fashion-mnist --scenario cil --model cnn --validation --variant recl $S"
       "python docs/runs/networks/issue48/probe.py lever train-eval --dataset fashion-mnist --scenario dil --model resnet18 --validation --variant recl $S"
       "python docs/runs/networks/issue48/probe.py lever train-eval --dataset fashion-mnist --scenario dil --model alexnet --validation --variant recl $S")
for m in finetune ewc er upgd agem lwf gpm; do
  smoke+=("python recl.py --dataset fashion-mnist --model cnn --scenario dil --method $m --validation --variant recl $S")
done
printf '%s\n' "${smoke[@]}" | xargs -d '\n' -P 16 -I{} bash -c '{} > /dev/null 2>"/tmp/smoke-err-$$" || { echo "SMOKE FAILED: {}"; tail -5 "/tmp/smoke-err-$$"; exit 1; }'
if [ $? != 0 ]; then finish; exit 3; fi

echo "== 1. the pair at $(( $(date +%s) - T0 ))s"
python recl.py --scenario cil --method finetune --device cuda --out "$R/gpu-pair" 2>&1 | grep -v "^  "

echo "== 2. the SplitMNIST table for Finetune at $(( $(date +%s) - T0 ))s"
start=$(date +%s)
RESULTS=$R/table-gpu METHODS=finetune JOBS=16 timeout 150 bash run_all.sh > "$R/table-gpu.log" 2>&1
echo "table: rc $?, $(( $(date +%s) - start ))s wall, $(ls "$R"/table-gpu/*.json 2>/dev/null | wc -l) of 30 records"
tail -4 "$R/table-gpu.log"

echo "== 3. the conv-net jobs at $(( $(date +%s) - T0 ))s, until $(( DEADLINE - 12 ))s"
sed "s|\$R|$R|g" docs/runs/networks/issue48/gpu/cnn-jobs.txt |
  timeout $(( $(left) - 12 )) xargs -d '\n' -P 16 -I{} bash -c '{} 2>&1 | grep -v "^note:" || true' > "$R/cnn-jobs.log"
echo "conv-net jobs ended at $(( $(date +%s) - T0 ))s: $(ls "$R"/*/fashion-mnist-*.json 2>/dev/null | wc -l) records"
grep -i "error\|traceback" "$R/cnn-jobs.log" | head -5
finish
