#!/usr/bin/env bash
# KVCOMM tables of BENCHMARKS.md (CPU, SmolLM2-135M). Two lanes of one torch thread each, run side by side
# on the 2-core VM (timings are interleaved per call, so ratios stay fair; absolute ms are 1-thread numbers).
# Usage: bash benchmarks/run_kvcomm.sh a|b|c (sessions 1-2: the relative gate), s5a|s5b (session 5: the L2 gate),
# s6a|s6b (session 6: the same calls measured with warm pools, after 50 unrecorded problems past the measured 50),
# s7 W (session 7: the warm gamma sweep on workload W, e.g. gsm8k-fc3),
# s9a|s9b (session 9: warm pools, the prompt's last 16/32 tokens computed instead of estimated),
# s10a|s10b (session 10: kvcomm[tail_tokens=32] with rotated vs absolute offsets and the baselines in one warm
# gsm8k-fc3 run; copy-agents with tail_tokens=32)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
K=.venv/bin/kvrelay
R=benchmarks/results
BASE=naive,cacheblend,relay
case "${1:-a}" in
a)  # fc3 GSM8K, 50 problems, with the gamma sweep in the same run (same calls)
    $K bench --workload gsm8k-fc3 --limit 50 --repeats 1 --json $R/kvcomm-gsm8k-fc3.json --plot $R \
      --methods "$BASE,kvcomm,kvcomm[gamma=0.1],kvcomm[gamma=0.6],kvcomm[gamma=1]"
    ;;
b)  # TTFT microbenchmark (warmup=1: the outputs repeat across problems, so one anchor per placeholder is
    # enough to start reusing), end to end GSM8K fc3, and the rotate-vs-absolute offsets on 12 MMLU fc3 problems
    for a in 2 3 4 5; do
      $K bench --workload copy-agents:$a --methods "relay,kvcomm[warmup=1]" --limit 3 --greedy-tokens 8 \
        --json $R/kvcomm-copy-agents-$a.json
    done
    $K bench --workload gsm8k-fc3 --mode e2e --limit 10 --methods "relay,kvcomm,kvcomm[gamma=1]" \
      --json $R/kvcomm-gsm8k-fc3-e2e.json
    $K bench --workload mmlu-fc3 --limit 12 --repeats 1 --json $R/kvcomm-mmlu-fc3-12problems-rotate.json \
      --methods "$BASE,kvcomm,kvcomm[gamma=1,rotate_offsets=false],kvcomm[gamma=1]"
    ;;
c)  # MMLU fc3 and HumanEval fc3 at 50 problems, one lane each (kvcomm's pools must see the problems in order)
    $K bench --workload mmlu-fc3 --limit 50 --repeats 1 --json $R/kvcomm-mmlu-fc3.json --plot $R \
      --methods "$BASE,kvcomm,kvcomm[gamma=1]" &
    $K bench --workload humaneval-fc3 --limit 50 --repeats 1 --json $R/kvcomm-humaneval-fc3.json --plot $R \
      --methods "$BASE,kvcomm,kvcomm[gamma=1]" &
    wait
    ;;
s5a)  # session 5, lane A: gsm8k-fc3 with the L2 gate, its gamma sweep and the old gate, same calls as "a"
    $K bench --workload gsm8k-fc3 --limit 50 --repeats 1 --json $R/kvcomm-gsm8k-fc3-s5.json \
      --methods "kvcomm,kvcomm[gamma=0.1],kvcomm[gamma=0.6],kvcomm[gamma=1],kvcomm[gate_distance=relative,warmup=3]"
    ;;
s5b)  # session 5, lane B: mmlu-fc3 and humaneval-fc3 (one after the other), then e2e gsm8k-fc3
    for w in mmlu humaneval; do
      $K bench --workload $w-fc3 --limit 50 --repeats 1 --json $R/kvcomm-$w-fc3-s5.json \
        --methods "kvcomm,kvcomm[gate_distance=relative,warmup=3]"
    done
    $K bench --workload gsm8k-fc3 --mode e2e --limit 10 --methods "relay,kvcomm" --json $R/kvcomm-gsm8k-fc3-e2e-s5.json
    ;;
s6a)  # session 6, lane A: mmlu-fc3 then humaneval-fc3, pools warmed on problems 50-99 first
    for w in mmlu humaneval; do
      $K bench --workload $w-fc3 --limit 50 --warm-problems 50 --repeats 1 --methods kvcomm \
        --json $R/kvcomm-$w-fc3-warm.json
    done
    ;;
s6b)  # session 6, lane B: gsm8k-fc3 warmed the same way, then e2e gsm8k-fc3 (10 problems) warmed on 50
    $K bench --workload gsm8k-fc3 --limit 50 --warm-problems 50 --repeats 1 --methods kvcomm \
      --json $R/kvcomm-gsm8k-fc3-warm.json
    $K bench --workload gsm8k-fc3 --mode e2e --limit 10 --warm-problems 50 --methods "relay,kvcomm" \
      --json $R/kvcomm-gsm8k-fc3-e2e-warm.json
    ;;
s7)  # session 7: warm pools, gamma below the default, on one workload (run once per workload)
    w=${2:?usage: run_kvcomm.sh s7 WORKLOAD}
    $K bench --workload $w --limit 50 --warm-problems 50 --repeats 1 \
      --methods "kvcomm[gamma=0.1],kvcomm[gamma=0.2]" --json $R/kvcomm-$w-warm-gamma.json
    ;;
s9a)  # session 9, lane A: gsm8k-fc3, tail_tokens 16 and 32 (tail_tokens=1 is s6b's kvcomm on the same calls)
    $K bench --workload gsm8k-fc3 --limit 50 --warm-problems 50 --repeats 1 \
      --methods "kvcomm[tail_tokens=16],kvcomm[tail_tokens=32]" --json $R/kvcomm-gsm8k-fc3-warm-tail.json
    ;;
s9b)  # session 9, lane B: mmlu-fc3 then humaneval-fc3, tail_tokens 32
    for w in mmlu humaneval; do
      $K bench --workload $w-fc3 --limit 50 --warm-problems 50 --repeats 1 --methods "kvcomm[tail_tokens=32]" \
        --json $R/kvcomm-$w-fc3-warm-tail.json
    done
    ;;
s10a)  # session 10, lane A: one warm gsm8k-fc3 run holding the target configuration, its absolute-offset
    # variant (the public code's) and the baselines, on the same 100 calls as sessions 6 and 9
    $K bench --workload gsm8k-fc3 --limit 50 --warm-problems 50 --repeats 1 \
      --methods "$BASE,kvcomm[tail_tokens=32],kvcomm[tail_tokens=32,rotate_offsets=false]" \
      --json $R/kvcomm-gsm8k-fc3-warm-s10.json
    ;;
s10b)  # session 10, lane B: copy-agents 2-5 with tail_tokens=32 beside the published setting
    for a in 2 3 4 5; do
      $K bench --workload copy-agents:$a --methods "relay,kvcomm[warmup=1],kvcomm[warmup=1,tail_tokens=32]" \
        --limit 3 --greedy-tokens 8 --json $R/kvcomm-copy-agents-$a-s10.json
    done
    ;;
esac
