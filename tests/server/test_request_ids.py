"""Every HTTP answer carries an ``x-request-id`` (the openai client's ``_request_id`` and an error's ``request_id``),
and the server's log lines about that request name it: an operator finds a user's failed call by the id it quotes."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from itertools import pairwise

import httpx
import openai
import pytest

from kvrelay.server.response_store import ResponseStore
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

ID = re.compile(r"req_[0-9a-f]{32}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[LiveServer]:
    server = LiveServer(max_body_bytes=4096)
    try:
        yield server
    finally:
        server.stop()


def test_each_answer_has_its_own_random_id(srv):
    client = srv.client()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    models = client.models.with_raw_response.list()
    ids = [chat._request_id, again._request_id, models.headers["x-request-id"]]
    assert all(ID.fullmatch(i or "") for i in ids), ids
    assert len(set(ids)) == 3, ids
    # not a counter: consecutive ids are as far apart as random 128-bit numbers are (all but surely > 2**64)
    assert all(abs(int(a[4:], 16) - int(b[4:], 16)) > 1 << 64 for a, b in pairwise(ids)), ids


def test_a_stream_carries_the_id_in_its_headers(srv):
    with srv.client().chat.completions.with_streaming_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, stream=True) as response:
        chunks = list(response.iter_lines())
    assert ID.fullmatch(response.headers["x-request-id"])
    assert any(line.startswith("data: ") for line in chunks)


def test_errors_carry_the_id(srv):
    client = srv.client()
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad_value:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
    with pytest.raises(openai.NotFoundError) as no_route:
        client.with_options().get("/no-such-route", cast_to=object)
    # BodyLimit answers before the app: the id is given outside it
    too_large = httpx.post(f"{srv.url}/v1/chat/completions", content=b"x" * 5000, timeout=30)
    ids = [unknown_model.value.request_id, bad_value.value.request_id, no_route.value.request_id,
           too_large.headers.get("x-request-id")]
    assert too_large.status_code == 413
    assert all(ID.fullmatch(i or "") for i in ids), ids
    assert len(set(ids)) == len(ids)


def test_a_500_is_logged_with_the_id_the_client_got(srv, monkeypatch, caplog):
    def broken_get(self, namespace, response_id):
        raise RuntimeError("planted: the store fails")

    monkeypatch.setattr(ResponseStore, "get", broken_get)
    caplog.set_level(logging.INFO)
    with pytest.raises(openai.InternalServerError) as failed:
        srv.client().responses.retrieve("resp_x")
    request_id = failed.value.request_id
    assert ID.fullmatch(request_id or ""), failed.value.response.headers
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and request_id in r.getMessage()]
    assert errors and errors[0].exc_info and errors[0].request_id == request_id, caplog.records
    access = [r.getMessage() for r in caplog.records if r.name == "kvrelay.server.access"]
    assert any(m.startswith(f"{request_id} GET /v1/responses/resp_x 500 ") for m in access), access


def test_a_failure_in_the_worker_is_logged_with_the_id(srv, caplog):
    """A bug the engine worker meets mid-stream (its thread, not the request's task) names the request's id."""
    worker = srv.worker
    emit_text = worker._emit_text

    def emit_text_with_a_bug(job):
        if job.temperature == 1.5 and len(job.seq.output_ids) >= 2:  # after the stream began
            raise RuntimeError("planted: a bug turning tokens into text")
        emit_text(job)

    worker._emit_text = emit_text_with_a_bug
    caplog.set_level(logging.ERROR)
    try:
        with srv.client().chat.completions.with_streaming_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, temperature=1.5, stream=True) as response:
            body = "".join(response.iter_lines())
    finally:
        worker._emit_text = emit_text
    request_id = response.headers["x-request-id"]
    assert "internal_error" in body, body
    assert any(f"serving request {request_id} failed" in r.getMessage() for r in caplog.records), caplog.records


def test_a_path_cannot_forge_a_log_line(srv, caplog):
    """The path arrives percent-decoded: written as it is, a client's %0A would start a line of its own choosing."""
    caplog.set_level(logging.INFO, logger="kvrelay.server.access")
    answer = httpx.get(f"{srv.url}/v1/x%0A2099-01-01%20kvrelay.server%20ERROR%20forged", timeout=30)
    line = next(r.getMessage() for r in caplog.records
                if r.name == "kvrelay.server.access" and r.getMessage().startswith(answer.headers["x-request-id"]))
    assert "\n" not in line and " GET /v1/x%0A2099-01-01%20kvrelay.server%20ERROR%20forged 404 " in line, line


def test_the_clients_own_id_is_not_the_id_and_is_logged_only_when_plain(srv, caplog):
    caplog.set_level(logging.INFO, logger="kvrelay.server.access")
    client = srv.client()
    plain = client.models.with_raw_response.list(extra_headers={"x-request-id": "trace-42.a"})
    odd = client.models.with_raw_response.list(extra_headers={"x-request-id": "two words" + "x" * 200})
    assert ID.fullmatch(plain.headers["x-request-id"]) and ID.fullmatch(odd.headers["x-request-id"])
    lines = {r.getMessage().split()[0]: r.getMessage() for r in caplog.records if r.name == "kvrelay.server.access"}
    assert lines[plain.headers["x-request-id"]].endswith(" client_request_id=trace-42.a")
    assert "client_request_id" not in lines[odd.headers["x-request-id"]]


def test_what_preparing_a_request_logs_names_its_id(srv, monkeypatch):
    """Matching runs on a prepare thread (a bad record of the shared tier is warned about there): it sees the id."""
    from kvrelay.server.request_ids import current_request_id

    seen: list[str] = []
    catalog = srv.worker.catalog
    build_call = catalog.build_call
    monkeypatch.setattr(catalog, "build_call",
                        lambda *a, **kw: seen.append(current_request_id()) or build_call(*a, **kw))
    chat = srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert seen == [chat._request_id] and ID.fullmatch(seen[0])


def test_what_the_engine_thread_logs_for_a_request_names_its_id(srv, monkeypatch):
    """The engine thread starts, prefills and publishes many requests in turn (a lookup there may meet a bad tier
    record): while it works for one, that one's id is current, and none outside it."""
    from kvrelay.server.request_ids import current_request_id

    seen: dict[str, list[str]] = {"begin": [], "advance": [], "publish": []}
    engine = srv.worker.engine
    begin, publish = engine.begin, engine.publish

    def spying_begin(*a, **kw):
        seen["begin"].append(current_request_id())
        task = begin(*a, **kw)
        advance = task.advance
        task.advance = lambda *p: seen["advance"].append(current_request_id()) or advance(*p)
        return task

    monkeypatch.setattr(engine, "begin", spying_begin)
    monkeypatch.setattr(engine, "publish", lambda *a, **kw: seen["publish"].append(current_request_id())
                        or publish(*a, **kw))
    chat = srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert seen["begin"] == seen["publish"] == [chat._request_id] and ID.fullmatch(chat._request_id)
    assert set(seen["advance"]) == {chat._request_id}
    assert current_request_id() == ""
