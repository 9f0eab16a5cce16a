"""How a request gets into the engine worker's queue: prepared (tokenized and matched) off the engine thread, then
queued, or refused.

Preparing (``prepare``) is the costly part of admission that needs no model: the server runs it on the worker's
prepare threads before the request joins the queue (the tokenizer releases the GIL), so a huge body never holds the
engine thread. This side runs on the asyncio and prepare threads and only touches the queue under ``_cond``; what
the engine thread does with a queued request (admit, prefill, decode, finish) is kvrelay.server.scheduler's.
``EngineWorker`` mixes this in.
"""

from __future__ import annotations

import contextvars
import logging
import time

from kvrelay.errors import KvRelayError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.server.events import ErrorEvent
from kvrelay.server.job import Job
from kvrelay.server.protocol import ApiError, shutting_down_error
from kvrelay.server.request_failures import about

__all__ = ["PREPARE_THREADS", "WorkerAdmission"]

log = logging.getLogger("kvrelay.server")
PREPARE_THREADS = 8  # requests tokenized and matched at once, off the engine thread


class WorkerAdmission:
    """The admission of ``EngineWorker`` (which provides ``_cond``, ``_waiting``, ``_num_preparing``,
    ``_prepare_pool``, ``max_queue``, ``context_tokens``, ``catalog``, ``quality``, ``metrics``, ``requests``,
    ``_draining``, ``_release``, ``_refuse`` and ``_answer_error``)."""

    def prepare(self, job: Job) -> None:
        """Tokenize and match ``job`` (its ``build``, the catalog's lookup; the spans it reads get pinned): the part
        of admission that needs no model. The server runs it off the engine thread before ``submit``; a job
        submitted unprepared is prepared at admission. Raises ApiError for a prompt that cannot be served."""
        t0 = time.perf_counter()
        prompt, agent = job.build()
        t1 = time.perf_counter()
        if self.quality is not None:  # the role's rung picks the method, unless the request named its own
            job.method, job.quality = self.quality.pick(job.namespace, agent, job.method if job.method_named
                                                        else None, job.method)
        n = len(prompt.ids)
        room = self.context_tokens - n
        if n == 0:
            raise ApiError(400, "the prompt is empty", param=job.prompt_param, code="empty_prompt")
        if room < 1 or (job.max_tokens is not None and job.max_tokens > room):
            raise ApiError(400, f"the prompt has {n} tokens and asks for up to {job.max_tokens or 1} new ones, "
                           f"over the model's context of {self.context_tokens} tokens",
                           param=job.prompt_param, code="context_length_exceeded")
        max_tokens = job.max_tokens or min(job.default_max_tokens, room)
        job.sampling = SamplingConfig(max_tokens, job.temperature, job.top_p, job.seed, job.vllm.top_k, job.vllm.min_p)
        job.built = self.catalog.build_call(prompt, job.namespace, agent, job.role)
        log.debug("prepare: %d tokens, build %.0f ms, match %.0f ms", n, (t1 - t0) * 1e3,
                  (time.perf_counter() - t1) * 1e3)

    def submit(self, job: Job) -> None:
        """Queue ``job``; a full queue is an ApiError 429. An unprepared job is prepared on the worker's prepare
        threads first (its errors arrive as error events), then joins the queue (FIFO from there)."""
        with self._cond:
            if self._draining:  # the server is shutting down (``WorkerDrain``)
                self._release(job)
                raise shutting_down_error()
            if len(self._waiting) + self._num_preparing >= self.max_queue:
                self._release(job)
                self.metrics.rejected.inc()
                raise ApiError(429, f"the server queue is full ({self.max_queue} waiting requests); retry later",
                               "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            if job.built is None:
                self._num_preparing += 1
            else:
                self._queue(job)
                return
        # in the submitter's context: what preparing logs (a bad record of the tier) names the request's id
        self._prepare_pool.submit(contextvars.copy_context().run, self._prepare_then_queue, job)

    def cancel(self, job: Job) -> None:
        """The client went away: drop it from the queue, or stop it at the next step (its KV is freed)."""
        job.cancel()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self._release(job)
                self.metrics.queue_depth.set(len(self._waiting))
                self.requests.ended_early("cancelled")
            self._cond.notify_all()

    @property
    def num_waiting(self) -> int:
        """Requests queued or being prepared (what ``--max-queue`` bounds)."""
        return len(self._waiting) + self._num_preparing

    def _queue(self, job: Job) -> None:  # holding ``_cond``
        self._waiting.append(job)
        self.metrics.queue_depth.set(len(self._waiting))
        self._cond.notify_all()

    def _prepare_then_queue(self, job: Job) -> None:
        """On a prepare thread: tokenize and match, then queue; a request that cannot be served is answered here."""
        try:
            if not job.cancelled.is_set():
                self.prepare(job)
        except ApiError as exc:
            self._answer_error(job, ErrorEvent.of(exc))
        except KvRelayError as exc:
            self._answer_error(job, ErrorEvent(400, str(exc), None, "invalid_value"))
        except Exception:
            log.exception("preparing request %s failed", job.request_id or "-", extra=about(job))
            self._answer_error(job, ErrorEvent(500, "internal error while starting this request", None,
                                               "internal_error"))
        else:
            with self._cond:
                if job.cancelled.is_set():
                    self._release(job)
                    self.requests.ended_early("cancelled")
                elif self._draining:  # the drain began while it was prepared
                    self._release(job)
                    self._refuse(job)
                else:
                    self._queue(job)
        finally:
            with self._cond:
                self._num_preparing -= 1
                self._cond.notify_all()  # an idle worker waiting to start a shadow piece looks again
