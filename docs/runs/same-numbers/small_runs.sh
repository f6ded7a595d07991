# before/after small runs: same commands at two commits; prints ACC/BWT lines
OUT=$1
set -u
run() { echo "## $*"; python recl.py "$@" --out "$OUT" --quiet 2>&1 | tail -3; }
run --scenario cil --method gpm
run --scenario dil --method ewc --variant recl
run --scenario cil --method finetune --variant recl --paper
run --scenario dil --method lwf --variant recl --paper
run --scenario cil --method finetune --variant recl --rec-objective inversion
run --scenario dil --method finetune --variant recl --rec-objective inversion
run --scenario cil --method finetune --variant recl --model cnn --n-per-class 20 --epochs 3
run --scenario cil --method er --variant recl --model cnn --n-per-class 20 --epochs 3
run --scenario dil --method finetune --variant recl --model cnn --n-per-class 20 --epochs 3
run --scenario cil --method finetune --variant recl --model alexnet --n-per-class 10 --epochs 2
run --scenario dil --method finetune --variant recl --model resnet18 --n-per-class 10 --epochs 1
run --scenario cil --method agem --variant recl --tuning unsup --trials 2 --n-rec 10 --epochs 3
