"""The server's own pages: ``/health``, ``/metrics`` (the operator's: kvrelay.server.access), ``/v1/models`` and
``/v1/models/{id}``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvrelay.server.access import check_metrics_access
from kvrelay.server.context import AppContext
from kvrelay.server.protocol import ApiError
from kvrelay.server.tier_metrics import tier_state


def service_router(ctx: AppContext) -> APIRouter:
    router = APIRouter()
    settings = ctx.settings

    @router.get("/health")
    async def health() -> JSONResponse:
        # with the quality guard on, a request that names no method runs at its agent's rung, not ``--method``
        guarded = settings.quality is not None and settings.quality.target is not None
        # a 503 unless the engine worker serves: a load balancer then sends no request that would wait for ever
        # (its thread died) or be cut off (the server is shutting down). A shared tier that is down is no reason:
        # the replica serves from memory; ``tier`` says so (kvrelay.server.tier_metrics)
        state = ctx.worker.state
        return JSONResponse({"status": "ok" if state == "running" else state, "model": ctx.model_id,
                             "method": None if guarded else settings.method, "quality_guard": guarded,
                             "running": ctx.worker.num_running, "prefilling": ctx.worker.num_prefilling,
                             "waiting": ctx.worker.num_waiting, "tier": tier_state(ctx.catalog.store)},
                            status_code=200 if state == "running" else 503)

    @router.get("/metrics")
    async def prometheus(request: Request) -> Response:
        check_metrics_access(request, settings.api_keys, settings.metrics_key)  # every tenant's sums: the operator's
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": ctx.model_id, "object": "model", "created": 0, "owned_by": "kvrelay"}

    @router.get("/v1/models")
    async def models(request: Request) -> dict:
        ctx.namespace_of(request, None)
        return {"object": "list", "data": [model_card()]}

    # the openai client's models.retrieve(); ":path": a model named by its file path holds slashes
    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        ctx.namespace_of(request, None)
        if model_id != ctx.model_id:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {ctx.model_id!r}",
                           param="model", code="model_not_found")
        return model_card()

    return router
