"""How the engine worker fails one request alone, and serves a request whose method planned an inconsistent schedule.

A failure in one request's prefill, post-processing or sampling fails that request (its KV freed, its pins released,
an error event to its client); the other requests in the batch go on. ``EngineWorker`` mixes this in: the methods
read its lists of prefilling and running requests and its engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvrelay.engine.constrained import ConstraintDeadEnd
from kvrelay.errors import KvRelayError, ScheduleError
from kvrelay.model.sampling import SamplingError
from kvrelay.server.events import ErrorEvent
from kvrelay.server.job import Job
from kvrelay.server.protocol import SHUTTING_DOWN_CODE, ApiError

log = logging.getLogger("kvrelay.server")
# what a request whose method planned an inconsistent schedule is served with: exact prefix reuse, whose schedule is
# the prompt's suffix (nothing chosen as it goes)
FALLBACK_METHOD = "prefix"


def about(job: Job) -> dict:
    """A log call's ``extra`` for a line about ``job``: its request id as a field (``--log-format json``)."""
    return {"request_id": job.request_id}


class RequestFailures:
    """The failure handling of ``EngineWorker`` (which provides ``engine``, ``_prefilling``, ``_running``,
    ``_admit``, ``_release`` and ``requests``, its RequestMetrics)."""

    def _prefill_failed(self, job: Job, exc: Exception) -> None:
        """A request whose prefill failed is failed alone; one whose method planned an inconsistent schedule (the
        engine's fault, never the request's) starts over with ``FALLBACK_METHOD``."""
        if isinstance(exc, ScheduleError) and job.method != FALLBACK_METHOD:
            log.error("%s planned an inconsistent schedule (%s): request %s starts over with %s", job.method, exc,
                      job.request_id or "-", FALLBACK_METHOD, extra=about(job))
            self._prefilling.remove(job)
            job.task.cancel()
            # served by the fallback, it measures nothing of the method its role's rung chose
            job.task, job.method, job.quality = None, FALLBACK_METHOD, None
            self._admit(job)
        elif isinstance(exc, ScheduleError):
            log.error("the fallback %s planned an inconsistent schedule for request %s", FALLBACK_METHOD,
                      job.request_id or "-", exc_info=exc, extra=about(job))
            self._fail(job, 500, "internal error while starting this request", "internal_error")
        elif isinstance(exc, ApiError):
            self._fail(job, exc.status, exc.message, exc.code)
        elif isinstance(exc, ConstraintDeadEnd):  # the request's grammar allows no first token
            self._fail(job, *engine_failure(exc))
        elif isinstance(exc, KvRelayError):
            self._fail(job, 400, str(exc), "invalid_value")
        else:
            log.error("prefilling request %s failed", job.request_id or "-", exc_info=exc, extra=about(job))
            self._fail(job, 500, "internal error while starting this request", "internal_error")

    def _contained(self, job: Job, handle: Callable[[Job], None]) -> None:
        """Run one request's post-processing (text out, finish); a bug it meets fails that request alone."""
        try:
            handle(job)
        except Exception:
            log.exception("serving request %s failed", job.request_id or "-", extra=about(job))
            self._fail(job, 500, "internal error while serving this request", "internal_error")

    def _fail(self, job: Job, status: int, message: str, code: str) -> None:
        if job in self._prefilling:
            self._prefilling.remove(job)
        if job.task is not None:
            job.task.cancel()
            job.task = None
        if job in self._running:
            self._running.remove(job)
            if job.seq is not None:
                job.seq.cancel()
                self.engine.finish(job.seq).cache = None
        self._release(job)
        self._answer_error(job, ErrorEvent(status, message, None, code))

    def _answer_error(self, job: Job, event: ErrorEvent) -> None:
        """Every error the worker answers a request with goes out here: counted as how the request ended."""
        self.requests.ended_early(finish_reason_of(event))
        job.emit(event)


def finish_reason_of(event: ErrorEvent) -> str:
    """How a request the worker answered ``event`` ended (``request_metrics.FINISH_REASONS``): a 4xx was the request's
    own fault, ``shutting_down`` the server's stop, any other 5xx the server's failure."""
    if event.status < 500:
        return "rejected"
    return "shutdown" if event.code == SHUTTING_DOWN_CODE else "error"


def engine_failure_message(error: Exception) -> str:
    """What a client is told when its sequence failed in a decode step: the sampler's own words (they name no
    server internals), otherwise nothing of the exception."""
    reason = f": {error}" if isinstance(error, SamplingError) else ""
    return f"generation failed for this request{reason}; other requests were not affected"


def engine_failure(error: Exception) -> tuple[int, str, str]:
    """(status, message, code) of a request whose sequence failed in a step: a 400 when its own constraint cannot
    be completed (the request's grammar), else a 500."""
    if isinstance(error, ConstraintDeadEnd):
        return 400, str(error), "invalid_value"
    return 500, engine_failure_message(error), "internal_error"
