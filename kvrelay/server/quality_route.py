"""``GET /v1/kvrelay/quality``: the quality guard's view of the caller's own roles.

The caller's namespace is resolved as for a completion (its API key, and a ``cache_salt`` query parameter when its
requests send one), and only that namespace's snapshot is returned: a tenant never sees another tenant's roles,
rungs or estimates. With the guard off the answer says so (``enabled`` false) rather than 404, so a client can tell
a server without a guard from a wrong URL.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kvrelay.server.context import AppContext
from kvrelay.server.protocol import MAX_SALT_CHARS, ApiError


def quality_router(ctx: AppContext) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/kvrelay/quality")
    async def quality(request: Request, cache_salt: str | None = None) -> dict:
        if cache_salt is not None and not cache_salt.strip():
            raise ApiError(400, "cache_salt must not be empty", param="cache_salt", code="invalid_value")
        if cache_salt is not None and len(cache_salt) > MAX_SALT_CHARS:  # no request's salt can be longer
            raise ApiError(400, f"cache_salt has {len(cache_salt)} characters, over {MAX_SALT_CHARS}",
                           param="cache_salt", code="invalid_value")
        namespace = ctx.namespace_of(request, cache_salt)
        served = ctx.worker.quality
        if served is None:
            return {"object": "kvrelay.quality", "enabled": False}
        snapshot = await asyncio.to_thread(served.snapshot, namespace)  # the guard's lock: off the event loop
        return {"object": "kvrelay.quality", "enabled": True, **snapshot}

    return router
