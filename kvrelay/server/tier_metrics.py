"""The shared tier as monitoring sees it: ``/metrics`` families read from the store at each scrape, and ``/health``'s
``tier`` object.

A replica whose tier is down still serves (memory only), so ``/health`` stays 200 and says so in ``tier``; the gauge
``kvrelay_tier_up`` is what an alert watches. A memory-only server has no tier: its tier families are on the page
with no sample (``kvrelay_tier_up`` absent, not 0, which would read as an outage), and ``tier`` is null.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvrelay.cache.store import KVStore
from kvrelay.tier.fetch_cost import ACTIONS
from kvrelay.tier.tiered import TieredStore


def tier_of(store: KVStore) -> TieredStore | None:
    """The tiered store behind ``store`` (None: memory only)."""
    return store if isinstance(store, TieredStore) else None


def tier_state(store: KVStore) -> dict | None:
    """``/health``'s ``tier``: kind, whether it is up and for how long it has been down; None without a tier."""
    tier = tier_of(store)
    if tier is None:
        return None
    down_for_s = tier.health.down_for_s()
    # no URL: /health answers without a key, and the tier's address is the operator's business
    return {"kind": getattr(tier.backend, "kind", type(tier.backend).__name__), "up": down_for_s is None,
            "down_for_s": None if down_for_s is None else round(down_for_s, 1)}


class TierCollector:
    """The tier's families, read from the watched store's counts at each scrape (nothing to keep in step)."""

    def __init__(self) -> None:
        self.store: TieredStore | None = None

    def watch(self, store: KVStore) -> None:
        self.store = tier_of(store)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvrelay_tier_up", "1 while the shared tier answers, 0 while it is down (the replica "
                               "serves from memory); no sample without a shared tier")
        lookups = CounterMetricFamily("kvrelay_tier_lookups", "lookups of spans not in memory, by result: fetch (from "
                                      "the tier), recompute (cheaper, or no room), miss (absent, bad, tier down)",
                                      labels=["result"])
        failed = CounterMetricFamily("kvrelay_tier_failed_calls", "tier calls that failed (an error or a timeout "
                                     "marks the tier down); refusals by a live tier not included")
        skipped = CounterMetricFamily("kvrelay_tier_skipped_calls", "tier calls not made because the tier was down")
        bad = CounterMetricFamily("kvrelay_tier_bad_records", "records of the shared tier skipped as unreadable "
                                  "(announcement, metadata, value), each counted once; the tier goes on",
                                  labels=["kind"])
        unwritten = GaugeMetricFamily("kvrelay_tier_unwritten_spans", "spans put in memory and owed to the shared "
                                      "tier: the writer's backlog, or what waits for the tier to be back")
        tier = self.store
        if tier is not None:
            unwritten.add_metric([], tier.num_unwritten)
            up.add_metric([], 1.0 if tier.health.up else 0.0)
            for action in ACTIONS:
                lookups.add_metric([action], tier.decisions.num_by_action[action])
            failed.add_metric([], tier.health.num_failures)
            skipped.add_metric([], tier.health.num_skipped)
            for kind, total in tier.bad_records.items():
                bad.add_metric([kind], total)
        yield from (up, lookups, failed, skipped, bad, unwritten)
