"""Every failure answered as OpenAI's error JSON, never a traceback: the app's exception handlers, and the body
limit (a 413 before the handler reads a body that is too large; a client's large bodies held to its budget,
``server.body_rate``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.server.access import Keys, may_read_docs
from kvrelay.server.body_rate import BodyRate, client_key
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.protocol import ApiError, error_response, validation_message
from kvrelay.server.request_ids import REQUEST_ID_HEADER, loggable_path, request_id_of

log = logging.getLogger("kvrelay.server")


class BodyTooLarge(StarletteHTTPException):
    """The body passed the limit while it arrived (the app's HTTP error handler answers it: a 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is over the limit of {max_bytes} bytes (it was cut off once past it)")


class BodyLimit:
    """413 for a request body over the limit: at once from its Content-Length, else (a chunked body, or one whose
    length was not given) as soon as the bytes received pass the limit, without reading the rest. A large body
    waits, unread, for its client's budget (``rate``), or is a 429 when the wait would be too long. Plain ASGI,
    not ``@app.middleware``: that wrapper hides the client's disconnect from the handlers, which must see it to
    cancel."""

    def __init__(self, app, max_bytes: int, metrics: ServerMetrics, rate: BodyRate | None = None,
                 keys: Keys | None = None) -> None:
        self.app, self.max_bytes, self.metrics, self.keys = app, max_bytes, metrics, keys
        self.rate = rate if rate is not None else BodyRate(max_bytes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        size = headers.get(b"content-length", b"")
        chunked = not size.isdigit() and b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if size.isdigit() and int(size) > self.max_bytes:
            response = error_response(413, f"request body of {int(size)} bytes is over the limit of "
                                           f"{self.max_bytes} bytes", code="request_too_large")
            await response(scope, receive, send)
            return
        client = client_key(scope, self.keys.api_keys if self.keys is not None else frozenset())
        wait_s = await self.rate.wait_turn(client, int(size)) if size.isdigit() else 0
        if chunked:  # its size is not known: it waits while its client's budget is below zero
            wait_s = await self.rate.wait_turn(client, None)
        if wait_s:
            described = f"of {int(size)} bytes" if size.isdigit() else "of unknown length"
            response = error_response(429, f"request body {described}: this client sends large bodies "
                                           f"faster than {self.max_bytes} bytes a second; retry in {wait_s} s",
                                      "rate_limit_error", code="rate_limit_exceeded",
                                      headers={"Retry-After": str(wait_s)})
            await response(scope, receive, send)
            return
        num_bytes = 0

        async def counted_receive() -> dict:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, counted_receive, send)
        finally:
            if chunked:  # a body of unknown length is charged once it has arrived
                self.rate.charge(client, num_bytes)


def add_error_handlers(app: FastAPI, metrics: ServerMetrics, keys: Keys | None = None) -> None:
    """ApiError, pydantic's 422 (a 400 here, as OpenAI answers), Starlette's HTTP errors and anything unexpected
    (a 500 that names no internals); kvrelay.server.request_ids counts each by its status. A 404/405 lists the served
    routes to whoever may read the schema (``kvrelay.server.access.may_read_docs``: with API keys, a caller with
    one)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 400: a body JSON cannot read; 413: a body that passed the limit while it arrived (BodyLimit)
        code = {404: "not_found", 405: "method_not_allowed", 400: "invalid_value",
                413: "request_too_large"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # the router's: a client calling an API this server lacks learns that
            message = f"{request.method} {request.url.path}: {message.lower()}"
        shown = keys is None or may_read_docs(request, keys.api_keys, keys.metrics_key)
        if exc.status_code in (404, 405) and shown:  # and what is served
            served = sorted(f"{method.upper()} {path}" for path, methods in app.openapi()["paths"].items()
                            if path.startswith("/v1/") for method in methods)  # the schema is built once
            message = f"{message}; this server serves {', '.join(served)}"
        return error_response(exc.status_code, message, "invalid_request_error", code=code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # answered outside RequestIds (Starlette's outermost middleware calls this), so the id is set here too
        request_id = request_id_of(request.scope)
        log.exception("unexpected error in request %s (%s %s)", request_id or "-", request.method,
                      loggable_path(request.scope), exc_info=exc, extra={"request_id": request_id})
        return error_response(500, "internal server error", "server_error", code="internal_error",
                              headers={REQUEST_ID_HEADER: request_id} if request_id else None)
