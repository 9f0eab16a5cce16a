"""A method that plans an inconsistent schedule (``ScheduleError``: the engine's fault, never the request's) does not
answer the request with a 400 blaming it: the request starts over with the fallback (exact prefix reuse), is served,
and the server logs what happened."""

from __future__ import annotations

import logging

import httpx

from kvrelay.errors import ScheduleError
from kvrelay.server.request_failures import FALLBACK_METHOD
from tests.server.live import MODEL, LiveServer

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 6, "temperature": 0,
        "kvrelay": {"method": "epic"}}


def test_a_method_planning_an_inconsistent_schedule_falls_back_and_is_logged(caplog):
    srv = LiveServer()
    engine = srv.worker.engine
    epic = engine.method("epic")
    planned = []

    def inconsistent(*args, **kwargs):
        planned.append(True)
        raise ScheduleError("planted: a schedule counted -40 kept rows where its mask keeps 8")

    try:
        with caplog.at_level(logging.ERROR, logger="kvrelay.server"):
            epic.plan = inconsistent
            r = httpx.post(f"{srv.url}{CHAT}", json=BODY, timeout=60)
            del epic.plan
            expected = httpx.post(f"{srv.url}{CHAT}", json={**BODY, "kvrelay": {"method": FALLBACK_METHOD}},
                                  timeout=60)
    finally:
        srv.stop()
    assert planned, "the planted plan never ran"
    assert r.status_code == 200, r.text
    assert r.json()["kvrelay"]["method"] == FALLBACK_METHOD
    assert r.json()["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]
    assert any("epic planned an inconsistent schedule" in rec.getMessage() and "counted -40" in rec.getMessage()
               for rec in caplog.records)
