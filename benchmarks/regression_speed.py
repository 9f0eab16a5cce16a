"""Prefill (1,024 tokens) and decode (64 tokens) times of whichever kvrelay is on PYTHONPATH; one JSON line.

Run it alternately with two checkouts on PYTHONPATH (before and after a change) to compare them interleaved:

    for r in 1 2 3; do for v in before after; do
        OMP_NUM_THREADS=1 PYTHONPATH=/path/$v python benchmarks/regression_speed.py; done; done
"""

import json
import time

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.weights.loader import load_model


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model("smollm2-135m")
    model = lm.model
    ids = torch.randint(0, 40000, (1024,), generator=torch.Generator().manual_seed(0))

    def prefill() -> tuple[float, SequenceKV]:
        cache = SequenceKV(lm.config, model.dtype, "cpu", capacity=1100)
        t0 = time.perf_counter()
        model.prefill(ids, cache)
        return (time.perf_counter() - t0) * 1e3, cache

    prefill()  # warm-up
    times = []
    for _ in range(3):
        ms, cache = prefill()
        times.append(ms)
    t0 = time.perf_counter()
    for i in range(64):
        model.decode_step(int(ids[i]), cache)
    decode_ms = (time.perf_counter() - t0) * 1e3 / 64
    print(json.dumps({"prefill_ms": sorted(times)[1], "decode_ms_per_token": decode_ms}))


if __name__ == "__main__":
    main()
