"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, Responses, models, health, metrics.

Handlers validate the request (pydantic), resolve the tenant namespace (API key, ``cache_salt``)
and queue a ``Job`` for the engine worker; the worker's events come back on an asyncio queue and
are turned into a JSON response or an SSE stream (kvrelay.server.respond). A client that disconnects
cancels its job. Each topic's routes live in a router of their own; ``create_app`` wires them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from kvrelay.engine import Engine
from kvrelay.errors import ConfigError
from kvrelay.quality.ladder import ladder_text
from kvrelay.server.access import add_keyed_docs, docs_urls
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.chat_route import chat_router
from kvrelay.server.completions_route import completions_router
from kvrelay.server.context import AppContext
from kvrelay.server.http_errors import BodyLimit, add_error_handlers
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.openai_responses import responses_router
from kvrelay.server.quality_setup import install_quality
from kvrelay.server.request_ids import RequestIds
from kvrelay.server.scheduler import EngineWorker
from kvrelay.server.serve_config import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_CHUNK_TOKENS, ShutdownConfig
from kvrelay.server.service_routes import service_router
from kvrelay.server.shared_responses import response_store_for
from kvrelay.server.tier_metrics import tier_of
from kvrelay.tier.writer import TierWriter

log = logging.getLogger("kvrelay.server")
# at shutdown, the spans still owed to the shared tier get this long to be written (after the requests' drain,
# whose default grace is 25 s: inside Kubernetes' default 30 s)
WRITER_STOP_S = 3.0


@dataclass
class ServerSettings:
    method: str = "epic"
    api_keys: frozenset[str] = field(default_factory=frozenset)
    metrics_key: str | None = None  # the bearer token /metrics needs (``server.access``)
    max_queue: int = 64
    max_running: int = 8
    max_body_bytes: int = 8 << 20
    # chat and Responses requests without max_tokens / max_output_tokens get this many at most (and no more than
    # the context leaves): a bound on how long one request holds a slot of a shared server's decode batch
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    # chunked prefill: a turn's prefill between two decode steps of the running batch costs what this many tokens
    # cost at the start of a prompt (``server.chunk_budget``): a long prompt delays each running stream by one piece
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    # the quality guard (a kvrelay.quality.QualityConfig; None: off, every request runs ``method``); ``kvrelay
    # serve`` turns it on by default
    quality: Any = None
    # SIGTERM / SIGINT: how long running requests get to finish (kvrelay.server.graceful serves it)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.default_max_tokens, int) or isinstance(self.default_max_tokens, bool) \
                or self.default_max_tokens < 1:
            raise ConfigError(f"--default-max-tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if not isinstance(self.prefill_chunk_tokens, int) or self.prefill_chunk_tokens < 1:
            raise ConfigError(f"--prefill-chunk-tokens must be an integer >= 1, got {self.prefill_chunk_tokens!r}")


def create_app(engine: Engine, catalog: SpanCatalog, settings: ServerSettings) -> FastAPI:
    """The app: one engine worker behind the OpenAI routes, its shared objects on ``app.state``."""
    metrics = ServerMetrics()
    metrics.store_budget_bytes.set(catalog.store.budget_bytes)
    metrics.tier.watch(catalog.store)
    worker = EngineWorker(engine, catalog, metrics, settings.max_queue, settings.max_running,
                          settings.prefill_chunk_tokens)
    ctx = AppContext(worker, catalog, metrics, settings, engine.lm.tokenizer, engine.lm.name)

    tier = tier_of(catalog.store)
    writer = TierWriter(tier) if tier is not None else None  # the engine thread never waits on the shared tier

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if writer is not None:
            writer.start()
        worker.start()
        try:
            yield
        finally:
            worker.stop()
            ctx.compiles.shutdown()
            if writer is not None and not writer.stop(WRITER_STOP_S):
                log.warning("stopped with %d spans not written to the shared tier (it was slow or down): the other "
                            "replicas recompute them", tier.num_unwritten)

    app = FastAPI(title="kvrelay", lifespan=lifespan, **docs_urls(settings.api_keys))
    app.state.worker, app.state.catalog, app.state.metrics, app.state.context = worker, catalog, metrics, ctx
    # the keys are read from ``settings`` at each request: a SIGHUP's reload (kvrelay.server.key_reload) holds at once
    add_keyed_docs(app, settings)  # with API keys, the docs need one
    add_error_handlers(app, metrics, settings)  # OpenAI's error JSON, no traceback
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=metrics, keys=settings)
    app.add_middleware(RequestIds, metrics=metrics)  # added last: outside BodyLimit, so its 413s and 429s count too
    app.include_router(service_router(ctx))  # /health, /metrics, /v1/models
    app.include_router(chat_router(ctx))  # POST /v1/chat/completions
    app.include_router(completions_router(ctx))  # POST /v1/completions
    # POST /v1/responses, GET/DELETE of stored responses (the replicas' own when the KV store is a shared tier)
    app.state.responses = response_store_for(catalog.store)
    app.include_router(responses_router(ctx, app.state.responses))
    install_quality(app, ctx, engine, settings.quality)  # GET /v1/kvrelay/quality; the guard, its shadows, metrics
    guard = getattr(app.state, "quality", None)  # the ladder it serves: the rungs this model can run
    ladder = ladder_text(guard.guard.config.ladder) if guard is not None else None
    metrics.describe(ctx.model_id, settings.method if guard is None else None, ladder)  # kvrelay_build_info
    return app
