"""The shared tier on a real redis-server: agents in separate processes, faults, namespaces, bounds.

Run as a script, this file is one agent process (``upstream``, ``downstream`` or ``toy``), so the
two-process tests start real separate interpreters.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.tier.backends.base import span_key
from kvrelay.tier.backends.redis import PREFIX, RedisBackend
from kvrelay.tier.tiered import TieredStore, open_store
from tests.tier.test_tiered import Clock

ROOT = Path(__file__).resolve().parents[2]
UP_PROMPT = list(range(40, 80))
METHODS = ("naive", "relay[band=1:2:2]")
SUBPROCESS_TIMEOUT_S = 120


def _engine(url: str | None, namespace: str):
    from kvrelay.engine.engine import Engine
    from tests.helpers import tiny_lm

    lm = tiny_lm("llama2")
    store = open_store(url, 1 << 26, fingerprint=lm.fingerprint)
    return Engine(lm, store.view(namespace), methods=("full", "prefix", *METHODS)), store


def _upstream(engine):
    from kvrelay.engine.engine import GenerateOptions
    from kvrelay.model.sampling import SamplingConfig

    out = engine.generate(UP_PROMPT, "full", GenerateOptions(SamplingConfig(max_new_tokens=12), keep_cache=True))
    engine.publish("agent-a", out)
    return out.output_ids


def _downstream(engine, up_output_ids: list[int]) -> tuple[dict[str, torch.Tensor], int, list[dict]]:
    """First-token logits of the downstream calls, how many tokens the prefix call reused, and the tier's
    fetch decisions the calls' stats recorded."""
    from kvrelay.engine.engine import GenerateOptions
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.reuse.base import CallInput, SpanRef

    opts = GenerateOptions(SamplingConfig(max_new_tokens=1))
    # first, so that the span is found through the tier's announcements (not already in memory)
    continued = engine.generate(UP_PROMPT + list(up_output_ids) + [10, 11, 12], "prefix", opts)
    prompt = [7, 8, 9] + list(up_output_ids) + [10, 11, 12]
    ref = SpanRef(3, 3 + len(up_output_ids), "agent-a", len(UP_PROMPT), "output")
    outs = {m: engine.generate(CallInput(prompt, [ref]), m, opts) for m in ("full", *METHODS)}
    logits = {m: out.first_logits for m, out in outs.items()}
    logits["prefix"] = continued.first_logits
    decisions = [d for out in (continued, *outs.values()) for d in out.stats.tier_decisions]
    return logits, continued.stats.num_reused_tokens, decisions


