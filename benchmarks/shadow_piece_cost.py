"""What a shadow's prefill piece costs deep in a long prompt, against a decode step there, per model (in process).

A shadow piece between decode steps is what every running stream's next token waits for, so its bound
(kvrelay.server.shadow.DECODE_STEP_SHARE) is a share of the decode step. This times, on
``benchmarks/long_prompt_stream.py``'s document (1,500 words), a ``full`` prefill in two pieces of 512 tokens, then
pieces of 1, 2, 4, 8, 16, 32 and 64 tokens three times over and ten of one (positions 1,024 on), then decode steps
at the prompt's end; per piece size the median time and its ratio to the median decode step. The chunk budget's
fit over these pieces is printed too (the worker fits live pieces the same way).

    python benchmarks/shadow_piece_cost.py smollm2-135m gemma3-270m
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks.long_prompt_stream import document
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.server.chunk_budget import ChunkBudget, PieceCost
from kvrelay.server.shadow import _NO_STORE

PIECE_SIZES = [512, 512] + [1, 2, 4, 8, 16, 32, 64] * 3 + [1] * 10  # then the rest in pieces of 512
NUM_DECODE_STEPS = 7  # the first is not counted (warm-up)


def measure(name: str) -> None:
    from kvrelay.weights.loader import load_model

    lm = load_model(name)
    engine = Engine(lm, KVStore(1 << 28), methods=("full",))
    ids = lm.tokenizer.encode(f"Document:\n{document(1500)}\n\nq1")[:1940]
    budget = ChunkBudget(512)
    task = engine.begin(ids, "full", GenerateOptions(SamplingConfig(8, 0.0), keep_cache=True, learn=False),
                        store=_NO_STORE)
    pieces = []  # (tokens, keys, ms)
    for num in PIECE_SIZES:
        if task.done:
            break
        task.advance(num)
        pieces.append(task.last_piece)
        budget.observe(PieceCost(*task.last_piece))
    while not task.done:
        task.advance(512)
    seq = task.sequence()
    steps_ms = []
    for _ in range(NUM_DECODE_STEPS):
        start_s = time.perf_counter()
        engine.step([seq])
        steps_ms.append((time.perf_counter() - start_s) * 1e3)
    decode_ms = statistics.median(steps_ms[1:])
    print(f"{name}: {len(ids)} prompt tokens; decode step p50 {decode_ms:.1f} ms; fit (fixed, per token, per key) "
          f"{tuple(round(c, 5) for c in budget.coef_ms)} ms")
    by_size: dict[int, list[float]] = {}
    for num, _, ms in pieces[2:]:
        by_size.setdefault(int(num), []).append(ms)
    for num, times_ms in sorted(by_size.items()):
        ms = statistics.median(times_ms)
        print(f"  piece of {num:3d} tokens: p50 {ms:8.1f} ms = {ms / decode_ms:4.1f}x the decode step")


if __name__ == "__main__":
    for model in sys.argv[1:] or ["smollm2-135m"]:
        measure(model)
