"""One client's large bodies draw on its own byte budget: a flood of them waits, unread, for its turn (or is a 429
before a byte is read), while other clients, and every small body, pass. The clock and the sleep are injected:
nothing here waits."""

from __future__ import annotations

import asyncio
import json

from kvrelay.server.body_rate import LARGE_BODY_BYTES, MAX_WAIT_S, MAX_WAITING, BodyRate, client_key
from kvrelay.server.http_errors import BodyLimit
from kvrelay.server.metrics import ServerMetrics

MB = 1 << 20
LIMIT_BYTES = 4 * MB


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0
        self.slept_s: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:  # a sleep that passes at once, moving the clock
        self.slept_s.append(seconds)
        self.now_s += seconds


def _rate(clock: Clock, **kw) -> BodyRate:
    return BodyRate(LIMIT_BYTES, clock, clock.sleep, **kw)


def test_a_client_over_its_budget_waits_and_the_budget_refills():
    clock = Clock()
    rate = _rate(clock)
    assert rate.admit("a", 3 * MB) == 0  # 1 MB left
    assert rate.admit("a", 3 * MB) == 0.5  # 2 MB short, at 4 MB a second
    assert rate.admit("b", 3 * MB) == 0  # another client's budget is its own
    clock.now_s += 0.5  # +2 MB: 3 MB left
    assert rate.admit("a", 3 * MB) == 0
    clock.now_s += 10  # refilled, never past the capacity
    assert rate.admit("a", 4 * MB) == 0 and rate.admit("a", 2 * MB) == 0.5


def test_a_body_over_the_budget_waits_its_turn_and_is_then_charged():
    clock = Clock()
    rate = _rate(clock)
    assert asyncio.run(rate.wait_turn("a", 3 * MB)) == 0 and clock.slept_s == []
    assert asyncio.run(rate.wait_turn("a", 3 * MB)) == 0 and clock.slept_s == [0.5]
    assert rate.admit("a", 2 * MB) == 0.5  # the waited body was charged: nothing left
    rate.charge("b", 200 * MB)  # over MAX_WAIT_S of deficit: no wait, a retry time
    assert asyncio.run(rate.wait_turn("b", 2 * MB)) == 50 > MAX_WAIT_S and clock.slept_s == [0.5]


def test_a_client_with_its_bodies_already_waiting_gets_a_retry_time():
    clock = Clock()
    release = asyncio.Event()

    async def paused_sleep(seconds: float) -> None:  # the waiting bodies stay waiting until released
        await release.wait()
        clock.now_s += seconds

    rate = BodyRate(LIMIT_BYTES, clock, paused_sleep)

    async def flood() -> list[int]:
        rate.charge("a", 8 * MB)  # 2 s of deficit for each 4 MB body
        waiting = [asyncio.create_task(rate.wait_turn("a", 4 * MB)) for _ in range(MAX_WAITING)]
        await asyncio.sleep(0)  # every one of them is waiting now
        # bounded only so that a planted bug fails instead of hanging: neither call may wait at all
        over = await asyncio.wait_for(rate.wait_turn("a", 4 * MB), 10)
        other = await asyncio.wait_for(rate.wait_turn("b", 4 * MB), 10)  # another client is not held up
        release.set()
        return [over, other] + list(await asyncio.gather(*waiting))

    over, other, *waited = asyncio.run(flood())
    assert over >= 1 and other == 0
    assert waited == [0] * MAX_WAITING  # each got its turn once released
    assert rate._waiting == {}


def test_small_bodies_are_free_even_to_a_client_in_deficit():
    rate = _rate(Clock())
    rate.charge("a", 20 * MB)  # a chunked flood took the budget far below zero
    assert rate.admit("a", LARGE_BODY_BYTES) == 0
    assert rate.admit("a", 2 * MB) == 4.5  # 4 MB - 20 MB left: 18 MB short at 4 MB a second


