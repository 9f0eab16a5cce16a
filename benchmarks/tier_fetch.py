"""Fetching a span from each tier vs recomputing its tokens, per span size.

For each span size (tokens): the prefill time of that many tokens on the model (what a miss
costs: the tokens are computed at every layer), and the time to fetch a span of that size from
the memory tier (``KVStore.get``), the disk tier and a Redis server on loopback (metadata read, value
read, checksum, decode into tensors, insert into the memory tier: what ``span_id in store`` does on
a memory miss). Spans carry SmolLM2-135M's K/V shapes and one layer of hidden states (a relay span).
Also: how a process learns of spans published elsewhere (announcement log vs a key scan).

    python benchmarks/tier_fetch.py --json benchmarks/results/tier_fetch.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.engine.engine import Engine, GenerateOptions
from kvrelay.eval.harness import environment
from kvrelay.eval.stats import timed_median_ms
from kvrelay.model.sampling import SamplingConfig
from kvrelay.tier.backends.disk import DiskBackend
from kvrelay.tier.backends.redis import PREFIX, RedisBackend
from kvrelay.tier.tiered import TieredStore
from kvrelay.weights.loader import load_model

BIG_BYTES = 1 << 34


@contextlib.contextmanager
def local_redis(maxmemory: str = "4gb", start_timeout_s: float = 10.0) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence, LRU eviction); yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed: `make install` installs the Debian package")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=10)


def prefill_ms(engine: Engine, ids: list[int], repeats: int) -> tuple[float, StoredSpan]:
    opts = GenerateOptions(SamplingConfig(max_new_tokens=1), keep_cache=True, feed_last=False)
    times, out = [], None
    for _ in range(repeats):
        out = engine.generate(ids, "full", opts)
        times.append(out.stats.ttft_ms)
    lm = engine.lm
    capture = lm.config.num_layers // 3
    hidden = {capture: torch.randn(len(ids), lm.config.hidden_size, dtype=lm.model.dtype)}
    return statistics.median(times), out.cache.export(0, len(ids), ids, lm.fingerprint, hidden)


def fetch_ms(make_backend, span: StoredSpan, repeats: int) -> tuple[float, float]:
    """(put ms, fetch ms) of ``span`` through a tier: written by one store, fetched by another."""
    writer = TieredStore(BIG_BYTES, make_backend(), span.fingerprint)
    put_ms = timed_median_ms(lambda: writer.put("s", span), max(1, repeats // 2))
    reader = TieredStore(BIG_BYTES, make_backend(), span.fingerprint)

    def fetch() -> None:
        assert "s" in reader
        reader.remove("s")

    return put_ms, timed_median_ms(fetch, repeats)


def announcements(make_backend, num_spans: int) -> dict:
    """Learning of ``num_spans`` spans published elsewhere: the announcement log vs a listing."""
    backend = make_backend()
    writer = TieredStore(BIG_BYTES, backend, "fp-toy")
    tiny = StoredSpan((1, 2, 3, 4), 0, torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), "fp-toy")
    for i in range(num_spans):
        writer.put(f"s{i}", tiny)
    reader = TieredStore(BIG_BYTES, make_backend(), "fp-toy")
    t0 = time.perf_counter()
    got = reader.poll_published()
    first_ms = (time.perf_counter() - t0) * 1e3
    assert len(got) == num_spans
    idle_ms = timed_median_ms(reader.poll_published, 20)
    t0 = time.perf_counter()
    if isinstance(backend, RedisBackend):  # the alternative: scan the keys, read every metadata value
        keys = list(backend.client.scan_iter(match=PREFIX + "*:m", count=1000))
        metas = backend.client.mget(keys)
    else:
        metas = [p.read_bytes() for p in Path(backend.root).glob("*.m")]
    scan_ms = (time.perf_counter() - t0) * 1e3
    assert len(metas) == num_spans
    return {"num_spans": num_spans, "poll_all_ms": round(first_ms, 2), "poll_idle_ms": round(idle_ms, 3),
            "scan_all_ms": round(scan_ms, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="64,256,1024,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    lm = load_model(args.model, progress=False)
    engine = Engine(lm, KVStore(BIG_BYTES), methods=("full",))
    num_layers = lm.config.num_layers
    with local_redis() as redis_url, tempfile.TemporaryDirectory() as tmp_dir:
        tiers = {"disk": lambda: DiskBackend(tmp_dir), "redis": lambda: RedisBackend(redis_url, timeout_s=30)}
        rows = []
        engine.generate(list(range(100, 164)), "full", GenerateOptions(SamplingConfig(max_new_tokens=1)))  # warm-up
        for n in [int(s) for s in args.sizes.split(",")]:
            ids = torch.randint(100, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            repeats = args.repeats if n <= 1024 else max(1, args.repeats // 3)
            recompute, span = prefill_ms(engine, ids, repeats)
            row = {"num_tokens": n, "span_mb": round(span.nbytes / 1e6, 2), "recompute_ms": round(recompute, 1),
                   "token_layers_per_s": round(n * num_layers / recompute * 1e3)}
            mem = KVStore(BIG_BYTES)
            mem.put("s", span)
            row["memory_fetch_ms"] = round(timed_median_ms(lambda m=mem: m.get("s"), 100), 4)
            cache = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=n)
            load = lambda c=cache, s=span: c.load_span(s, 0, lm.model.rope)  # noqa: E731
            row["load_into_sequence_ms"] = round(timed_median_ms(load, repeats), 2)
            for name, make in tiers.items():
                put, fetch = fetch_ms(make, span, repeats)
                row[f"{name}_put_ms"], row[f"{name}_fetch_ms"] = round(put, 1), round(fetch, 1)
                row[f"{name}_mb_per_s"] = round(span.nbytes / 1e6 / (fetch / 1e3))
                # the prefill rate above which recomputing beats fetching this span from this tier
                row[f"{name}_crossover_token_layers_per_s"] = round(n * num_layers / (fetch / 1e3))
            rows.append(row)
            print(json.dumps(row))
        redis.Redis.from_url(redis_url, socket_timeout=2).flushall()
        with tempfile.TemporaryDirectory() as ann_dir:
            ann = {"disk": announcements(lambda: DiskBackend(ann_dir), 1000),
                   "redis": announcements(tiers["redis"], 1000)}
        print(json.dumps(ann))
    if args.json:
        args.json.write_text(json.dumps({"env": environment("cpu"), "model": args.model, "rows": rows,
                                         "announcements": ann}, indent=1) + "\n")


if __name__ == "__main__":
    main()
