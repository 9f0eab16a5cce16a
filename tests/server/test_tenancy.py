"""Over HTTP: a full store of another tenant's idle spans does not starve a new tenant."""

from __future__ import annotations

import time

from tests.server.conftest import MODEL, Server

PROMPT = [{"role": "user", "content": "List the first ten prime numbers, then add them up step by step."}]
IDLE_S = 2.0


def cached_tokens(server: Server, namespace: str) -> int:
    r = server.client().chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, temperature=0,
                                                extra_body={"cache_salt": namespace})
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_new_namespace_is_cached_once_the_full_store_idle_namespace_expires():
    probe = Server("--kv-budget-gb", "1")
    try:
        cached_tokens(probe, "probe")
        span_bytes = probe.metric("kvrelay_store_bytes")  # what one call of PROMPT stores
    finally:
        probe.stop()
    assert span_bytes > 0
    # room for one such span, not two: namespace "a" fills the store
    srv = Server("--kv-budget-gb", str(1.5 * span_bytes / (1 << 30)), "--kv-namespace-idle-s", str(IDLE_S))
    try:
        assert cached_tokens(srv, "a") == 0
        assert cached_tokens(srv, "a") > 0  # a's own repeat is served from its span
        assert cached_tokens(srv, "b") == 0 and cached_tokens(srv, "b") == 0  # a is active: b's spans are refused
        assert srv.metric('kvrelay_store_puts_refused_total{reason="store_full"}') == 2
        time.sleep(IDLE_S + 0.5)  # a goes unused: it expires; b never evicted it
        assert cached_tokens(srv, "b") == 0
        assert cached_tokens(srv, "b") > 0
        assert srv.metric("kvrelay_store_namespaces_reclaimed_total") == 1
        assert srv.metric("kvrelay_store_namespaces") == 1
        assert srv.metric("kvrelay_store_peak_bytes") <= srv.metric("kvrelay_store_budget_bytes")
    finally:
        srv.stop()
