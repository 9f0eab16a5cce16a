"""The engine worker's side of a graceful shutdown: stop admitting, answer the queued requests at once, and, when the
grace is over, fail the ones still running, each with a 503 ``shutting_down``.

A request failed here is answered by its own task (a JSON body, or an error chunk then ``[DONE]`` on a stream whose
headers were sent) while uvicorn still waits for it, so it ends with an answer and an access line; a request
cancelled by uvicorn after its graceful wait ends with neither. ``EngineWorker`` mixes this in: the methods read its
queue, its lists of prefilling and running requests and its condition.
"""

from __future__ import annotations

from kvrelay.server.events import ErrorEvent
from kvrelay.server.job import Job
from kvrelay.server.protocol import SHUTTING_DOWN_CODE, shutting_down_error

__all__ = ["WorkerDrain", "shutting_down_error"]


class WorkerDrain:
    """The drain of ``EngineWorker`` (which provides ``_cond``, ``_waiting``, ``_running``, ``_prefilling``,
    ``_num_preparing``, ``_release``, ``_fail``, ``_answer_error`` and ``metrics``)."""

    _draining = False  # no request is admitted any more: new ones and queued ones get the 503
    _cut_pending = False  # the grace is over: the worker fails what is still running, between two turns

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        """Requests the worker holds: being prepared, queued, prefilling or decoding."""
        with self._cond:
            return len(self._waiting) + self._num_preparing + len(self._prefilling) + len(self._running)

    def drain(self) -> None:
        """Admit nothing more: a request submitted from now on is refused with the 503, and the queued ones (prepared,
        not started on the engine) are answered it now; the running ones go on. Idempotent."""
        with self._cond:
            self._draining = True
            queued = list(self._waiting)
            self._waiting.clear()
            self.metrics.queue_depth.set(0)
            for job in queued:  # under ``_cond``, as ``cancel`` releases a queued job's pins
                self._release(job)
                self._refuse(job)
            self._cond.notify_all()

    def cut_running(self) -> None:
        """The grace is over: the worker fails every request it still holds with the 503 at the end of its current
        turn (a paused worker too: the cut is no turn). Implies ``drain``."""
        self.drain()
        with self._cond:
            self._cut_pending = True
            self._cond.notify_all()

    def _refuse(self, job: Job) -> None:
        self._answer_error(job, ErrorEvent.of(shutting_down_error()))

    def _cut_all(self) -> None:
        """On the worker thread, between turns: every prefilling and running request fails with the 503 (its KV freed,
        nothing published)."""
        with self._cond:
            self._cut_pending = False
        err = shutting_down_error()
        for job in list(self._running) + list(self._prefilling):
            self._fail(job, err.status, err.message, SHUTTING_DOWN_CODE)
