"""Matching cost against prompt length and number of stored spans (no model, no torch).

    python benchmarks/serve_index.py [--json benchmarks/results/serve-index.json]

Token index: spans are 512 random tokens each (a prompt + output of an agent call); every query shares a
256-token run with one stored span and a 64-token run with another, at unaligned offsets, and is
otherwise random. Times are the median of repeated ``TokenIndex.find`` calls (the exact prefix is the store's
lookup, not timed here; ``benchmarks/matcher_lookup.py`` has p50/p99 on random, natural and repeated text).

Output registry (the step before tokenizing: returned texts found inside message contents): as many
registered outputs as spans, 400 characters of random words each; a message of 4 characters per prompt
token that quotes one of them. Times are the median of repeated ``OutputRegistry.find`` calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from kvrelay.server.index import TokenIndex
from kvrelay.server.registry import OutputRegistry, RegisteredOutput

SPAN_TOKENS = 512


def build(num_spans: int, rng: random.Random) -> tuple[TokenIndex, list[list[int]]]:
    index = TokenIndex(block_len=16)
    spans = []
    for i in range(num_spans):
        ids = [rng.randrange(49152) for _ in range(SPAN_TOKENS)]
        index.add(f"s{i}", ids)
        spans.append(ids)
    return index, spans


def query(length: int, spans: list[list[int]], rng: random.Random) -> list[int]:
    q = [rng.randrange(49152) for _ in range(length)]
    a, b = rng.choice(spans), rng.choice(spans)
    q[37 : 37 + 256] = a[101 : 101 + 256]
    q[length - 200 : length - 136] = b[7 : 7 + 64]
    return q


def time_find(index: TokenIndex, q: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = index.find(q, min_tokens=16)
        times.append((time.perf_counter() - t0) * 1e3)
    assert sum(m.num_tokens for m in found) >= 256 + 64, found
    return statistics.median(times)


def _words(rng: random.Random, num_chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
    return " ".join(words)[:num_chars]


def time_registry(num_outputs: int, prompt_tokens: int, rng: random.Random, repeats: int) -> float:
    registry = OutputRegistry()
    texts = [_words(rng, 400) for _ in range(num_outputs)]
    for i, text in enumerate(texts):
        registry.add(RegisteredOutput(text, tuple(range(100)), f"s{i}", 0))
    content = _words(rng, 4 * prompt_tokens)
    quoted = rng.choice(texts)
    content = content[:100] + quoted + content[100 + len(quoted):]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hits = registry.find(content)
        times.append((time.perf_counter() - t0) * 1e3)
    assert [h.output.text for h in hits] == [quoted], hits
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    for num_spans in (10, 100, 1000, 10000):
        t0 = time.perf_counter()
        index, spans = build(num_spans, rng)
        build_ms = (time.perf_counter() - t0) * 1e3
        for length in (1024, 4096, 16384):
            ms = time_find(index, query(length, spans, rng), args.repeats)
            registry_ms = time_registry(num_spans, length, rng, args.repeats)
            rows.append({"num_spans": num_spans, "prompt_tokens": length, "lookup_ms": round(ms, 2),
                         "registry_find_ms": round(registry_ms, 2),
                         "index_build_ms_per_span": round(build_ms / num_spans, 3)})
            print(f"spans {num_spans:6d}  prompt {length:6d} tok  lookup {ms:8.2f} ms  registry {registry_ms:8.2f} ms  "
                  f"(index build {build_ms / num_spans:.3f} ms/span)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "span_tokens": SPAN_TOKENS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
