#!/usr/bin/env bash
# Issue 48, third session, the second GPU call: the rest of the README's SplitMNIST table (every method
# but Finetune, whose 30 runs the first call made), JOBS=16 on the one GPU, resuming in the first call's
# folder; at most LIMIT seconds, then one archive of the records: $OUT/table.tgz.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT/r" && cp -r docs/runs/networks/issue48/gpu/table-gpu "$OUT/r/table-gpu"
start=$(date +%s)
RESULTS=$OUT/r/table-gpu JOBS=16 timeout "${LIMIT:-380}" bash run_all.sh > "$OUT/r/table-gpu-rest.log" 2>&1
echo "table: rc $?, $(( $(date +%s) - start ))s wall, $(ls "$OUT"/r/table-gpu/*.json | wc -l) of 220 records"
tail -5 "$OUT/r/table-gpu-rest.log"
tar czf "$OUT/table.tgz" -C "$OUT" r
