"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from kvrelay.server.request_metrics import RequestMetrics
from kvrelay.server.tier_metrics import TierCollector

if TYPE_CHECKING:
    from kvrelay.cache.store import KVStore


ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}
OTHER_ENDPOINT = "other"  # /health, /metrics, /v1/models, stored responses, unknown routes
CLIENT_LEFT_STATUS = 499


def endpoint_of(path: str) -> str:
    """The ``endpoint`` label of a request path: one of ``ENDPOINTS``' values, or ``OTHER_ENDPOINT``."""
    return ENDPOINTS.get(path, OTHER_ENDPOINT)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # the process's own series, as prometheus_client's default registry has them (this one is private): RSS,
        # CPU seconds, open fds (process_*; Linux only) and python_info
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        # which version, model and method a replica serves (value 1; labels set once by ``describe``)
        self.build_info = Gauge("kvrelay_build_info", "1, labelled with the kvrelay version, the model served, the "
                                "--method (empty with the quality guard on) and the guard's ladder (empty without)",
                                ["version", "model", "method", "quality_ladder"], registry=r)
        # both counted by kvrelay.server.request_ids, for every HTTP request the app gets, so that errors over requests
        # is a ratio of one population (a 400 refused before its route ran counts in both)
        self.requests = Counter("kvrelay_requests", "HTTP requests received, by endpoint (chat, completions, "
                                "responses, other)", ["endpoint"], registry=r)
        self.requests_done = Counter("kvrelay_completions", "requests served to their end, by the reuse method "
                                     "that served them", ["method"], registry=r)
        self.errors = Counter("kvrelay_errors", "requests answered with an error status (4xx: the client's, 5xx: the "
                              "server's; a stream's error chunk by the status it carries; not 499: the client left), "
                              "by endpoint and status", ["endpoint", "status"], registry=r)
        self.rejected = Counter("kvrelay_rejected_queue_full", "requests refused with 429 (queue full)", registry=r)
        self.publish_skipped = Counter("kvrelay_publish_skipped",
                                       "outputs not stored: no room in their namespace's share", registry=r)
        self.reused_token_layers = Counter("kvrelay_reused_token_layers", "prompt token-layers taken from the store",
                                           registry=r)
        self.computed_token_layers = Counter("kvrelay_computed_token_layers", "prompt token-layers computed",
                                             registry=r)
        self.recomputed_token_layers = Counter("kvrelay_recomputed_token_layers",
                                               "token-layers of reused spans computed again (repair)", registry=r)
        self.decode_batch = Histogram("kvrelay_decode_batch_size", "sequences decoded per batched step",
                                      buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.generated_tokens = Counter("kvrelay_generated_tokens", "completion tokens of requests served to their end",
                                        registry=r)
        self.live_engine_seconds = Counter("kvrelay_live_engine_seconds", "engine time in turns with live requests "
                                           "(their prefill pieces, decode steps and post-processing; shadow "
                                           "references not included)", registry=r)
        self.queue_depth = Gauge("kvrelay_queue_depth", "requests queued for the engine (prepared, waiting for a slot)",
                                 registry=r)
        self.running = Gauge("kvrelay_running_requests", "requests prefilled and decoding", registry=r)
        self.sequence_kv_bytes = Gauge("kvrelay_sequence_kv_bytes", "KV bytes held by running and prefilling requests",
                                       registry=r)
        self.store_bytes = Gauge("kvrelay_store_bytes", "bytes of KV in the span store", registry=r)
        self.store_spans = Gauge("kvrelay_store_spans", "spans in the store", registry=r)
        self.store_budget_bytes = Gauge("kvrelay_store_budget_bytes", "the store's byte budget", registry=r)
        self.store_peak_bytes = Gauge("kvrelay_store_peak_bytes", "most bytes the span store ever held", registry=r)
        self.namespaces = Gauge("kvrelay_store_namespaces", "namespaces holding spans", registry=r)
        self.namespaces_reclaimed = Counter("kvrelay_store_namespaces_reclaimed",
                                            "namespaces dropped whole after being idle", registry=r)
        self.puts_refused = Counter("kvrelay_store_puts_refused",
                                    "spans not stored: the namespace's quota (pinned) or the store (other "
                                    "namespaces' live spans) was full", ["reason"], registry=r)
        # the shared tier's up gauge, lookups, failed and skipped calls, bad records: read from the store at a scrape
        self.tier = TierCollector()
        r.register(self.tier)
        # TTFT and the other latencies, sizes, reuse and finish reason of each request; kvrelay_cancelled_total
        self.per_request = RequestMetrics(r)
        self._seen: dict[str, int] = {}

    def describe(self, model: str, method: str | None, quality_ladder: str | None) -> None:
        """``kvrelay_build_info``'s one sample: this server's version, model, method or guard ladder."""
        from kvrelay import __version__

        self.build_info.labels(__version__, model, method or "", quality_ladder or "").set(1)

    def request_received(self, path: str) -> str:
        """Count one HTTP request; its ``endpoint`` label (fixed values: no client-chosen path becomes a series)."""
        endpoint = endpoint_of(path)
        self.requests.labels(endpoint).inc()
        return endpoint

    def request_failed(self, endpoint: str, status: int) -> None:
        """Count a request answered with ``status`` (>= 400), unless 499: no answer, its client left first
        (``kvrelay_cancelled_total`` counts those)."""
        if status >= 400 and status != CLIENT_LEFT_STATUS:
            self.errors.labels(endpoint, str(status)).inc()

    def observe_store(self, store: KVStore) -> None:
        """Store gauges now; the store's cumulative counts become counter increments."""
        self.store_bytes.set(store.used_bytes)
        self.store_spans.set(len(store))
        self.store_peak_bytes.set(store.peak_bytes)
        tenants = store.tenants
        self.namespaces.set(len(tenants))
        for key, total, counter in (("reclaimed", tenants.num_reclaimed, self.namespaces_reclaimed),
                                    *((reason, n, self.puts_refused.labels(reason))
                                      for reason, n in tenants.num_refused.items())):
            counter.inc(total - self._seen.get(key, 0))
            self._seen[key] = total
        self.tier.watch(store)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry's families without their ``*_created`` samples. prometheus_client adds one per counter and
    histogram (and per label set): the time the series began, as a gauge, which doubles the page and which
    Prometheus's text-format scrape stores as a series of its own that no dashboard reads (a restart already shows as
    a counter reset). ``prometheus_client.disable_created_metrics()`` would drop them for every registry in the
    process, an embedding application's too; this drops them from this server's page only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield kept
