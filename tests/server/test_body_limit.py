"""The body limit counts bytes as they arrive: a chunked body over it is a 413 before the app reads it all."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.weights.loader import load_model

LIMIT_BYTES = 10_000
CHUNK_BYTES = 1_000
NUM_CHUNKS = 100  # 100 KB offered: ten times the limit


@pytest.fixture(scope="module")
def app():
    lm = load_model("random:tiny")
    store = KVStore(1 << 26)
    return create_app(Engine(lm, store), SpanCatalog(store, lm.fingerprint),
                      ServerSettings(max_body_bytes=LIMIT_BYTES))


def _post(app, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, dict, int]:
    """Drive the ASGI app with a body sent in ``chunks``; (status, JSON body, bytes the app took)."""
    taken = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal taken
        if taken // CHUNK_BYTES < len(chunks):
            chunk = chunks[taken // CHUNK_BYTES]
            taken += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": taken // CHUNK_BYTES < len(chunks)}
        await asyncio.sleep(3600)  # the client says nothing more (a disconnect check waits here)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), taken


def _chunked_json(num_chunks: int) -> list[bytes]:
    content = "x" * (num_chunks * CHUNK_BYTES)
    raw = json.dumps({"model": "random:tiny", "messages": [{"role": "user", "content": content}]}).encode()
    raw = raw[: num_chunks * CHUNK_BYTES - 3] + b'"}]'  # cut to whole chunks, still an object's tail
    return [raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)]


def test_a_chunked_body_over_the_limit_is_413_without_reading_it_all(app):
    status, body, taken = _post(app, [(b"content-type", b"application/json"),
                                      (b"transfer-encoding", b"chunked")], _chunked_json(NUM_CHUNKS))
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large" and str(LIMIT_BYTES) in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert taken <= LIMIT_BYTES + CHUNK_BYTES  # it stopped reading at the first chunk past the limit


def test_a_declared_length_over_the_limit_is_413_before_any_byte_is_read(app):
    chunks = _chunked_json(NUM_CHUNKS)
    status, body, taken = _post(app, [(b"content-type", b"application/json"),
                                      (b"content-length", str(sum(map(len, chunks))).encode())], chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large" and taken == 0
