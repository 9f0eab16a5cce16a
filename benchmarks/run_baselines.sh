#!/usr/bin/env bash
# full vs prefix on every named workload (CPU, SmolLM2-135M, agent mode). Writes benchmarks/results/.
# Usage: bash benchmarks/run_baselines.sh [N]   (N problems per dataset workload, default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10}
K=.venv/bin/kvrelay
OUT=benchmarks/results
for w in gsm8k-chain3 gsm8k-fc3 mmlu-fc3 humaneval-fc3 humaneval-adr; do
  $K bench --workload $w --methods full,prefix --limit "$N" --repeats 3 --json $OUT/baseline-$w.json
done
for a in 2 3 4 5; do
  $K bench --workload copy-agents:$a --methods full,prefix --limit 3 --repeats 3 --json $OUT/baseline-copy-agents-$a.json
done
