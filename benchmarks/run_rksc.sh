#!/bin/bash
# RKSC on gsm8k-branches (issue 6). Two lanes of one torch thread each, side by side on the 2-core VM.
# Each lane writes its JSON after every problem, so a stopped run keeps what it finished.
set -e
cd "$(dirname "$0")/.."
lane() {  # name offset limit
  OMP_NUM_THREADS=1 .venv/bin/kvrelay bench --workload gsm8k-branches --offset "$2" --limit "$3" \
    --methods "full,prefix,rksc" --json "benchmarks/results/rksc-gsm8k-branches-$1.json"
}
lane a 0 25 &
lane b 25 25 &
wait
# CGEE layer-exit calibration on GSM8K train (sets the exit defaults in kvrelay/reuse/rksc.py)
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibrate_cgee.py --problems 8 \
  --json benchmarks/results/rksc-cgee-calibration.json
.venv/bin/python benchmarks/make_tables.py > /tmp/tables.md
