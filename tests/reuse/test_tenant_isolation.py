"""What a method learns across calls stays in the namespace that taught it.

Tenant B runs the same calls in two worlds: alone, and after tenant A sent the very same document through the same
agent (A's calls teach the method first). B's results (cached tokens, computed token-layers, fallback text, note,
first-token logits, output ids) must be identical in both: otherwise B could tell from them which documents A sent.
Each world is one ``Engine`` holding one method object, as a server holds it for all its tenants; the calls run on
store views of namespaces "kA" and "kB", as the server's run on ``CatalogView``s.
"""

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import key_namespace
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import tiny_lm

UP_TOKENS = 24
HEAD, TAIL = [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


def _run(engine: Engine, store, call, method: str, sampling: SamplingConfig, keep_cache: bool = False):
    seq = engine.start(call, method, GenerateOptions(sampling, keep_cache=keep_cache), store=store)
    while not seq.done:
        engine.step([seq])
    return engine.finish(seq)


def _session(engine: Engine, store, method: str, doc_seed: int, k: int, role: str = ""):
    """One tenant's pipeline step on ``store`` (a namespace view): an upstream call reads document ``doc_seed`` and
    its output is published; the agent then reads that output in its own template with ``method``."""
    doc = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(doc_seed)).tolist()
    up = _run(engine, store, doc, "full", SamplingConfig(max_new_tokens=UP_TOKENS, temperature=1.0, seed=doc_seed),
              keep_cache=True)
    span_id = f"{store.namespace}-up{k}"
    engine.publish(span_id, up, store=store)
    call = CallInput(HEAD + up.output_ids + TAIL, [SpanRef(7, 7 + UP_TOKENS, span_id, 20, "output", "up")],
                     name="agent", role=role)
    return _run(engine, store, call, method, SamplingConfig(max_new_tokens=3))


def _what_b_sees(lm, method: str, a_first: bool, role: str = "") -> list[tuple]:
    store = KVStore(1 << 30)
    engine = Engine(lm, store, methods=[method])
    if a_first:  # A sends documents 0 and 1 through the agent: its calls teach the method
        for k in range(3):
            _session(engine, store.view("kA"), method, doc_seed=k % 2, k=k, role=role)
    seen = []
    for k in range(3):  # B guesses document 0 (sent by A), then 5 (never sent), then 0 again
        out = _session(engine, store.view("kB"), method, doc_seed=(0, 5, 0)[k], k=k, role=role)
        s = out.stats
        seen.append((s.num_reused_tokens, s.num_computed_token_layers, s.fallback, s.note, out.output_ids,
                     out.first_logits.tolist()))
    return seen


@pytest.mark.parametrize("method", [
    "kvcomm[warmup=1]",  # A's first call makes an anchor: B's gate would pass on it
    "kvcomm[warmup=2,short_anchors=true]",
])
def test_kvcomm_anchor_pools_and_templates_are_per_namespace(lm, method):
    alone = _what_b_sees(lm, method, a_first=False)
    assert alone[0][2] is not None  # B's first call has no anchor of its own: a fallback
    assert _what_b_sees(lm, method, a_first=True) == alone


BAND = "band=1:2:3"  # the tiny model has no profile


def test_relay_keeps_no_state_across_calls(lm):
    """relay's per-role choices come from the model's profile (a file the operator ships), not from calls."""
    method = f"relay[{BAND}]"
    alone = _what_b_sees(lm, method, a_first=False)
    assert _what_b_sees(lm, method, a_first=True) == alone


def test_the_fallback_text_shows_no_anchor_distances(lm):
    """A fallback says why (counts, the gate's entropy), not how far the call's values are from the pool's."""
    store = KVStore(1 << 30)
    engine = Engine(lm, store, methods=["kvcomm[warmup=2,gamma=0]"])
    texts = [_session(engine, store.view("kA"), "kvcomm[warmup=2,gamma=0]", doc_seed=k, k=k).stats.fallback
             for k in range(4)]
    assert any("entropy" in t for t in texts)
    assert not any("L2" in t for t in texts)


def _learned(method, namespace: str) -> bool:
    keys = method.pools
    return any(key_namespace(k) == namespace for k in keys)


@pytest.mark.parametrize("method", ["kvcomm[warmup=1]"])
def test_what_a_namespace_taught_goes_when_the_namespace_expires(lm, method):
    """Tenants come and go (a cache_salt is the client's choice): what one taught is dropped once its namespace has
    expired (idle for kv_namespace_idle_s), and only then."""
    now = [0.0]
    store = KVStore(1 << 30, namespace_idle_s=10, clock=lambda: now[0])
    engine = Engine(lm, store, methods=[method])
    for k in range(2):
        _session(engine, store.view("kA"), method, doc_seed=k, k=k)
    m = engine.method(method)
    assert _learned(m, "kA")
    now[0] = 5
    _session(engine, store.view("kB"), method, doc_seed=5, k=0)
    assert _learned(m, "kA") and _learned(m, "kB")  # A is idle, not expired
    now[0] = 11  # A's last use was at 0: expired; B's at 5: not
    _session(engine, store.view("kB"), method, doc_seed=6, k=1)
    assert not _learned(m, "kA") and _learned(m, "kB")
