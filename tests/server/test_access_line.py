"""``RequestIds`` writes exactly one access line per request, and marks an answer its client never got to the end
of (the client left mid-stream, or the app was cancelled) with ``cut`` after the status. The middleware is driven
directly with fake ASGI apps, so each ending happens at a chosen message, with no server and no timing."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

import pytest

from kvrelay.server.request_ids import CUT_MARKER, RequestIds

PATH = "/v1/chat/completions"
START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
CHUNK = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
LAST = {"type": "http.response.body", "body": b"", "more_body": False}
REQUEST = {"type": "http.request", "body": b"{}", "more_body": False}
App = Callable[[dict, Callable, Callable], Awaitable[None]]


def _serve(app: App, client_messages: list[dict]) -> list[dict]:
    """Runs one request through ``RequestIds(app)``: ``receive`` hands out ``client_messages`` in order (then the
    client's disconnect, as a server does once the request is read); returns what reached the server's ``send``."""
    incoming = iter(client_messages)
    sent: list[dict] = []

    async def receive() -> dict:
        return next(incoming, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": PATH, "root_path": "", "headers": []}
    asyncio.run(RequestIds(app)(scope, receive, send))
    return sent


def _the_one_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "kvrelay.server.access"]
    assert len(lines) == 1, lines
    return lines[0]


def _line(status: str) -> re.Pattern[str]:
    return re.compile(rf"req_[0-9a-f]{{32}} POST {PATH} {status} \d+\.\d ms")


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="kvrelay.server.access")


async def _whole_stream(scope, receive, send) -> None:
    await receive()
    for message in (START, CHUNK, LAST):
        await send(message)


def test_a_whole_answer_writes_one_plain_line(caplog):
    sent = _serve(_whole_stream, [REQUEST])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert _line("200").fullmatch(line := _the_one_line(caplog)), line


def test_a_client_leaving_after_the_whole_answer_is_no_cut(caplog):
    async def app(scope, receive, send) -> None:
        await _whole_stream(scope, receive, send)
        assert (await receive())["type"] == "http.disconnect"  # e.g. a background task listening on

    _serve(app, [REQUEST])
    assert _line("200").fullmatch(line := _the_one_line(caplog)), line


def test_a_stream_whose_client_left_is_logged_once_as_cut(caplog):
    """As Starlette's StreamingResponse ends on the client's ``http.disconnect``: it stops sending and returns."""
    async def app(scope, receive, send) -> None:
        await receive()
        await send(START)
        await send(CHUNK)
        assert (await receive())["type"] == "http.disconnect"

    sent = _serve(app, [REQUEST])
    assert sent[-1] == CHUNK  # no last body message went out
    assert _line(f"200 {CUT_MARKER}").fullmatch(line := _the_one_line(caplog)), line


def test_an_answer_ended_after_its_client_left_is_still_cut(caplog):
    """The app sees the disconnect, then ends its stream; the server drops what is sent after a disconnect."""
    async def app(scope, receive, send) -> None:
        await receive()
        await send(START)
        await send(CHUNK)
        assert (await receive())["type"] == "http.disconnect"
        await send(LAST)

    _serve(app, [REQUEST])
    assert _line(f"200 {CUT_MARKER}").fullmatch(line := _the_one_line(caplog)), line


def test_a_cancelled_stream_is_logged_once_as_cut(caplog):
    async def app(scope, receive, send) -> None:
        await receive()
        await send(START)
        await send(CHUNK)
        raise asyncio.CancelledError  # the server cancels the request's task (its client left, or it stops)

    with pytest.raises(asyncio.CancelledError):
        _serve(app, [REQUEST])
    assert _line(f"200 {CUT_MARKER}").fullmatch(line := _the_one_line(caplog)), line


def test_a_stream_the_app_stops_sending_is_cut(caplog):
    async def app(scope, receive, send) -> None:
        await receive()
        await send(START)
        await send(CHUNK)

    _serve(app, [REQUEST])
    assert _line(f"200 {CUT_MARKER}").fullmatch(line := _the_one_line(caplog)), line


def test_a_failure_before_the_answer_is_a_500_the_error_handler_sends_whole(caplog):
    async def app(scope, receive, send) -> None:
        await receive()
        raise RuntimeError("planted: a bug before the answer")

    with pytest.raises(RuntimeError, match="planted"):
        _serve(app, [REQUEST])
    assert _line("500").fullmatch(line := _the_one_line(caplog)), line
