"""One id per HTTP request, sent back as ``x-request-id`` (as OpenAI's API does; the openai client shows it as
``response._request_id`` and an error's ``request_id``) and written in the server's log lines about that request,
so an operator can find a user's failed call in the logs by the id the user quotes.

The id is the server's own: ``req_`` and 32 random hex digits, never a counter (a tenant reading its ids must learn
nothing of how many requests other tenants sent). A client's ``x-request-id`` (a proxy's trace id, say) is not
taken as the id: two requests could then share one, and a client could plant any text in the log. It is written in
the access line beside the server's id when it is short and plain (``CLIENT_ID_PATTERN``); otherwise it is dropped.

Pure ASGI, as ``BodyLimit``: ``@app.middleware`` would hide the client's disconnect from the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:  # json_logs imports this module, and the command line's parsers import json_logs: no web stack
    from kvrelay.server.metrics import ServerMetrics

REQUEST_ID_HEADER = "x-request-id"
_STATE_KEY = "request_id"  # under the ASGI scope's "state": ``request.state.request_id`` in a handler
_CUT_KEY = "answer_cut"  # under the scope's "state": the error status a stream ended with after its 200 (``mark_cut``)
CLIENT_ID_PATTERN = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
NUM_ID_HEX_DIGITS = 32

access_log = logging.getLogger("kvrelay.server.access")
# the id of the request the running task serves ("" outside one): a ``Job`` made in the request's task keeps it, so
# the engine worker's lines about that job can name it
_current_id: contextvars.ContextVar[str] = contextvars.ContextVar("kvrelay_request_id", default="")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(NUM_ID_HEX_DIGITS // 2)


def current_request_id() -> str:
    """The id of the HTTP request this task serves, or "" outside one."""
    return _current_id.get()


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged inside name ``request_id``: the engine thread works for many requests in turn, and what it logs
    for one (a bad tier record its lookup met, a failure) names that one."""
    token = _current_id.set(request_id)
    try:
        yield
    finally:
        _current_id.reset(token)


def request_id_of(scope: dict) -> str:
    """The id ``RequestIds`` gave the request of ``scope`` ("" if it gave none)."""
    return scope.get("state", {}).get(_STATE_KEY, "")


def mark_cut(scope: dict, error_status: int) -> None:
    """The app ended the request's answer short after its status was sent (a stream's error chunk, carrying
    ``error_status``): its access line says ``cut``, though the response itself ended in order, and the error
    counter counts it by ``error_status``."""
    scope.setdefault("state", {})[_CUT_KEY] = error_status


def loggable_path(scope: dict) -> str:
    """The request's path as a log line may hold it: percent-encoded again, as uvicorn's access log writes it, since
    the path arrives decoded (a client's ``%0A`` would otherwise start a forged line in the log)."""
    return quote(scope.get("root_path", "") + scope["path"])


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's own ``x-request-id`` when it is short and plain enough to log, else None."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            return text if CLIENT_ID_PATTERN.fullmatch(text) else None
    return None


class RequestIds:
    """Gives each HTTP request a new id: in the scope's state (``request_id_of``), in the task's context
    (``current_request_id``), on the response's headers, and in one access line (INFO, ``kvrelay.server.access``)
    when the request ends. With ``metrics``, counts each request on arrival and, when it ends, its error status:
    both counters see every request the app gets, whichever part of it answered."""

    def __init__(self, app, metrics: ServerMetrics | None = None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.metrics.request_received(scope["path"]) if self.metrics is not None else ""
        request_id = new_request_id()
        scope.setdefault("state", {})[_STATE_KEY] = request_id
        token = _current_id.set(request_id)
        access = _AccessLine(scope, request_id)

        async def receive_noting_a_leave() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect":  # after the answer ended: no change, its line is out
                access.client_left = True
            return message

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                access.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                access.ended = True
                access.write()  # before the last bytes go out: a client holding its answer finds the line written
            await send(message)

        try:
            await self.app(scope, receive_noting_a_leave, send_with_id)
        except Exception:
            # the app's 500 handler (kvrelay.server.http_errors) answers outside this middleware, after this line
            access.write(500)
            raise
        except asyncio.CancelledError:
            # only uvicorn's shutdown cancels a request's task (after kvrelay.server.graceful's drain and flush: a
            # request that never reached the worker, say a grammar still compiling): a 503 with its id, not
            # uvicorn's plain-text 500 (a stream already begun can only be cut)
            if access.status is None:
                from kvrelay.server.protocol import shutting_down_error

                await shutting_down_error().response()(scope, receive, send_with_id)
            raise
        finally:
            _current_id.reset(token)
            access.write()  # an answer cut off: its client left, or the app was cancelled (``cut`` on the line)
            if self.metrics is not None and access.error_status is not None:
                self.metrics.request_failed(endpoint, access.error_status)


#: written after the status of an answer the client never got to its end (see ``_AccessLine.cut``)
CUT_MARKER = "cut"


class _AccessLine:
    """One request's access line, written once: its id, method, path, status (``CUT_MARKER`` after it when the
    answer was cut off) and time until its answer ended."""

    def __init__(self, scope: dict, request_id: str) -> None:
        self.scope, self.request_id = scope, request_id
        self.started_s = time.perf_counter()
        self.status: int | None = None
        self.ended = False  # the answer's last body message was sent
        self.client_left = False  # an ``http.disconnect`` came before that message
        self.written = False
        self.final_status: int | None = None  # what the line says (set when it is written)

    @property
    def error_status(self) -> int | None:
        """The status the request's error carried: a stream's error chunk's, else the answer's own."""
        return self.scope.get("state", {}).get(_CUT_KEY) or self.final_status

    @property
    def cut(self) -> bool:
        """The client did not get the whole answer: it left first (the server sends nothing after that), the answer
        began and never ended (the app stopped mid-stream: cancelled, or failed after its status), or the app ended
        it with an error after its status (``mark_cut``: a stream's error chunk)."""
        return self.client_left or (self.status is not None and not self.ended) \
            or bool(self.scope.get("state", {}).get(_CUT_KEY))

    def write(self, status_if_none: int | None = None) -> None:
        if self.written:
            return
        self.written = True
        code = self.final_status = self.status or status_if_none
        if access_log.isEnabledFor(logging.INFO):
            status = f"{code or '-'}{' ' + CUT_MARKER if self.cut else ''}"
            client = client_request_id(self.scope["headers"])
            path, duration_ms = loggable_path(self.scope), (time.perf_counter() - self.started_s) * 1e3
            # the same facts as fields, for a structured handler (--log-format json writes them as ``http``)
            http = {"method": self.scope["method"], "path": path, "status": code, "cut": self.cut,
                    "duration_ms": round(duration_ms, 1)}
            if client:
                http["client_request_id"] = client
            access_log.info("%s %s %s %s %.1f ms%s", self.request_id, self.scope["method"], path, status, duration_ms,
                            f" client_request_id={client}" if client else "",
                            extra={"request_id": self.request_id, "http": http})
