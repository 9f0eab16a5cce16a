"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvrelay_requests", "HTTP requests received", ["endpoint"], registry=r)
        self.requests_done = Counter("kvrelay_completions", "completions finished", ["method"], registry=r)
        self.errors = Counter("kvrelay_errors", "requests answered with an error", ["status"], registry=r)
        self.rejected = Counter("kvrelay_rejected_queue_full", "requests refused with 429 (queue full)", registry=r)
        self.cancelled = Counter("kvrelay_cancelled", "requests cancelled because the client went away", registry=r)
        self.publish_skipped = Counter("kvrelay_publish_skipped",
                                       "outputs not stored: no room in their namespace's share", registry=r)
        self.ttft = Histogram("kvrelay_ttft_seconds", "request arrival to first token (queue included)",
                              buckets=_TTFT_BUCKETS_S, registry=r)
        self.engine_ttft = Histogram("kvrelay_engine_ttft_seconds", "plan + reused-KV load + prefill + first token",
                                     buckets=_TTFT_BUCKETS_S, registry=r)
        self.reused_token_layers = Counter("kvrelay_reused_token_layers", "prompt token-layers taken from the store",
                                           registry=r)
        self.computed_token_layers = Counter("kvrelay_computed_token_layers", "prompt token-layers computed",
                                             registry=r)
        self.recomputed_token_layers = Counter("kvrelay_recomputed_token_layers",
                                               "token-layers of reused spans computed again (repair)", registry=r)
        self.decode_batch = Histogram("kvrelay_decode_batch_size", "sequences decoded per batched step",
                                      buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.generated_tokens = Counter("kvrelay_generated_tokens", "completion tokens generated", registry=r)
        self.queue_depth = Gauge("kvrelay_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("kvrelay_running_requests", "requests prefilled and decoding", registry=r)
        self.sequence_kv_bytes = Gauge("kvrelay_sequence_kv_bytes", "KV bytes held by running requests", registry=r)
        self.store_bytes = Gauge("kvrelay_store_bytes", "bytes of KV in the span store", registry=r)
        self.store_spans = Gauge("kvrelay_store_spans", "spans in the store", registry=r)
        self.store_budget_bytes = Gauge("kvrelay_store_budget_bytes", "the store's byte budget", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
