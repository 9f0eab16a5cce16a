#!/bin/bash
# RKSC on gsm8k-branches (issue 6). Lanes of one torch thread each, two side by side on the 2-core VM.
# Each lane writes its JSON after every problem, so a stopped run keeps what it finished; make_tables.py
# merges every rksc-gsm8k-branches-*.json (problems 0-9 in a, 25-34 in b, 10-24 in c, 35-49 in d: the
# first session stopped lanes a and b after 10 problems each).
set -e
cd "$(dirname "$0")/.."
lane() {  # name offset limit [methods]
  OMP_NUM_THREADS=1 .venv/bin/kvrelay bench --workload gsm8k-branches --offset "$2" --limit "$3" \
    --methods "${4:-full,prefix,rksc}" --json "benchmarks/results/rksc-gsm8k-branches-$1.json"
}
lane a 0 10 &
lane b 25 10 &
wait
lane c 10 15 &
lane d 35 15 &
wait
# batched branch decode (rksc's default since 89e65ab) against one-by-one, same run: problems 0-24 and 25-49
batch_lane() {  # lane offset
  OMP_NUM_THREADS=1 .venv/bin/kvrelay bench --workload gsm8k-branches --offset "$2" --limit 25 \
    --methods "full,prefix,rksc,rksc[batch_decode=false]" --json "benchmarks/results/rksc-batch-gsm8k-branches-lane$1.json"
}
batch_lane 0 0 &
batch_lane 1 25 &
wait
# RSBCM vs LRU with 1-8 problems in flight: rksc alone, its block trace replayed interleaved
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rsbcm_interleaved.py --limit 50 \
  --json benchmarks/results/rksc-rsbcm-interleaved.json
# approximate ASKS (opt-in), 8 problems
OMP_NUM_THREADS=1 .venv/bin/kvrelay bench --workload gsm8k-branches --offset 0 --limit 8 \
  --methods "full,prefix,rksc[asks_approx=true]" --json benchmarks/results/rksc-asks-gsm8k-branches.json
# CGEE layer-exit calibration on GSM8K train (sets the exit defaults in kvrelay/branches/rksc.py)
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibrate_cgee.py --problems 8 \
  --json benchmarks/results/rksc-cgee-calibration.json
.venv/bin/python benchmarks/make_tables.py > /tmp/tables.md
