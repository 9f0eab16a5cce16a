"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, models, health, metrics.

Handlers validate the request (pydantic), resolve the tenant namespace (API key, ``cache_salt``)
and queue a ``Job`` for the engine worker; the worker's events come back on an asyncio queue and
are turned into a JSON response or an SSE stream. A client that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.engine import Engine
from kvrelay.errors import ConfigError
from kvrelay.server.access import add_keyed_docs, check_metrics_access, docs_urls
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.chat_route import queue_chat
from kvrelay.server.context import AppContext
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.openai_responses import responses_router
from kvrelay.server.prompting import PromptBuild, completion_ids
from kvrelay.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    validation_message,
)
from kvrelay.server.responses import Reply, error_of, stream_error_chunk
from kvrelay.server.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS, EngineWorker, Job

log = logging.getLogger("kvrelay.server")


class BodyTooLarge(StarletteHTTPException):
    """The body passed the limit while it arrived (the app's HTTP error handler answers it: a 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body of more than {max_bytes} bytes is over the limit of {max_bytes} bytes")


class BodyLimit:
    """413 for a request body over the limit: at once from its Content-Length, else (a chunked body, or one whose
    length was not given) as soon as the bytes received pass the limit, without reading the rest. Plain ASGI,
    not ``@app.middleware``: that wrapper hides the client's disconnect from the handlers, which must see it to
    cancel."""

    def __init__(self, app, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = dict(scope["headers"]).get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_bytes:
            self.metrics.errors.labels("413").inc()
            response = error_response(413, f"request body of {int(size)} bytes is over the limit of "
                                           f"{self.max_bytes} bytes", code="request_too_large")
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

        await self.app(scope, counted_receive, send)


@dataclass
class ServerSettings:
    method: str = "epic"
    api_keys: frozenset[str] = field(default_factory=frozenset)
    metrics_key: str | None = None  # the bearer token /metrics needs (``server.access``)
    max_queue: int = 64
    max_running: int = 8
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (bounded by the context)
    # prompt tokens prefilled per turn between two decode steps of the running batch (chunked prefill): a long
    # prompt delays each running stream's next token by one such piece at most
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.prefill_chunk_tokens, int) or self.prefill_chunk_tokens < 1:
            raise ConfigError(f"--prefill-chunk-tokens must be an integer >= 1, got {self.prefill_chunk_tokens!r}")


def create_app(engine: Engine, catalog: SpanCatalog, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics()
    metrics.store_budget_bytes.set(catalog.store.budget_bytes)
    worker = EngineWorker(engine, catalog, metrics, settings.max_queue, settings.max_running,
                          settings.prefill_chunk_tokens)
    tokenizer = engine.lm.tokenizer
    model_id = engine.lm.name

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="kvrelay", lifespan=lifespan, **docs_urls(settings.api_keys))
    add_keyed_docs(app, settings.api_keys, settings.metrics_key)  # with API keys, the docs need one
    app.state.worker, app.state.catalog, app.state.metrics = worker, catalog, metrics

    # ------------------------------------------------------------------ errors: OpenAI's JSON, never a traceback
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels("400").inc()
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.errors.labels(str(exc.status_code)).inc()
        # 400: a body JSON cannot read; 413: a body that passed the limit while it arrived (BodyLimit)
        code = {404: "not_found", 400: "invalid_value", 413: "request_too_large"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code=code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        metrics.errors.labels("500").inc()
        return error_response(500, "internal server error", "server_error", code="internal_error")

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=metrics)

    # ------------------------------------------------------------------ helpers
    ctx = AppContext(worker, catalog, metrics, settings, tokenizer, model_id)
    app.state.context = ctx
    app.include_router(responses_router(ctx))  # POST /v1/responses, GET/DELETE of stored responses
    namespace_of, check_common, make_job, next_event = ctx.namespace_of, ctx.check_common, ctx.make_job, \
        ctx.next_event

    async def respond(request: Request, body, job: Job, events: asyncio.Queue, reply: Reply) -> Response:
        """The submitted ``job``'s answer: one JSON body, or an SSE stream."""
        first = await next_event(request, job, events)
        if first is None:
            return Response(status_code=499)
        if first["type"] == "error":
            raise error_of(first)
        if not body.stream:
            deltas = [first]
            event = first
            while event["type"] == "delta":
                event = await next_event(request, job, events)
                if event is None:
                    return Response(status_code=499)
                deltas.append(event)
            if event["type"] == "error":
                raise error_of(event)
            return JSONResponse(reply.full(deltas[:-1], event))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def sse() -> AsyncIterator[str]:
            finished = False
            try:
                head = reply.first_chunk()
                if head:
                    yield head
                event = first
                while True:
                    if event["type"] == "delta":
                        yield reply.delta_chunk(event)
                    elif event["type"] == "done":
                        for chunk in reply.final_chunks(event, include_usage):
                            yield chunk
                        finished = True
                        return
                    else:
                        finished = True
                        yield stream_error_chunk(error_of(event))
                        return
                    event = await events.get()
            finally:
                if not finished:  # the client went away mid-stream: stop decoding, free its KV
                    worker.cancel(job)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_id, "method": settings.method, "running": worker.num_running}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        check_metrics_access(request, settings.api_keys, settings.metrics_key)  # every tenant's sums: the operator's
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        namespace_of(request, None)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "kvrelay"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        metrics.requests.labels("chat").inc()
        queued = await queue_chat(body, request, ctx)
        job, events = queued.job, queued.events
        return await respond(request, body, job, events, Reply(model_id, True, body.logprobs))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        metrics.requests.labels("completions").inc()
        namespace, method = check_common(body, request)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "a list of several prompts is not supported: send one request each",
                               param="prompt", code="unsupported")
            prompt = prompt[0]
        if isinstance(prompt, list):
            vocab = tokenizer.vocab_size
            if not prompt or any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(400, f"token-id prompts must be non-empty with ids in [0, {vocab})", param="prompt",
                               code="invalid_value")
        elif not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo", code="unsupported")
        agent = request.headers.get("x-kvrelay-agent") or "completion"

        def build():
            catalog.learn_published(namespace)  # spans and completions other replicas published to the tier
            if isinstance(prompt, list):
                return PromptBuild(list(prompt), []), agent
            return completion_ids(tokenizer, prompt, catalog.registry, namespace), agent

        job, events = make_job(body, namespace, method, build, body.max_tokens, 16, body.logprobs)
        worker.submit(job)
        return await respond(request, body, job, events, Reply(model_id, False, body.logprobs is not None))

    return app
