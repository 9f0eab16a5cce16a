"""The server's own pages: ``/health``, ``/metrics`` (the operator's: kvrelay.server.access) and ``/v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvrelay.server.access import check_metrics_access
from kvrelay.server.context import AppContext


def service_router(ctx: AppContext) -> APIRouter:
    router = APIRouter()
    settings = ctx.settings

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": ctx.model_id, "method": settings.method, "running": ctx.worker.num_running}

    @router.get("/metrics")
    async def prometheus(request: Request) -> Response:
        check_metrics_access(request, settings.api_keys, settings.metrics_key)  # every tenant's sums: the operator's
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models(request: Request) -> dict:
        ctx.namespace_of(request, None)
        return {"object": "list",
                "data": [{"id": ctx.model_id, "object": "model", "created": 0, "owned_by": "kvrelay"}]}

    return router
