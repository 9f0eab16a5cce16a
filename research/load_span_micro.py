"""Loading one stored span into a sequence cache, on SmolLM2's shape (2,093 tokens, 30 layers):
the keys rotated in place (``shift_keys_into``, what ``SequenceKV.load_span`` does) vs the
allocate-rotate-copy path it replaced, and an unshifted copy (an exact prefix), into a cache whose
pages were touched beforehand; then the same loads into what a call really gets: a freshly
allocated cache (its pages faulted in by the load) and a buffer from the pool. Interleaved.

    OMP_NUM_THREADS=1 python research/load_span_micro.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrelay.cache.kv import BUFFERS, SequenceKV, StoredSpan  # noqa: E402
from kvrelay.model.rope import RotaryEmbedding  # noqa: E402
from kvrelay.weights.presets import PRESETS  # noqa: E402

NUM_TOKENS = 2093  # copy-agents:5's last agent reuses this many tokens
SHIFT = 19


def main() -> None:
    torch.set_num_threads(1)
    config = PRESETS["smollm2-135m"]
    rope = RotaryEmbedding(config)
    k = torch.randn(config.num_layers, config.num_kv_heads, NUM_TOKENS, config.head_dim)  # [L, Hkv, n, hd]
    span = StoredSpan(tuple(range(NUM_TOKENS)), 0, k, torch.randn_like(k), "fp")

    def temporaries(cache: SequenceKV, dst: int) -> None:  # rotate into new tensors, then copy them in
        rows = slice(dst, dst + NUM_TOKENS)
        cache.k[:, :, rows] = rope.shift_keys(span.k, dst)
        cache.v[:, :, rows] = span.v
        cache.filled[:, rows] = True

    def in_place(cache: SequenceKV, dst: int) -> None:
        cache.load_span(span, dst, rope)

    variants = {"shifted, temporaries": (temporaries, SHIFT, "touched"),
                "shifted, in place": (in_place, SHIFT, "touched"), "unshifted copy": (in_place, 0, "touched")}
    for memory in ("fresh", "pooled"):
        variants |= {f"shifted, in place, {memory} cache": (in_place, SHIFT, memory),
                     f"unshifted copy, {memory} cache": (in_place, 0, memory)}
    times_ms: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(9):
        for name, (load, dst, memory) in variants.items():
            if memory == "fresh":
                BUFFERS.clear()  # a new allocation: the OS backs its pages as the load first writes them
            cache = SequenceKV(config, torch.float32, "cpu", capacity=NUM_TOKENS + SHIFT + 1)
            if memory == "touched":
                cache.k.zero_()  # touch the pages first: time the load, not page faults
                cache.v.zero_()
            t0 = time.perf_counter()
            load(cache, dst)
            times_ms[name].append((time.perf_counter() - t0) * 1e3)
            del cache  # freed before the next one is made, as a finished call's cache is
    for name, ms in times_ms.items():
        print(f"{name}: {statistics.median(ms):.1f} ms (median of {len(ms)})")


if __name__ == "__main__":
    main()
