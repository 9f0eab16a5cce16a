"""Over HTTP: a full store of another tenant's idle spans does not starve a new tenant."""

from __future__ import annotations

from tests.server.conftest import MODEL
from tests.server.live import FakeClock, LiveServer

PROMPT = [{"role": "user", "content": "List the first ten prime numbers, then add them up step by step."}]
IDLE_S = 2.0


def cached_tokens(server: LiveServer, namespace: str) -> int:
    r = server.client().chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, temperature=0,
                                                extra_body={"cache_salt": namespace})
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_new_namespace_is_cached_once_the_full_store_idle_namespace_expires():
    probe = LiveServer(budget_bytes=1 << 30)
    try:
        cached_tokens(probe, "probe")
        span_bytes = probe.metric("kvrelay_store_bytes")  # what one call of PROMPT stores
    finally:
        probe.stop()
    assert span_bytes > 0
    # room for one such span, not two: namespace "a" fills the store
    clock = FakeClock()  # the store's: the idle time passes when the test says, not by sleeping
    srv = LiveServer(budget_bytes=int(1.5 * span_bytes), clock=clock, namespace_idle_s=IDLE_S)
    try:
        assert cached_tokens(srv, "a") == 0
        assert cached_tokens(srv, "a") > 0  # a's own repeat is served from its span
        assert cached_tokens(srv, "b") == 0 and cached_tokens(srv, "b") == 0  # a is active: b's spans are refused
        assert srv.metric('kvrelay_store_puts_refused_total{reason="store_full"}') == 2
        clock.advance(IDLE_S - 0.01)
        assert cached_tokens(srv, "b") == 0  # a is not idle long enough yet: still refused
        assert srv.metric("kvrelay_store_namespaces_reclaimed_total") == 0
        clock.advance(0.02)  # a goes unused past the limit: it expires; b never evicted it
        assert cached_tokens(srv, "b") == 0
        assert cached_tokens(srv, "b") > 0
        assert srv.metric("kvrelay_store_namespaces_reclaimed_total") == 1
        assert srv.metric("kvrelay_store_namespaces") == 1
        assert srv.metric("kvrelay_store_peak_bytes") <= srv.metric("kvrelay_store_budget_bytes")
    finally:
        srv.stop()
