"""Per-request latency, size and reuse histograms and how requests end, observed by the engine worker.

The worker tells this observer five things about a request (admitted, first token, each later token, done, ended
early) and it stamps the times and feeds the histograms, so the scheduler holds no metric arithmetic. The series
follow what vLLM operators alert on (queue time, prefill time, TTFT, inter-token latency, time per output token,
end-to-end latency, prompt and generation tokens per request, requests by finish reason), plus the share of each
prompt whose KV was reused: the number kvrelay is run for.

Latency buckets span 1 ms to 10 min: a GPU's decode step is milliseconds, a CPU's tens to hundreds of them, and an
8K-token prompt on a 2-core CPU prefills for over a minute (docs/serving.md); buckets that stop at a GPU's seconds
would put every CPU request in +Inf. No label names a tenant or holds a value a client chooses (docs/tenants.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvrelay.server.events import DoneEvent

if TYPE_CHECKING:
    from kvrelay.server.job import Job

REQUEST_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                             60.0, 120.0, 300.0, 600.0)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                           1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000,
                       200_000)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
# a request the worker accepted ends in exactly one of these; the first three are OpenAI's finish_reason. The worker's
# refusals are split by whose doing they are, so that an alert on "error" fires on the server's failures only:
# "rejected" (a 4xx: the request's own fault, e.g. a prompt over the context, a grammar that allows no token),
# "shutdown" (503 shutting_down: the server stopped), "error" (any other 5xx: the server failed it)
FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "rejected", "shutdown", "error")


class RequestMetrics:
    """Registered on the server's registry; ``clock`` (seconds, monotonic) is injectable so tests need no timing.
    A job's ``created_s`` must come from the same clock (``time.perf_counter`` in the server)."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        r = registry

        def latency(name: str, help_text: str, buckets: tuple[float, ...] = REQUEST_LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, help_text, buckets=buckets, registry=r)

        self.ttft = latency("kvrelay_ttft_seconds", "request arrival to first token (queue included)")
        self.engine_ttft = latency("kvrelay_engine_ttft_seconds", "plan + reused-KV load + prefill + first token "
                                   "(engine time; other requests' turns between its pieces not included)")
        self.queue_time = latency("kvrelay_request_queue_time_seconds", "request arrival to the start of its "
                                  "prefill (tokenizing, matching and waiting for a slot of the batch)")
        self.prefill_time = latency("kvrelay_request_prefill_time_seconds", "start of the prefill to the first "
                                    "token, wall time (its pieces and the other requests' steps between them)")
        self.decode_time = latency("kvrelay_request_decode_time_seconds", "first token to last token")
        self.e2e_latency = latency("kvrelay_e2e_request_latency_seconds", "request arrival to its last token, "
                                   "requests served to their end")
        self.inter_token = latency("kvrelay_inter_token_latency_seconds", "time between two consecutive tokens of "
                                   "a request (one observation per token after the first)", TOKEN_LATENCY_BUCKETS_S)
        self.time_per_output_token = latency("kvrelay_request_time_per_output_token_seconds", "a request's decode "
                                             "time over its tokens after the first (requests with 2 or more)",
                                             TOKEN_LATENCY_BUCKETS_S)
        self.prompt_tokens = Histogram("kvrelay_request_prompt_tokens", "prompt tokens per request",
                                       buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.generation_tokens = Histogram("kvrelay_request_generation_tokens", "completion tokens per request",
                                           buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.reused_ratio = Histogram("kvrelay_request_reused_prompt_ratio", "share of a request's prompt tokens "
                                      "whose KV came from the store (usage.prompt_tokens_details.cached_tokens over "
                                      "prompt_tokens)", buckets=RATIO_BUCKETS, registry=r)
        self.prompt_tokens_total = Counter("kvrelay_prompt_tokens", "prompt tokens of requests served to their "
                                           "end", registry=r)
        self.reused_prompt_tokens_total = Counter("kvrelay_reused_prompt_tokens", "prompt tokens whose KV came from "
                                                  "the store (rate over kvrelay_prompt_tokens_total: the reuse "
                                                  "rate)", registry=r)
        self.cancelled = Counter("kvrelay_cancelled", "requests cancelled because the client went away",
                                 registry=r)
        self.finished = Counter("kvrelay_requests_finished", "requests the engine worker accepted, by how "
                                "they ended (stop, length, tool_calls; cancelled: the client went away; rejected: "
                                "a 4xx, the request's fault; shutdown: 503 as the server stopped; error: another "
                                "5xx)", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series from the first scrape: rate() needs a sample before the event
            self.finished.labels(reason)

    def admitted(self, job: Job) -> None:
        """``job``'s prefill starts (again, for a request started over with the fallback method)."""
        job.admitted_s = self.clock()

    def first_token(self, job: Job) -> None:
        """``job``'s prefill ended with its first token."""
        now = job.first_token_s = job.last_token_s = self.clock()
        self.ttft.observe(now - job.created_s)
        self.engine_ttft.observe(job.seq.stats.ttft_ms / 1e3)
        if job.admitted_s is not None:
            self.queue_time.observe(job.admitted_s - job.created_s)
            self.prefill_time.observe(now - job.admitted_s)

    def token(self, job: Job) -> None:
        """A decode step gave ``job`` one more token."""
        now = self.clock()
        if job.last_token_s is not None:
            self.inter_token.observe(now - job.last_token_s)
        job.last_token_s = now

    def done(self, job: Job, event: DoneEvent) -> None:
        """``job`` was served to its end: ``event`` is what its client gets."""
        now = self.clock()
        self.e2e_latency.observe(now - job.created_s)
        if job.first_token_s is not None:
            decode_s = now - job.first_token_s
            self.decode_time.observe(decode_s)
            if event.num_completion_tokens > 1:
                self.time_per_output_token.observe(decode_s / (event.num_completion_tokens - 1))
        self.prompt_tokens.observe(event.num_prompt_tokens)
        self.generation_tokens.observe(event.num_completion_tokens)
        if event.num_prompt_tokens > 0:
            self.reused_ratio.observe(event.num_cached_tokens / event.num_prompt_tokens)
        self.prompt_tokens_total.inc(event.num_prompt_tokens)
        self.reused_prompt_tokens_total.inc(event.num_cached_tokens)
        self.finished.labels(event.finish_reason).inc()

    def ended_early(self, reason: str) -> None:
        """A request ended before it was served: "cancelled" (its client went away), "rejected", "shutdown" or
        "error" (``FINISH_REASONS``)."""
        if reason == "cancelled":
            self.cancelled.inc()
        self.finished.labels(reason).inc()
