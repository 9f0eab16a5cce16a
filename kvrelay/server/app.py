"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, models, health, metrics.

Handlers validate the request (pydantic), resolve the tenant namespace (API key, ``cache_salt``)
and queue a ``Job`` for the engine worker; the worker's events come back on an asyncio queue and
are turned into a JSON response or an SSE stream. A client that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.engine import Engine
from kvrelay.errors import KvRelayError
from kvrelay.reuse import PIPELINE_METHODS, get_method, role_key
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild, chat_ids, completion_ids
from kvrelay.server.protocol import (
    ROLES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    validation_message,
)
from kvrelay.server.responses import Reply, error_of, stream_error_chunk
from kvrelay.server.scheduler import EngineWorker, Job

log = logging.getLogger("kvrelay.server")
_DISCONNECT_POLL_S = 0.1


class BodyLimit:
    """413 for a request whose Content-Length is over the limit. Plain ASGI, not ``@app.middleware``:
    that wrapper hides the client's disconnect from the handlers, which must see it to cancel."""

    def __init__(self, app, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            size = dict(scope["headers"]).get(b"content-length", b"")
            if size.isdigit() and int(size) > self.max_bytes:
                self.metrics.errors.labels("413").inc()
                response = error_response(413, f"request body of {int(size)} bytes is over the limit of "
                                               f"{self.max_bytes} bytes", code="request_too_large")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class ServerSettings:
    method: str = "epic"
    api_keys: frozenset[str] = field(default_factory=frozenset)
    max_queue: int = 64
    max_running: int = 8
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (bounded by the context)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def create_app(engine: Engine, catalog: SpanCatalog, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics()
    metrics.store_budget_bytes.set(catalog.store.budget_bytes)
    worker = EngineWorker(engine, catalog, metrics, settings.max_queue, settings.max_running)
    tokenizer = engine.lm.tokenizer
    model_id = engine.lm.name

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="kvrelay", lifespan=lifespan)
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
        code = {404: "not_found", 400: "invalid_value"}.get(exc.status_code)  # 400: a body JSON cannot read
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code=code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        metrics.errors.labels("500").inc()
        return error_response(500, "internal server error", "server_error", code="internal_error")

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=metrics)

    # ------------------------------------------------------------------ helpers
    def namespace_of(request: Request, cache_salt: str | None) -> str:
        parts = []
        if settings.api_keys:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if key not in settings.api_keys:
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                               "authentication_error", code="invalid_api_key")
            parts.append("k" + _digest(key))
        if cache_salt:
            parts.append("s" + _digest(cache_salt))
        return "/".join(parts)

    def check_common(body, request: Request) -> tuple[str, str]:
        namespace = namespace_of(request, body.cache_salt)
        if body.model != model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, "n > 1 is not supported: send n separate requests", param="n", code="unsupported")
        if len(body.stop_list()) > 4:
            raise ApiError(400, "at most 4 stop sequences", param="stop", code="invalid_value")
        method = (body.kvrelay.method if body.kvrelay and body.kvrelay.method else settings.method).strip()
        try:
            name = get_method(method).name
        except KvRelayError as exc:
            raise ApiError(400, str(exc), param="kvrelay.method", code="invalid_value") from exc
        if name not in PIPELINE_METHODS:
            raise ApiError(400, f"method {name!r} cannot serve single calls; use one of {', '.join(PIPELINE_METHODS)}",
                           param="kvrelay.method", code="invalid_value")
        return namespace, method

    def make_job(body, namespace: str, method: str, build, max_tokens: int | None, default_max_tokens: int,
                 num_top_logprobs: int | None) -> tuple[Job, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: dict) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        job = Job(build, namespace, method, max_tokens, default_max_tokens, body.temperature, body.top_p,
                  secrets.randbits(63) if body.seed is None else body.seed, body.stop_list(), num_top_logprobs,
                  bool(body.kvrelay and body.kvrelay.debug), emit,
                  cache_output=not body.kvrelay or body.kvrelay.cache_output,
                  first_token_logprobs=bool(body.kvrelay and body.kvrelay.first_token_logprobs))
        return job, events

    async def next_event(request: Request, job: Job, events: asyncio.Queue) -> dict | None:
        """The job's next event, or None when the client disconnected (the job is then cancelled).

        The connection is checked every ``_DISCONNECT_POLL_S`` whether or not events keep coming, since
        a decoding job emits faster than that.
        """
        while True:
            now = time.monotonic()
            if now - job.disconnect_checked_s >= _DISCONNECT_POLL_S:
                job.disconnect_checked_s = now
                if await request.is_disconnected():
                    worker.cancel(job)
                    return None
            try:
                return await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def respond(request: Request, body, job: Job, events: asyncio.Queue, reply: Reply) -> Response:
        worker.submit(job)
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
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        namespace_of(request, None)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "kvrelay"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        metrics.requests.labels("chat").inc()
        namespace, method = check_common(body, request)
        if not body.messages:
            raise ApiError(400, "messages must hold at least one message", param="messages", code="empty_messages")
        messages = []
        for i, m in enumerate(body.messages):
            if m.role not in ROLES:
                raise ApiError(400, f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                               param=f"messages.{i}.role", code="invalid_value")
            if m.content is None and m.role != "assistant":
                raise ApiError(400, f"messages[{i}] has no content", param=f"messages.{i}.content",
                               code="invalid_value")
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": m.text()})
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        agent = request.headers.get("x-kvrelay-agent") or "sys-" + _digest(system)

        def build():
            catalog.learn_published(namespace)  # completions other replicas returned: splice them as generated
            try:
                return chat_ids(tokenizer, messages, catalog.registry, namespace), agent
            except Exception as exc:  # a template that refuses these messages (e.g. roles out of order)
                raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages",
                               code="invalid_value") from exc

        top = (body.top_logprobs or 0) if body.logprobs else None
        job, events = make_job(body, namespace, method, build, body.max_completion_tokens or body.max_tokens,
                               settings.default_max_tokens, top)
        job.role = role_key(system)
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
        return await respond(request, body, job, events, Reply(model_id, False, body.logprobs is not None))

    return app
