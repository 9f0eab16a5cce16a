#!/usr/bin/env bash
# KVCOMM on MMLU subjects none of its warm-up problems came from (issue 23, item 5).
# The 45 MMLU subjects, sorted by file name, are cut into three folds by index mod 3 (15 subjects each).
# Fold F's run warms the stateful methods on 30 problems of the other two folds (the first question of each of
# their 30 subjects) and measures problems of fold F (its subjects round robin: the first question of each,
# then the second ...). Fold 1 was the development fold (the fix and its settings were chosen there); fold 0 is
# the test fold, measured once per model.
# Usage: bash research/kvcomm_unseen.sh MODEL FOLD LIMIT [OUT.json]   e.g. smollm2-135m 0 24
# One benchmark process, one torch thread (the machine is shared); --repeats 1.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?model}; fold=${2:?fold 0, 1 or 2}; limit=${3:?problems}
out=${4:-benchmarks/results/kvcomm-unseen-$model-fold$fold.json}
mmlu=${KVRELAY_DATA:-../shared/data}/mmlu
root=$(mktemp -d /tmp/kvcomm-unseen.XXXXXX)
mkdir -p "$root/measured" "$root/warm"
i=0
for f in $(ls "$mmlu"/*_test.csv | sort); do
  if [ $((i % 3)) = "$fold" ]; then ln -s "$(realpath "$f")" "$root/measured/"; else ln -s "$(realpath "$f")" "$root/warm/"; fi
  i=$((i + 1))
done
export OMP_NUM_THREADS=1
# the published rules and the fix (anchors shorter than a placeholder count, the tokens past them are computed;
# pools start from 10 dense prefills). The per-token mixing it was also run with (no better) left kvcomm; git keeps it.
FIX="kvcomm[tail_tokens=32,short_anchors=true,warmup=10]"
python -m kvrelay bench --workload mmlu-fc3 --model "$model" --data "$root/measured" --limit "$limit" \
  --warm-problems 30 --warm-data "$root/warm" --repeats 1 --json "$out" \
  --methods "naive,epic,kvcomm[tail_tokens=32],$FIX"
python research/kvcomm_unseen_report.py "$out"
