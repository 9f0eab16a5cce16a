"""SIGTERM or SIGINT on ``kvrelay serve``: drain the engine worker, then uvicorn's own shutdown.

uvicorn's ``Server.shutdown`` closes the listeners, waits ``timeout_graceful_shutdown`` for the connections, cancels
the request tasks still running, and only then runs the lifespan shutdown. A request cancelled there gets uvicorn's
plain-text 500 (or, on a stream, the connection closes with no last chunk) and no access line of its own status.
``GracefulServer`` drains first, so that every request ends with an answer written by its own task:

1. the worker admits nothing more: a new generation request is a 503 ``shutting_down`` and the queued ones (not
   started on the engine) are answered it at once. The listener stays open while the drain lasts, so a load
   balancer's probe reads ``/health``'s 503 (``stopping``) rather than a refused connection;
2. the running requests get up to ``--shutdown-grace-s`` to finish; the drain ends as soon as none is left;
3. the worker fails those still running at the grace's end with the 503 (on a stream whose headers were sent: an
   error chunk, then ``[DONE]``), and their tasks write it;
4. uvicorn's shutdown: the listeners close (a new connection is refused from here), open connections are told to
   close, the tasks get ``FLUSH_S`` to write what the drain decided, and the lifespan stops the worker.

A second Ctrl-C ends the wait of step 2 at once, and the shutdown goes on as above (the lifespan still stops the
worker); a third is uvicorn's ``force_exit``, which skips waiting for connections and the lifespan's shutdown.

SIGHUP is no shutdown (its default action killed the process at once, streams cut without a last chunk): it runs
``on_hangup`` on the event loop, ``kvrelay serve``'s key reload (kvrelay.server.key_reload).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import FrameType

import uvicorn

from kvrelay.server.worker_drain import WorkerDrain

log = logging.getLogger("kvrelay.server")

#: how often the drain looks whether the running requests have finished (uvicorn's own shutdown polls as often)
DRAIN_POLL_S = 0.1
#: what uvicorn's wait is set to once the drain is over: every request has its answer decided by then, and its task
#: only writes it (a client too slow to read its last bytes in this time is cut)
FLUSH_S = 2


async def drain_worker(worker: WorkerDrain, grace_s: float, forced: Callable[[], bool] = lambda: False,
                       clock: Callable[[], float] = time.monotonic, poll_s: float = DRAIN_POLL_S) -> int:
    """Steps 1-3 above on ``worker``: refuse and answer the queued at once, wait up to ``grace_s`` (``clock``'s
    seconds) for the running requests, then have the worker fail the rest and wait (up to ``FLUSH_S``) until it
    did. The number of requests cut at the grace's end."""
    deadline_s = clock() + grace_s
    worker.drain()
    num_running = worker.num_in_flight
    if num_running:  # at WARNING: at the default log level, a drain is one line when it starts and one when it ends
        log.warning("shutting down: %d running request(s) get up to %g s to finish", num_running, grace_s)
    else:
        log.warning("shutting down: no request running")
    started_s = clock()
    while worker.num_in_flight and clock() < deadline_s and not forced():
        await asyncio.sleep(poll_s)
    num_cut = worker.num_in_flight
    if not num_cut:
        if num_running:
            log.warning("shutting down: the %d running request(s) finished in %.1f s", num_running,
                        clock() - started_s)
        return 0
    why = f"after the {grace_s:g} s grace" if clock() >= deadline_s else "when a second Ctrl-C ended the grace"
    log.warning("shutting down: %d request(s) still running %s are answered 503 shutting_down", num_cut, why)
    worker.cut_running()
    flush_deadline_s = clock() + FLUSH_S  # a worker whose thread died never cuts: uvicorn then cancels the tasks
    while worker.num_in_flight and clock() < flush_deadline_s:
        await asyncio.sleep(poll_s)
    return num_cut


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown drains the engine worker first (the module's steps)."""

    def __init__(self, config: uvicorn.Config, worker: WorkerDrain, grace_s: float,
                 on_hangup: Callable[[], object] | None = None) -> None:
        super().__init__(config)
        self.worker, self.grace_s, self.on_hangup = worker, grace_s, on_hangup
        self.draining = False
        self.grace_ended = False  # a second Ctrl-C came while the drain waited

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's, but for the first Ctrl-C during the drain: it ends the grace, not the orderly shutdown (uvicorn
        would set ``force_exit``, skip the lifespan's shutdown and log the lifespan's cancellation as an ERROR)."""
        if self.draining and sig == signal.SIGINT and not self.grace_ended:
            self.grace_ended = True
            return
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's (SIGINT, SIGTERM), and SIGHUP: ``on_hangup`` on the event loop (a signal handler only schedules
        it: the handler runs between any two bytecodes of the loop, where writing a log line could re-enter the
        stream being written). Signals reach the main thread only: elsewhere (a test's server thread) none is set."""
        with super().capture_signals():
            hangup = getattr(signal, "SIGHUP", None)
            if hangup is None or threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            previous = signal.signal(hangup, lambda _sig, _frame: loop.call_soon_threadsafe(self.hangup))
            try:
                yield
            finally:
                signal.signal(hangup, previous)

    def hangup(self) -> None:
        """SIGHUP's action: ``on_hangup``, or a line saying it does nothing here."""
        if self.on_hangup is not None:
            self.on_hangup()
        else:
            log.warning("SIGHUP: nothing to reload; the server goes on")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.draining = True
        await drain_worker(self.worker, self.grace_s, forced=lambda: self.grace_ended or self.force_exit)
        await super().shutdown(sockets)


def graceful_server(app, on_hangup: Callable[[], object] | None = None, **config: object) -> GracefulServer:
    """A ``GracefulServer`` for a ``create_app`` app: its worker, its settings' grace; ``on_hangup``: SIGHUP's action;
    ``config``: uvicorn.Config's other arguments (host, port, log_level, http, ...)."""
    uv_config = uvicorn.Config(app, timeout_graceful_shutdown=FLUSH_S, **config)
    return GracefulServer(uv_config, app.state.worker, app.state.context.settings.shutdown.shutdown_grace_s,
                          on_hangup)
