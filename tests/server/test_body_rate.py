"""One client's large bodies draw on its own byte budget: a flood of them is a 429 before a byte is read, while
other clients, and every small body, pass. The clock is injected: nothing here waits."""

from __future__ import annotations

import asyncio
import json

from kvrelay.server.body_rate import LARGE_BODY_BYTES, BodyRate, client_key
from kvrelay.server.http_errors import BodyLimit
from kvrelay.server.metrics import ServerMetrics

MB = 1 << 20
LIMIT_BYTES = 4 * MB


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_client_over_its_budget_waits_and_the_budget_refills():
    clock = Clock()
    rate = BodyRate(LIMIT_BYTES, clock)
    assert rate.admit("a", 3 * MB) == 0  # 1 MB left
    assert rate.admit("a", 3 * MB) == 1  # 2 MB short, at 4 MB a second: 1 s (whole seconds, rounded up)
    assert rate.admit("b", 3 * MB) == 0  # another client's budget is its own
    clock.now_s += 0.5  # +2 MB: 3 MB left
    assert rate.admit("a", 3 * MB) == 0
    clock.now_s += 10  # refilled, never past the capacity
    assert rate.admit("a", 4 * MB) == 0 and rate.admit("a", 2 * MB) == 1


def test_small_bodies_are_free_even_to_a_client_in_deficit():
    rate = BodyRate(LIMIT_BYTES, Clock())
    rate.charge("a", 20 * MB)  # a chunked flood took the budget far below zero
    assert rate.admit("a", LARGE_BODY_BYTES) == 0
    assert rate.admit("a", 2 * MB) == 5  # 22 MB short at 4 MB a second


def test_forgetting_clients_keeps_those_in_deficit():
    clock = Clock()
    rate = BodyRate(LIMIT_BYTES, clock, max_clients=4)
    rate.charge("flood", 8 * MB)
    for i in range(20):
        rate.charge(f"c{i}", 2 * MB)
        clock.now_s += 1.0  # each earlier client is full again a second later
    assert len(rate._levels) <= 4
    assert rate.admit("flood", 2 * MB) == 0  # refilled in 20 s: forgetting it would have said the same
    rate.charge("flood", 40 * MB)
    for i in range(20):
        rate.charge(f"d{i}", 2 * MB)
    assert rate.admit("flood", 2 * MB) > 0  # the deepest deficit is never the one forgotten


def test_client_key_is_the_bearer_key_else_the_address():
    keyed = {"headers": [(b"authorization", b"Bearer sk-1")], "client": ("10.0.0.1", 5)}
    other_key = {"headers": [(b"authorization", b"Bearer sk-2")], "client": ("10.0.0.1", 6)}
    plain = {"headers": [], "client": ("10.0.0.1", 7)}
    assert len({client_key(keyed), client_key(other_key), client_key(plain)}) == 3
    assert "sk-1" not in client_key(keyed)
    assert client_key(plain) == client_key({"headers": [], "client": ("10.0.0.1", 99)})


def _drive(limit: BodyLimit, headers: list[tuple[bytes, bytes]], body: bytes, address: str) -> tuple[int, dict, int]:
    """(status, headers, bytes the app took) for one POST of ``body`` in one piece."""
    taken = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal taken
        if taken == 0:
            taken = len(body)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
             "client": (address, 1)}
    asyncio.run(asyncio.wait_for(limit(scope, receive, send), 10))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, taken


async def _reads_its_body(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_the_middleware_answers_a_flood_with_429_before_reading_and_lets_others_pass():
    metrics = ServerMetrics()
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, metrics, BodyRate(LIMIT_BYTES, Clock()))
    body = b"x" * (3 * MB)
    declared = [(b"content-length", str(len(body)).encode())]
    assert _drive(limit, declared, body, "10.0.0.1")[0] == 200
    status, headers, taken = _drive(limit, declared, body, "10.0.0.1")
    assert status == 429 and headers["retry-after"] == "1" and taken == 0
    assert _drive(limit, declared, body, "10.0.0.2")[0] == 200  # another client
    small = b"x" * 1000
    assert _drive(limit, [(b"content-length", b"1000")], small, "10.0.0.1")[0] == 200  # small, from the flooder
    assert metrics.errors.labels("429")._value.get() == 1


def test_a_chunked_body_is_charged_once_it_has_arrived():
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, ServerMetrics(), BodyRate(LIMIT_BYTES, Clock()))
    body = b"x" * (3 * MB)
    assert _drive(limit, [(b"transfer-encoding", b"chunked")], body, "10.0.0.1")[0] == 200
    status, _, _ = _drive(limit, [(b"content-length", str(len(body)).encode())], body, "10.0.0.1")
    assert status == 429


def test_the_429_is_openais_error_json():
    sent: list[dict] = []
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, ServerMetrics(), BodyRate(LIMIT_BYTES, Clock()))
    limit.rate.charge("addr:10.0.0.9", 10 * MB)

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        raise AssertionError("a refused body is never read")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-length", str(2 * MB).encode())], "client": ("10.0.0.9", 1)}
    asyncio.run(limit(scope, receive, send))
    error = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert str(2 * MB) in error["message"]
