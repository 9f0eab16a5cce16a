"""The engine worker: one thread owns the engine and runs schedule -> run -> postprocess.

Each turn it (1) drops requests whose clients went away, (2) admits waiting requests while fewer than
``max_running`` are prefilling or decoding, (3) advances their prefills within a cost budget (kvrelay.server.
prefill_turn: a long prompt runs in pieces between decode steps, so it never stalls the running streams for more
than one piece), (4) runs one batched ``engine.step`` for all running requests, and (5) hands tokens back to the
asyncio side as events through the request's ``emit`` callback (``loop.call_soon_threadsafe``; how tokens become
events is the ``Job``'s, kvrelay.server.job). The queue is FIFO and bounded; a full queue is a 429.

This module is the engine thread's side: the loop and a request's life on it, from admission to its published
output. ``EngineWorker`` mixes in the rest: how a request gets into the queue (``prepare`` on the prepare threads,
``submit``, ``cancel``: kvrelay.server.worker_admission), how one request fails alone (kvrelay.server.
request_failures) and a graceful shutdown (kvrelay.server.worker_drain).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvrelay.engine import Engine, GenerateOptions, GenerationOutput, Sequence
from kvrelay.engine.prefill import PrefillTask
from kvrelay.errors import KvRelayError, StoreFullError
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.chunk_budget import ChunkBudget
from kvrelay.server.events import ErrorEvent
from kvrelay.server.job import Job, ids_of_text
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prefill_turn import advance_prefills
from kvrelay.server.protocol import ApiError, shutting_down_error
from kvrelay.server.registry import RegisteredOutput
from kvrelay.server.request_failures import RequestFailures, about, engine_failure
from kvrelay.server.request_ids import request_context
from kvrelay.server.serve_config import DEFAULT_PREFILL_CHUNK_TOKENS
from kvrelay.server.textstream import IncrementalDecoder, StopMatcher
from kvrelay.server.worker_admission import PREPARE_THREADS, WorkerAdmission
from kvrelay.server.worker_drain import WorkerDrain

__all__ = ["DEFAULT_PREFILL_CHUNK_TOKENS", "EngineWorker", "Job"]  # Job: its home is kvrelay.server.job

log = logging.getLogger("kvrelay.server")


class EngineWorker(WorkerAdmission, RequestFailures, WorkerDrain):
    def __init__(self, engine: Engine, catalog: SpanCatalog, metrics: ServerMetrics, max_queue: int = 64,
                 max_running: int = 8, prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS) -> None:
        """``max_running``: requests prefilling or decoding at once; ``prefill_chunk_tokens``: a turn's prefill
        between two decode steps costs what this many tokens cost at the start of a prompt (and has at most this
        many; ``chunk_budget``)."""
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        self.engine, self.catalog, self.metrics = engine, catalog, metrics
        self.requests = metrics.per_request  # each request's latencies, sizes and ending (their observer)
        self.max_queue, self.max_running = max_queue, max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.chunk_budget = ChunkBudget(prefill_chunk_tokens)
        self.tokenizer = engine.lm.tokenizer
        self.context_tokens = engine.lm.config.max_position_embeddings
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._prefilling: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._paused = False
        self._num_preparing = 0  # submitted jobs still being tokenized and matched (they count as queued)
        self._prepare_pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="kvrelay-prepare")
        self._thread = threading.Thread(target=self._loop, name="kvrelay-engine", daemon=True)
        # the quality guard (kvrelay.server.quality_setup sets both; None: off): it picks a request's method at
        # ``prepare`` (ServedGuard) and runs shadow references in idle turns (ShadowRunner)
        self.quality = None
        self.shadows = None

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.ident is not None:  # a worker driven turn by turn (``run_turn``) never started its thread
            self._thread.join(timeout=30)

    def pause(self) -> None:
        """Debug hook: the worker finishes its turn and runs no other until ``resume`` (requests still queue,
        and a full queue is still a 429). Tests use it to make requests overlap for sure."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _has_turn(self) -> bool:  # holding ``_cond``
        if self._waiting or self._running or self._prefilling:
            return True
        wait_s = self._shadow_wait_s()
        return wait_s is not None and wait_s <= 0

    def _shadow_wait_s(self) -> float | None:  # holding ``_cond``, with no live work queued or running
        """Seconds until a shadow piece may run (None: none can, or a request is being prepared: it is live work
        the engine will have in a moment, which a shadow piece started now would delay)."""
        if self.shadows is None or self._num_preparing:
            return None
        self.shadows.note_turn(None, idle=True)
        wait_s = self.shadows.ready_in_s(self.chunk_budget)
        return None if wait_s is None or wait_s == float("inf") else wait_s

    @property
    def state(self) -> str:
        """"running" (serving), "starting" (its thread not started yet), "stopping" (draining or asked to stop: the
        server shuts down) or "dead" (its thread ended without being asked: a request would wait for ever)."""
        if self._stopping or self._draining:
            return "stopping"
        if self._thread.ident is None:
            return "starting"
        return "running" if self._thread.is_alive() else "dead"

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    # ------------------------------------------------------------------ the worker thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._cut_pending and (self._paused or not self._has_turn()):
                    self._cond.wait(None if self._paused else self._shadow_wait_s())
                if self._stopping:
                    break
                cut = self._cut_pending
            if cut:  # the shutdown grace is over (``WorkerDrain``); done between turns, paused or not
                self._cut_all()
            else:
                self.run_turn()
        err = shutting_down_error()
        for job in list(self._running) + list(self._prefilling) + list(self._waiting):
            self._fail(job, err.status, err.message, err.code)

    def run_turn(self) -> None:
        """One turn: admit, prefill within the budget, one decode step, finish. The worker thread loops on it; a
        test may drive a worker it never started turn by turn."""
        with self._cond:
            jobs = []
            while self._waiting and len(self._running) + len(self._prefilling) + len(jobs) < self.max_running:
                jobs.append(self._waiting.popleft())
            self.metrics.queue_depth.set(len(self._waiting))
        try:
            self._turn(jobs)
        except Exception:  # a bug must not kill the worker: fail what is running, keep serving
            log.exception("engine worker turn failed")
            for failed in list(self._running) + list(self._prefilling) + [j for j in jobs if j.seq is None
                                                                          and j.task is None]:
                self._fail(failed, 500, "internal error in the engine worker", "internal_error")

    def _turn(self, jobs: list[Job]) -> None:
        start_s, had_live = time.perf_counter(), bool(jobs or self._running or self._prefilling)
        for running in list(self._running):
            if running.cancelled.is_set():
                self._finish(running, client_gone=True)
        for job in list(self._prefilling):
            if job.cancelled.is_set():
                self._drop_prefill(job)
        for job in jobs:
            if job.cancelled.is_set():
                self._release(job)
                self.requests.ended_early("cancelled")
            else:
                self._admit(job)
        advance_prefills(self._prefilling, self.chunk_budget, self._prefilled, self._prefill_failed)
        live = [j for j in self._running if not j.seq.done]
        step_ms = None  # the decode step's time: a shadow piece beside it is sized by it
        if live:
            step_start_s = time.perf_counter()
            tokens = self.engine.step([j.seq for j in live])
            step_ms = (time.perf_counter() - step_start_s) * 1e3
            self.metrics.decode_batch.observe(len(live))
            for j, token in zip(live, tokens, strict=True):
                if token is not None:
                    self.requests.token(j)
                    self._contained(j, self._emit_text)
        for j in list(self._running):
            if j.seq.error is not None:  # its sampling or forward failed in the step: it alone fails
                self._fail(j, *engine_failure(j.seq.error))
            elif j.seq.done:
                self._contained(j, self._finish)
        live_ms = (time.perf_counter() - start_s) * 1e3 if had_live else None
        if live_ms is not None:
            self.metrics.live_engine_seconds.inc(live_ms / 1e3)
        if self.shadows is not None:
            self.shadows.note_turn(live_ms,
                                   idle=not (self._running or self._prefilling or self._waiting
                                             or self._num_preparing))
            if not self._prefilling and not self._waiting:  # lowest priority: no live prefill is waiting
                # while streams decode, a small piece beside their step (every stream's next token waits for it)
                decode_ms = (step_ms or 0.0) if self._running else None
                self.shadows.advance(self.chunk_budget, decode_ms)
        self.metrics.running.set(len(self._running))
        self.metrics.sequence_kv_bytes.set(sum(_cache_bytes(j.seq) for j in self._running)
                                           + sum(_cache_bytes(j.task) for j in self._prefilling))
        self.metrics.observe_store(self.catalog.store)

    def _admit(self, job: Job) -> None:
        """Start ``job``'s prefill (preparing it first if the server did not). A bug it meets fails it alone
        (a 500); the requests already running go on."""
        try:
            with request_context(job.request_id):
                started = self._start(job)
            if started:
                self._prefilling.append(job)
        except Exception:
            log.exception("starting request %s failed", job.request_id or "-", extra=about(job))
            self._fail(job, 500, "internal error while starting this request", "internal_error")

    def _start(self, job: Job) -> bool:
        """Prepare (if not yet) and begin its prefill: True when it began, False when it was answered an error."""
        try:
            if job.built is None:
                self.prepare(job)
            mask = job.constraint.new_mask() if job.constraint else None
            if job.penalties is not None:  # outside the grammar: its -inf stays, whatever the bias
                mask = job.penalized = job.penalties.new_mask(mask, job.built.call.prompt_ids)
            self.requests.admitted(job)
            job.task = self.engine.begin(job.built.call, job.method, GenerateOptions(
                job.sampling, keep_cache=True, logits_mask=mask, stop_ids=job.vllm.stop_ids),
                store=self.catalog.view(job.namespace))
        except ApiError as exc:
            self._release(job)
            self._answer_error(job, ErrorEvent.of(exc))
            return False
        except KvRelayError as exc:
            self._release(job)
            self._answer_error(job, ErrorEvent(400, str(exc), None, "invalid_value"))
            return False
        return True

    def _prefilled(self, job: Job) -> None:
        """A finished prefill joins the decode batch, its first token out at once."""
        job.seq = job.task.sequence()
        job.task = None
        self._prefilling.remove(job)
        self._begin(job)

    def _drop_prefill(self, job: Job) -> None:
        """The client went away while its prompt was prefilling: its KV is freed, nothing is published."""
        self._prefilling.remove(job)
        job.task.cancel()
        job.task = None
        self._release(job)
        self.requests.ended_early("cancelled")

    def _begin(self, job: Job) -> None:
        """The prefilled request joins the decode batch: its metrics, stop matcher, logprobs, first token out."""
        self._running.append(job)  # first: a failure below then finishes its sequence in ``_fail``
        self.requests.first_token(job)
        job.matcher = StopMatcher(job.stop, job.vllm.include_stop_str_in_output)
        job.decoder = IncrementalDecoder(self.tokenizer, job.vllm.skip_special_tokens)
        job.record_logprobs(self.tokenizer)
        if self.shadows is not None and job.quality is not None:  # before its first decode step: taps its logits
            self.shadows.offer(job.namespace, job.quality.role, job.quality.measured_as, job.seq, self.chunk_budget)
        if job.seq.output_ids:
            self._emit_text(job)

    def _emit_text(self, job: Job) -> None:  # the step's post-processing of one request (``_contained``)
        job.emit_text()

    def _finish(self, job: Job, client_gone: bool = False) -> None:
        seq = job.seq
        if client_gone:
            seq.cancel()
        stop_string = job.matcher.hit if job.matcher else False
        out = self.engine.finish(seq)
        self._running.remove(job)
        self._release(job)
        if client_gone:
            out.cache = None
            self.requests.ended_early("cancelled")
            return
        text = job.output_text(out, self.tokenizer)
        with request_context(job.request_id):
            span_id = self._publish(job, out, text) if job.cache_output else None
        out.cache = None
        done = job.close_output(out, text, stop_string, span_id)  # the last deltas out
        self.requests.done(job, done)
        stats = out.stats
        self.metrics.requests_done.labels(stats.method).inc()
        self.metrics.reused_token_layers.inc(stats.num_reused_token_layers)
        self.metrics.computed_token_layers.inc(stats.num_computed_token_layers)
        self.metrics.recomputed_token_layers.inc(max(stats.num_recomputed_token_layers, 0))
        self.metrics.generated_tokens.inc(len(out.output_ids))
        job.emit(done)

    def _publish(self, job: Job, out: GenerationOutput, text: str) -> str | None:
        """Store the call's prompt + decode KV and register its returned text; the span id, or None."""
        published = out
        if out.stop_reason == "cancelled" and out.output_ids:  # the last sampled token was never fed: no KV
            published = replace(out, output_ids=out.output_ids[:-1])
        span_id = self.catalog.new_span_id(len(out.prompt_ids))
        try:
            self.engine.publish(span_id, published, store=self.catalog.view(job.namespace, job.built.framing))
        except StoreFullError:
            self.metrics.publish_skipped.inc()
            return None
        ids = ids_of_text(self.tokenizer, published.output_ids, text)
        if ids is not None:
            self.catalog.register(RegisteredOutput(text, tuple(ids), span_id, len(out.prompt_ids), job.namespace))
        return span_id

    def _release(self, job: Job) -> None:
        if job.built is not None:
            self.catalog.unpin(job.built)

def _cache_bytes(holder: Sequence | PrefillTask | None) -> int:
    if holder is None or holder.cache is None:
        return 0
    return sum(t.numel() * t.element_size() for t in holder.cache.storages)
