"""Fetch a span from the shared tier, or recompute its tokens? A measured cost model, per span.

Fetching costs ``latency + value_bytes / tier_bytes_per_s`` (the tier's round trip, the transfer,
the checksum and the copy into tensors: everything a fetch measures). Recomputing costs
``num_tokens * num_layers / compute_token_layers_per_s``: the engine measures its prefill rate on
this model and device and hands it over (``set_compute_rate``). Both tier numbers are running
averages of what this process observed, seeded by a probe. Pure Python, no torch.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

ACTIONS = ("fetch", "recompute", "miss")  # what a ``FetchDecision`` may decide
_EWMA_ALPHA = 0.3  # weight of the newest sample: a few fetches move the estimate, one outlier does not


@dataclass(frozen=True)
class FetchDecision:
    """One lookup of a span that was not in the memory tier, with the inputs of the decision."""

    span_id: str
    namespace: str
    action: str  # "fetch" (and it arrived), "recompute" (cheaper, or no room), "miss" (absent, corrupt, tier down)
    reason: str
    num_tokens: int = 0
    num_layers: int = 0
    value_bytes: int = 0
    tier_bytes_per_s: float | None = None
    tier_latency_ms: float | None = None
    compute_token_layers_per_s: float | None = None
    est_fetch_ms: float | None = None
    est_recompute_ms: float | None = None
    fetch_ms: float | None = None  # measured, when fetched

    @property
    def fetched(self) -> bool:
        return self.action == "fetch"


class FetchCostModel:
    """Running estimates of the tier and the compute rate; decides fetch vs recompute."""

    def __init__(self, compute_token_layers_per_s: float | None = None) -> None:
        self.compute_token_layers_per_s = compute_token_layers_per_s
        self.tier_bytes_per_s: float | None = None
        self.tier_latency_s: float | None = None
        self._lock = threading.Lock()

    def set_compute_rate(self, token_layers_per_s: float | None) -> None:
        if token_layers_per_s is not None and not token_layers_per_s > 0:
            raise ValueError(f"compute rate must be positive, got {token_layers_per_s} token-layers/s")
        self.compute_token_layers_per_s = token_layers_per_s

    def observe_latency(self, seconds: float) -> None:
        """A small round trip (a metadata read)."""
        with self._lock:
            old = self.tier_latency_s
            self.tier_latency_s = seconds if old is None else (1 - _EWMA_ALPHA) * old + _EWMA_ALPHA * seconds

    def observe_fetch(self, value_bytes: int, seconds: float) -> None:
        """A whole fetch (read, checksum, decode) of ``value_bytes``."""
        with self._lock:
            transfer_s = max(seconds - (self.tier_latency_s or 0.0), 1e-9)
            rate = value_bytes / transfer_s
            old = self.tier_bytes_per_s
            self.tier_bytes_per_s = rate if old is None else (1 - _EWMA_ALPHA) * old + _EWMA_ALPHA * rate

    @property
    def measured(self) -> bool:
        return self.tier_bytes_per_s is not None and self.tier_latency_s is not None

    def estimate_fetch_s(self, value_bytes: int) -> float | None:
        if not self.measured:
            return None
        return self.tier_latency_s + value_bytes / self.tier_bytes_per_s

    def estimate_recompute_s(self, num_tokens: int, num_layers: int) -> float | None:
        if self.compute_token_layers_per_s is None:
            return None
        return num_tokens * num_layers / self.compute_token_layers_per_s

    def decide(self, span_id: str, namespace: str, num_tokens: int, num_layers: int,
               value_bytes: int) -> FetchDecision:
        """Fetch unless recomputing is estimated to be faster (fetch when either side is unknown)."""
        fetch_s = self.estimate_fetch_s(value_bytes)
        recompute_s = self.estimate_recompute_s(num_tokens, num_layers)
        if recompute_s is None:
            action, reason = "fetch", "no compute rate given"
        elif fetch_s is None:
            action, reason = "fetch", "tier not measured yet"
        elif fetch_s < recompute_s:
            action, reason = "fetch", "fetch estimated faster"
        else:
            action, reason = "recompute", "recompute estimated faster"
        return FetchDecision(
            span_id, namespace, action, reason, num_tokens, num_layers, value_bytes,
            self.tier_bytes_per_s, None if self.tier_latency_s is None else self.tier_latency_s * 1e3,
            self.compute_token_layers_per_s,
            None if fetch_s is None else fetch_s * 1e3, None if recompute_s is None else recompute_s * 1e3,
        )


class DecisionLog:
    """Decisions per thread (so one request's calls read their own) plus the last few for inspection."""

    def __init__(self, keep_recent: int = 1000) -> None:
        self._local = threading.local()
        self.recent: deque[FetchDecision] = deque(maxlen=keep_recent)
        # every decision since this log was made, by action (what /metrics exports: fixed labels)
        self.num_by_action = dict.fromkeys(ACTIONS, 0)
        self._lock = threading.Lock()

    def record(self, decision: FetchDecision) -> None:
        with self._lock:
            self.num_by_action[decision.action] += 1
        if not hasattr(self._local, "items"):
            self._local.items = []
        self._local.items.append(decision)
        self.recent.append(decision)

    def last(self) -> FetchDecision | None:
        """This thread's latest decision not yet taken."""
        items = getattr(self._local, "items", None)
        return items[-1] if items else None

    def take(self) -> list[FetchDecision]:
        """This thread's decisions since the last ``take``, oldest first."""
        items = getattr(self._local, "items", [])
        self._local.items = []
        return items
