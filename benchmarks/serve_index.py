"""Token index lookup time against prompt length and number of stored spans (no model, no torch).

    python benchmarks/serve_index.py [--json benchmarks/results/serve-index.json]

Spans are 512 random tokens each (a prompt + output of an agent call); every query shares a
256-token run with one stored span and a 64-token run with another, at unaligned offsets, and is
otherwise random. Times are the median of repeated ``TokenIndex.find`` calls (prefix lookup included).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from kvrelay.server.index import TokenIndex

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
        index.match_prefix(q)
        found = index.find(q, min_tokens=16)
        times.append((time.perf_counter() - t0) * 1e3)
    assert sum(m.num_tokens for m in found) >= 256 + 64, found
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
            rows.append({"num_spans": num_spans, "prompt_tokens": length, "lookup_ms": round(ms, 2),
                         "index_build_ms_per_span": round(build_ms / num_spans, 3)})
            print(f"spans {num_spans:6d}  prompt {length:6d} tok  lookup {ms:8.2f} ms  "
                  f"(index build {build_ms / num_spans:.3f} ms/span)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "span_tokens": SPAN_TOKENS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