def _run_agent(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env,
                          timeout=SUBPROCESS_TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _toy_span(n: int, fingerprint: str = "fp-toy", num_layers: int = 2) -> StoredSpan:
    g = torch.Generator().manual_seed(n)
    k = torch.randn(num_layers, 2, n, 8, generator=g)
    return StoredSpan(tuple(range(n)), 0, k, k + 1, fingerprint, {1: torch.randn(n, 16, generator=g)})


def test_two_processes_relay_decode_kv_through_redis(redis_url, tmp_path):
    logits_path = tmp_path / "b.pt"
    up_ids = json.loads(_run_agent("upstream", redis_url, "team"))
    report = json.loads(_run_agent("downstream", redis_url, "team", json.dumps(up_ids), str(logits_path)))
    got = torch.load(logits_path)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the agents' processes: another thread count sums in another order
    try:
        engine, _ = _engine(None, "team")  # the same calls in one process, on a memory store
        assert _upstream(engine) == up_ids
        want, prefix_reused, _ = _downstream(engine, up_ids)
    finally:
        torch.set_num_threads(threads)
    assert [(d["span_id"], d["action"]) for d in report["decisions"]] == [("agent-a", "fetch")]
    assert report["prefix_reused"] == prefix_reused == len(UP_PROMPT) + len(up_ids)
    for m in METHODS:
        assert not torch.equal(want[m], want["full"])  # reuse changes the logits: a miss would show
    for m in ("full", "prefix", *METHODS):
        assert torch.equal(got[m], want[m]), m


def test_namespaces_and_models_are_isolated_across_processes(redis_url):
    _run_agent("toy", redis_url, "tenant-1", "fp-toy")
    other_ns = open_store(redis_url, 1 << 24, fingerprint="fp-toy")
    assert "toy" not in other_ns.view("tenant-2") and "toy" not in other_ns
    assert other_ns.poll_published("tenant-2") == []
    other_model = open_store(redis_url, 1 << 24, fingerprint="fp-other")
    assert "toy" not in other_model.view("tenant-1")
    assert [d.reason for d in other_model.take_decisions()] == ["not in the tier"]
    same = open_store(redis_url, 1 << 24, fingerprint="fp-toy")
    seen = []
    same.on_published(seen.append, "tenant-1")
    assert same.sync() == 1 and seen[0].span_id == "toy" and seen[0].token_ids == tuple(range(24))
    assert same.sync() == 0  # the cursor moved on
    assert torch.equal(same.view("tenant-1").get("toy").k, _toy_span(24).k)


def test_corrupt_truncated_or_misplaced_values_are_misses_with_a_warning(redis_url, caplog):
    writer = open_store(redis_url, 1 << 24)
    for sid in ("flip", "cut", "moved"):
        writer.put(sid, _toy_span(32))
    raw = RedisBackend(redis_url).client
    vkey = PREFIX + span_key("", "fp-toy", "flip") + ":v"
    value = bytearray(raw.get(vkey))
    value[len(value) // 2] ^= 1
    raw.set(vkey, bytes(value))
    cut = PREFIX + span_key("", "fp-toy", "cut") + ":v"
    raw.set(PREFIX + span_key("", "fp-toy", "moved") + ":v", raw.get(cut))  # intact, but span "cut"'s
    raw.set(cut, raw.get(cut)[:-100])
    reader = open_store(redis_url, 1 << 24, fingerprint="fp-toy")
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        assert "flip" not in reader and "cut" not in reader and "moved" not in reader
    assert [d.reason for d in reader.take_decisions()] == ["corrupt value"] * 3
    assert sum("checksum" in r.getMessage() for r in caplog.records) >= 2
    assert len(reader) == 0


def test_redis_killed_mid_run_then_restarted_empty(own_redis, caplog):
    from kvrelay.engine.engine import Engine
    from tests.helpers import tiny_lm

    lm = tiny_lm("llama2")
    clock = Clock()  # the backoff passes when the test says, however long the outage took on this machine
    store = TieredStore(1 << 26, RedisBackend(own_redis.url, timeout_s=0.3), lm.fingerprint, min_backoff_s=0.05,
                        clock=clock)
    engine = Engine(lm, store, methods=("full", *METHODS))
    up_ids = _upstream(engine)
    store.remove("agent-a")  # only the tier has it now
    own_redis.stop()
    decisions = []
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        for _ in range(3):  # answered as if nothing were stored: every reuse method falls back to new tokens
            out, _, made = _downstream(engine, up_ids)
            decisions += made
            assert all(torch.equal(out[m], out["full"]) for m in METHODS)
        _upstream(engine)  # a publish while the tier is down keeps the span in memory
    assert "agent-a" in store and store.used_bytes <= store.budget_bytes
    assert decisions and {d["reason"] for d in decisions} == {"tier unavailable"}
    down = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(down) == 1  # logged once, not per request
    own_redis.start()  # same port, empty
    for _attempt in range(3):  # a lookup after each backoff; the client may drop a stale connection first
        clock.now_s += store.health.max_backoff_s
        assert "never-published" not in store  # a miss, never an error, while it reconnects
        reasons = [d.reason for d in store.take_decisions()]
        if reasons[-1] == "not in the tier":
            break
    assert reasons[-1] == "not in the tier"  # reconnected: the lookup reached the (empty) tier
    assert store.health.down_since is None
    fresh = TieredStore(1 << 26, RedisBackend(own_redis.url), lm.fingerprint)
    assert "agent-a" not in fresh
    store.sync()  # the span published while the tier was down reaches it now
    assert "agent-a" in fresh


def test_a_hung_redis_costs_one_timeout_then_nothing(own_redis):
    import signal
    import time

    clock = Clock()  # the backoff lasts until the test moves the store's clock, however loaded the machine
    backend = RedisBackend(own_redis.url, timeout_s=0.3)
    store = TieredStore(1 << 24, backend, "fp-toy", min_backoff_s=5.0, clock=clock)
    store.put("a", _toy_span(16))
    store.remove("a")
    reads: list[str] = []
    get_meta = backend.get_meta
    backend.get_meta = lambda key: reads.append(key) or get_meta(key)
    own_redis.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        t0 = time.perf_counter()
        assert "a" not in store  # one timeout
        first_s = time.perf_counter() - t0
        for _ in range(20):
            assert "a" not in store  # backing off: the tier is skipped
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    assert first_s > 0.2 and len(reads) == 1  # the client's timeout waited (a loaded machine only adds to it), once
    assert [d.reason for d in store.take_decisions()] == ["tier unavailable"] * 21
    clock.now_s += 5.0  # the backoff over: the next lookup reaches the tier, answering again
    assert "a" in store and len(reads) == 2


def test_maxmemory_bounds_the_tier_and_the_memory_budget_holds(own_redis):
    own_redis.stop()
    own_redis.maxmemory = "3mb"
    own_redis.start()
    budget_bytes = 600_000
    store = TieredStore(budget_bytes, RedisBackend(own_redis.url), "fp-toy")
    for i in range(40):  # 40 spans of ~260 KB: far more than the server may hold
        store.put(f"s{i}", _toy_span(1000 + i))
        assert store.used_bytes <= budget_bytes
    info = own_redis.client().info("memory")
    assert info["used_memory"] <= 3 * 1024 * 1024 * 1.1
    reader = TieredStore(budget_bytes, RedisBackend(own_redis.url), "fp-toy")
    hits = [f"s{i}" in reader for i in range(40)]
    assert not hits[0] and hits[-1] and reader.used_bytes <= budget_bytes
    assert store.health.num_failures == 0 and reader.health.num_failures == 0


def test_large_values_go_in_chunks_and_a_lost_chunk_is_a_miss(redis_url):
    writer = TieredStore(1 << 24, RedisBackend(redis_url, chunk_bytes=4096), "fp-toy")
    writer.put("big", _toy_span(64))  # ~22 KB: 6 chunks
    raw = RedisBackend(redis_url).client
    vkey = PREFIX + span_key("", "fp-toy", "big") + ":v"
    head = raw.get(vkey)
    assert head.startswith(b"KVRCHUNK") and int(head[8:]) >= 3
    assert raw.exists(f"{vkey}:{int(head[8:]) - 1}") and not raw.exists(f"{vkey}:{int(head[8:])}")
    reader = TieredStore(1 << 24, RedisBackend(redis_url), "fp-toy")  # any chunk size reads it
    assert torch.equal(reader.get("big").v, _toy_span(64).v)
    reader.remove("big")
    raw.delete(vkey + ":2")  # as if the LRU had evicted one chunk
    assert "big" not in reader
    assert reader.take_decisions()[-1].reason == "value gone from the tier (evicted)"
    assert writer.delete_from_tier("big") and not raw.keys(PREFIX + span_key("", "fp-toy", "big") + "*")


def test_a_refused_write_is_a_warning_not_an_outage(redis_url, caplog):
    import redis

    class RefusingPipeline:
        def set(self, *_args, **_kwargs) -> None:
            pass

        def execute(self) -> None:
            raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'")

    backend = RedisBackend(redis_url)
    store = TieredStore(1 << 24, backend, "fp-toy")
    real_pipeline = backend.client.pipeline
    backend.client.pipeline = lambda **_kwargs: RefusingPipeline()
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        store.put("a", _toy_span(8))
    backend.client.pipeline = real_pipeline
    assert "refused" in caplog.text and store.health.down_since is None
    store.put("b", _toy_span(9))  # no backoff: the next write goes through
    assert TieredStore(1 << 24, RedisBackend(redis_url), "fp-toy").contains("b")


def test_bad_urls_never_print_credentials(caplog):
    from kvrelay.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        open_store("mongodb://admin:s3cret@host/x", 1000)
    assert "s3cret" not in str(e.value) and "***" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        store = open_store("redis://admin:s3cret@127.0.0.1:1/0", 1000, timeout_s=0.2)
    assert isinstance(store, KVStore) and "s3cret" not in store.url
    assert caplog.records and all("s3cret" not in r.getMessage() for r in caplog.records)


if __name__ == "__main__":
    role, url, namespace, *rest = sys.argv[1:]
    if role == "toy":
        open_store(url, 1 << 24).view(namespace).put("toy", _toy_span(24, rest[0]))
        print("ok")
    elif role == "upstream":
        print(json.dumps(_upstream(_engine(url, namespace)[0])))
    else:
        engine, store = _engine(url, namespace)
        logits, prefix_reused, decisions = _downstream(engine, json.loads(rest[0]))
        torch.save(logits, rest[1])
        print(json.dumps({"decisions": decisions, "prefix_reused": prefix_reused}))
