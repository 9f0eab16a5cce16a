"""The quality guard's Prometheus metrics: aggregates over every namespace, never one namespace's content.

Counters of shadow references run and failed and of their compute seconds (what the guard costs), and, read from
the guard at scrape time, the rung moves so far and a gauge of roles per rung. No label names a namespace or a
role: ``/metrics`` is the operator's page, and per-tenant detail lives behind each tenant's key
(``GET /v1/kvrelay/quality``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.server.quality_serving import ServedGuard
from kvrelay.server.shadow import ShadowResult, ShadowRunner


class QualityMetrics:
    """Registered on the server's own registry next to ``ServerMetrics``."""

    def __init__(self, registry: CollectorRegistry, served: ServedGuard, runner: ShadowRunner) -> None:
        self.shadow_runs = Counter("kvrelay_quality_shadow_runs", "shadow full references compared with a live "
                                   "request (the quality guard's samples)", registry=registry)
        self.shadow_seconds = Counter("kvrelay_quality_shadow_compute_seconds", "engine time spent on shadow "
                                      "references (prefill and continuation chunk)", registry=registry)
        self.disagreements = Counter("kvrelay_quality_shadow_top1_disagreements", "shadow references whose "
                                     "first token's top-1 differed from full's", registry=registry)
        registry.register(_GuardCollector(served, runner))

    def observe(self, result: ShadowResult) -> None:
        self.shadow_runs.inc()
        self.shadow_seconds.inc(result.shadow_cost_ms / 1e3)
        if not result.top1_agree:
            self.disagreements.inc()


class _GuardCollector(Collector):
    """Rung moves and roles per rung (the guard's namespace-safe aggregates) and shadows dropped, read when scraped."""

    def __init__(self, served: ServedGuard, runner: ShadowRunner) -> None:
        self.served, self.runner = served, runner

    def collect(self) -> Iterator:
        aggregates = self.served.aggregates()
        moves = CounterMetricFamily("kvrelay_quality_rung_moves", "roles moved to another rung, by direction",
                                    labels=["direction"])
        for direction, count in sorted(aggregates["rung_moves"].items()):
            moves.add_metric([direction], count)
        yield moves
        roles = GaugeMetricFamily("kvrelay_quality_roles", "roles (over all namespaces) at each rung",
                                  labels=["rung"])
        for rung, count in sorted(aggregates["roles_per_rung"].items()):
            roles.add_metric([rung], count)
        yield roles
        unaffordable = CounterMetricFamily("kvrelay_quality_shadow_unaffordable", "calls the guard would have "
                                           "shadowed that the shadows' share of the compute did not draw")
        unaffordable.add_metric([], aggregates.get("num_unaffordable", 0))
        yield unaffordable
        failed = CounterMetricFamily("kvrelay_quality_shadow_failed", "shadow references dropped on an error")
        failed.add_metric([], self.runner.num_failed)
        yield failed
        # the lessons' series only with a learning rung on the ladder (as documented): a teacher is always built,
        # and a counter stuck at 0 on every default server reads as learning that never happens
        if self.runner.teacher is not None and self.runner.teacher.methods:
            lessons = CounterMetricFamily("kvrelay_quality_shadow_lessons", "shadow references handed to a learning "
                                          "rung of the ladder as its own dense prefill (kvcomm's anchors)")
            lessons.add_metric([], self.runner.teacher.num_taught)
            yield lessons
            lessons_failed = CounterMetricFamily("kvrelay_quality_shadow_lessons_failed", "lessons to a learning "
                                                 "rung that raised (the shadow was measured all the same)")
            lessons_failed.add_metric([], self.runner.teacher.num_failed)
            yield lessons_failed
        pending = GaugeMetricFamily("kvrelay_quality_shadows_pending", "shadow references queued or running (work "
                                    "the engine does in turns no live prefill waits for)")
        pending.add_metric([], self.runner.num_pending)
        yield pending
