"""The connector's saves, off vLLM's engine step.

In the step after a request finishes (vLLM still holds its blocks: ``request_finished`` returned True), the
blocks holding its K/V are copied whole out of vLLM's paged cache (a memory copy per layer), and the request is
reported done (``get_finished``) only after that copy, so vLLM frees and reuses the blocks no sooner. The rest
runs in one background thread, so the next request's step does not wait for it: the K/V by position out of the
copy (the keys are transposed in a block), stored in memory and indexed (a load in this process may then read
it), then the shared tier's serialization, write and announcement, outside every lock the scheduler takes. The
queue is bounded: when the thread falls that far behind, the step waits for room (the copies' memory stays
bounded) instead of dropping saves.

A load that plans to read a span still being stored waits for that span only (``wait_stored``), until it is in
memory here (not for the shared tier's write); a span whose store failed is then missing, and the load computes
its tokens like a gap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from kvrelay.vllm.paged import PagedKV
from kvrelay.vllm.worker import SaveJob, WorkerSide

log = logging.getLogger("kvrelay.vllm")

DEFAULT_MAX_QUEUED = 32


@dataclass
class _CopiedSave:
    """A save whose blocks have been copied out of the paged cache."""

    job: SaveJob
    copy: PagedKV
    copy_ms: float


class BackgroundSaver:
    """Copies saves' blocks in the caller's thread, stores them in its own; ``take_read`` says whose blocks are
    free."""

    def __init__(self, worker: WorkerSide, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.worker = worker
        self._queue: queue.Queue[_CopiedSave | None] = queue.Queue(maxsize=max_queued)
        self._lock = threading.Lock()
        self._read_req_ids: set[str] = set()
        self._storing: dict[tuple[str, str], threading.Event] = {}  # (namespace, span id) -> set once stored
        self._thread = threading.Thread(target=self._run, name="kvrelay-saver", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        """Copy ``job``'s blocks out of the paged cache now and queue its store. Its request is reported read (its
        blocks free to reuse) even when the copy fails: vLLM must get its blocks back either way."""
        t0 = time.perf_counter()
        try:
            copy = self.worker.copy_blocks(job)
        except Exception:  # noqa: BLE001 - the span is not stored; the request and its blocks go on
            log.exception("kvrelay connector: request %s's KV could not be copied; not stored", job.req_id)
            self.worker.refused(job)
            with self._lock:
                self._read_req_ids.add(job.req_id)
            return
        copy_ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._read_req_ids.add(job.req_id)
            self._storing[(job.namespace, job.span_id)] = threading.Event()
        self._queue.put(_CopiedSave(job, copy, copy_ms))

    def take_read(self) -> set[str]:
        """Requests whose blocks have been copied since the last call (``get_finished``'s finished sending)."""
        with self._lock:
            read, self._read_req_ids = self._read_req_ids, set()
        return read

    def wait_stored(self, namespace: str, span_id: str) -> None:
        """Return once ``span_id`` is stored or refused (at once when it is not being stored)."""
        with self._lock:
            event = self._storing.get((namespace, span_id))
        if event is not None:
            event.wait()

    def close(self) -> None:
        """Store what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job = item.job
            try:
                t0 = time.perf_counter()
                if self.worker.store(job, *self.worker.read_copy(item.copy, job)):
                    log.info("kvrelay connector: request %s: %d tokens' blocks copied in %.1f ms (in the step), "
                             "stored in %.1f ms (in the background)", job.req_id, len(job.token_ids),
                             item.copy_ms, (time.perf_counter() - t0) * 1e3)
            except Exception:  # noqa: BLE001 - one span lost; the thread goes on with the others
                log.exception("kvrelay connector: request %s's KV not stored", job.req_id)
                self.worker.refused(job)
            finally:
                with self._lock:
                    event = self._storing.pop((job.namespace, job.span_id), None)
                if event is not None:
                    event.set()
            try:  # after the span is readable here: a load waits for the memory copy, never for the shared tier
                self.worker.hub.write_tier()
            except Exception:  # noqa: BLE001 - the tier keeps what it could not write for later
                log.exception("kvrelay connector: request %s's KV not written to the shared tier", job.req_id)