def test_forgetting_clients_keeps_those_in_deficit():
    clock = Clock()
    rate = _rate(clock, max_clients=4)
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


def test_client_key_is_a_configured_api_key_else_the_address():
    keys = frozenset({"sk-1", "sk-2"})
    keyed = {"headers": [(b"authorization", b"Bearer sk-1")], "client": ("10.0.0.1", 5)}
    other_key = {"headers": [(b"authorization", b"Bearer sk-2")], "client": ("10.0.0.1", 6)}
    plain = {"headers": [], "client": ("10.0.0.1", 7)}
    assert len({client_key(keyed, keys), client_key(other_key, keys), client_key(plain, keys)}) == 3
    assert "sk-1" not in client_key(keyed, keys)
    assert client_key(plain, keys) == client_key({"headers": [], "client": ("10.0.0.1", 99)}, keys)
    made_up = {"headers": [(b"authorization", b"Bearer bogus")], "client": ("10.0.0.1", 8)}
    assert client_key(made_up, keys) == client_key(plain, keys)  # a key nobody configured buys no new budget
    assert client_key(keyed) == client_key(plain)  # without --api-keys every bearer is made up


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


def test_the_middleware_holds_a_flood_to_its_budget_and_lets_others_pass():
    metrics, clock = ServerMetrics(), Clock()
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, metrics, _rate(clock))
    body = b"x" * (3 * MB)
    declared = [(b"content-length", str(len(body)).encode())]
    assert _drive(limit, declared, body, "10.0.0.1")[0] == 200
    assert _drive(limit, declared, body, "10.0.0.1")[0] == 200 and clock.slept_s == [0.5]  # waited its turn
    limit.rate.charge("addr:10.0.0.1", 200 * MB)  # a deficit past MAX_WAIT_S: a 429, nothing read
    status, headers, taken = _drive(limit, declared, body, "10.0.0.1")
    assert status == 429 and int(headers["retry-after"]) > MAX_WAIT_S and taken == 0
    assert _drive(limit, declared, body, "10.0.0.2")[0] == 200  # another client
    small = b"x" * 1000
    assert _drive(limit, [(b"content-length", b"1000")], small, "10.0.0.1")[0] == 200  # small, from the flooder
    # counted by RequestIds, outside BodyLimit, as every error is (tests/server/test_request_counters.py)


def test_a_chunked_body_waits_while_its_clients_budget_is_below_zero():
    clock = Clock()
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, ServerMetrics(), _rate(clock))
    chunked = [(b"transfer-encoding", b"chunked")]
    for _ in range(2):  # 4 MB, then 1 MB left when each starts: neither waits
        assert _drive(limit, chunked, b"x" * (3 * MB), "10.0.0.1")[0] == 200 and clock.slept_s == []
    assert _drive(limit, chunked, b"x" * (3 * MB), "10.0.0.1")[0] == 200  # -2 MB left: it waited 0.5 s
    assert clock.slept_s == [0.5]
    assert _drive(limit, [], b"", "10.0.0.1")[0] == 200 and clock.slept_s == [0.5]  # no body: never waits


def test_a_chunked_body_is_charged_once_it_has_arrived():
    clock = Clock()
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, ServerMetrics(), _rate(clock))
    body = b"x" * (3 * MB)
    assert _drive(limit, [(b"transfer-encoding", b"chunked")], body, "10.0.0.1")[0] == 200
    assert _drive(limit, [(b"content-length", str(len(body)).encode())], body, "10.0.0.1")[0] == 200
    assert clock.slept_s == [0.5]  # the chunked body was charged: the next one waited


def test_the_429_is_openais_error_json():
    sent: list[dict] = []
    limit = BodyLimit(_reads_its_body, LIMIT_BYTES, ServerMetrics(), _rate(Clock()))
    limit.rate.charge("addr:10.0.0.9", 200 * MB)

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
