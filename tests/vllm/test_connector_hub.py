"""The hub's scheduler-side plan: polling the shared tier (a network call) never holds the hub's lock."""

from __future__ import annotations

import threading

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.vllm.hub import ConnectorConfig, Hub

NEEDS_VLLM = False  # runs in the main venv


def _span(tokens: list[int]) -> StoredSpan:
    k = torch.zeros(2, 1, len(tokens), 4)
    return StoredSpan(tuple(tokens), 0, k, k.clone(), "fp")


def test_a_paused_tier_poll_blocks_no_other_lookup():
    """One request's plan waits on a tier poll that does not answer (a Redis paused mid-call); meanwhile the hub's
    lock is free, and another namespace's request plans its load from the spans stored here."""
    hub = Hub(ConnectorConfig(), "fp")
    tokens = list(range(100, 160))
    hub.put_span("fast", "up", _span(tokens))
    entered, release = threading.Event(), threading.Event()
    original_poll = hub.store.poll_published

    def paused_poll(namespace: str, fingerprint: str | None = None):
        if namespace == "slow":
            entered.set()
            release.wait()
        return original_poll(namespace, fingerprint)

    hub.store.poll_published = paused_poll
    plans = {}
    slow = threading.Thread(target=lambda: plans.setdefault("slow", hub.plan([1, 2, 3, *tokens, 4], "slow", 0)))
    slow.start()
    try:
        entered.wait()  # the slow request is inside its poll now
        assert hub.lock.acquire(blocking=False), "the hub's lock is held during the tier poll"
        hub.lock.release()
        plan = hub.plan([7, 8, *tokens, 9], "fast", 0)  # another request's lookup, in this thread
        assert plan is not None and [p.span_id for p in plan.pieces] == ["up"] and plan.end == 62
        assert slow.is_alive()  # the slow one is still waiting on its poll
    finally:
        release.set()
        slow.join()
    assert plans["slow"] is None  # nothing of namespace "fast" is found for "slow"
