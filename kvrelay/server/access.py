"""Who may read the server's own pages: ``/metrics`` and the OpenAPI schema and its docs pages.

``/metrics`` sums every tenant's traffic: with API keys, a tenant that could read it would see another's request
sizes (``kvrelay_store_bytes`` moves by exactly a request's prompt + output tokens x bytes per token). So it is the
operator's page, never a tenant's:

- ``--metrics-key FILE`` set: ``/metrics`` answers ``Authorization: Bearer <that key>`` only (a Prometheus scrape
  job's ``authorization: {credentials_file: FILE}``), whether API keys are set or not;
- API keys set and no metrics key: ``/metrics`` is off (401 saying so): no tenant key opens it;
- neither: open, as a single-user server on 127.0.0.1 is.

The OpenAPI schema (``/openapi.json``) and its pages (``/docs``, ``/redoc``) carry no tenant's data, but they do
describe the server to whoever asks: with API keys they need a key (any tenant's, or the metrics key). A browser
sends no key when ``/docs`` fetches the schema, so read the schema with a client that does (``curl -H``).
"""

from __future__ import annotations

import secrets
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from kvrelay.server.key_files import read_key_lines
from kvrelay.server.protocol import ApiError

OPENAPI_URL = "/openapi.json"


class Keys(Protocol):
    """Whatever holds the keys now (``ServerSettings``): read at each request, never copied, so that a SIGHUP's
    reload (kvrelay.server.key_reload) holds from the next request on."""

    api_keys: frozenset[str]
    metrics_key: str | None


def read_metrics_key(path: str | None) -> str | None:
    """The bearer token in ``--metrics-key FILE`` (its first key line, as kvrelay.server.key_files reads it), or None
    without the flag. A file, not the key itself on the command line, where any user of the machine could read it
    in the process list."""
    return None if path is None else read_key_lines(path, "--metrics-key")[0]


def bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def _same(given: str, key: str) -> bool:
    return secrets.compare_digest(given.encode(), key.encode())


def check_metrics_access(request: Request, api_keys: frozenset[str], metrics_key: str | None) -> None:
    """Raise a 401 ``ApiError`` unless ``request`` may read ``/metrics`` (see the module's rules)."""
    if metrics_key is not None:
        if not _same(bearer(request), metrics_key):
            raise ApiError(401, "/metrics needs the metrics key (Authorization: Bearer <--metrics-key>)",
                           "authentication_error", code="invalid_api_key")
    elif api_keys:
        raise ApiError(401, "/metrics is off on a server with API keys: it sums every tenant's traffic; start the "
                            "server with --metrics-key FILE and scrape with that key", "authentication_error",
                       code="metrics_disabled")


def may_read_docs(request: Request, api_keys: frozenset[str], metrics_key: str | None) -> bool:
    """Whether ``request`` may learn what the schema says: always without API keys, else with one of them or the
    metrics key."""
    if not api_keys:
        return True
    given = bearer(request)
    return any(_same(given, key) for key in api_keys) or (metrics_key is not None and _same(given, metrics_key))


def check_docs_access(request: Request, api_keys: frozenset[str], metrics_key: str | None) -> None:
    """Raise a 401 ``ApiError`` unless ``request`` carries one of the API keys or the metrics key."""
    if not may_read_docs(request, api_keys, metrics_key):
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error",
                       code="invalid_api_key")


def docs_urls(api_keys: frozenset[str]) -> dict:
    """``FastAPI(...)`` arguments: FastAPI's own open docs routes, or none where ``add_keyed_docs`` serves them."""
    return {"docs_url": None, "redoc_url": None, "openapi_url": None} if api_keys else {}


def add_keyed_docs(app: FastAPI, keys: Keys) -> None:
    """The schema and its pages behind a key (with API keys; without, FastAPI serves them open)."""
    if not keys.api_keys:
        return

    @app.get(OPENAPI_URL, include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        check_docs_access(request, keys.api_keys, keys.metrics_key)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        check_docs_access(request, keys.api_keys, keys.metrics_key)
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        check_docs_access(request, keys.api_keys, keys.metrics_key)
        return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{app.title} - ReDoc")
