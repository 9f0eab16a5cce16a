"""One line, not a traceback, for a request cut off when the server stops.

On Ctrl-C or SIGTERM the drain (kvrelay.server.graceful) answers every request the engine worker holds; then uvicorn
waits ``timeout_graceful_shutdown`` seconds for the tasks still running (a request that never reached the worker),
logs "Cancel N running task(s), timeout graceful shutdown exceeded" and cancels them; each cancelled request is
logged as "Exception in ASGI application" with the whole CancelledError traceback through uvicorn, starlette and
fastapi, which reads like a crash. The stop was asked for; the line says what happened. A CancelledError logged
before that line (the server still serving: a bug that cancelled a request's task) keeps its traceback."""

from __future__ import annotations

import asyncio
import logging

UVICORN_ERROR_LOGGER = "uvicorn.error"
CUT_OFF_MESSAGE = "a request still running when the server stopped was cut off"
# uvicorn's record just before it cancels the requests still running at shutdown (uvicorn.server.Server.shutdown)
CANCELLING_AT_SHUTDOWN = "timeout graceful shutdown exceeded"


class CutOffRequestFilter(logging.Filter):
    """Rewrites uvicorn's record of a request cancelled at shutdown into one line without its traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False  # uvicorn said it cancels the running requests

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping and isinstance(record.msg, str) and CANCELLING_AT_SHUTDOWN in record.msg:
            self.stopping = True
        exc_type = record.exc_info[0] if record.exc_info else None
        if self.stopping and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            record.msg, record.args = CUT_OFF_MESSAGE, ()
            record.exc_info, record.exc_text = None, None
        return True


def install_cut_off_filter() -> None:
    """On uvicorn's error logger (uvicorn's log config adds handlers to it and keeps its filters)."""
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    if not any(isinstance(f, CutOffRequestFilter) for f in logger.filters):
        logger.addFilter(CutOffRequestFilter())
