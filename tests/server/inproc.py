"""The server's ASGI app in this process (random:tiny, a memory store): for tests that plant faults in the engine
or send many bodies fast. Run it inside ``starlette.testclient.TestClient`` (its lifespan starts the worker)."""

from __future__ import annotations

from fastapi import FastAPI

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.weights.loader import load_model

MODEL = "random:tiny"


def make_app(**settings) -> FastAPI:
    lm = load_model(MODEL)
    store = KVStore(1 << 28)
    engine = Engine(lm, store, methods=("full",))
    catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode)
    return create_app(engine, catalog, ServerSettings(**{"method": "full", **settings}))
