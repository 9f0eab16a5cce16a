"""``kvrelay_requests_total`` and ``kvrelay_errors_total`` count one population: every HTTP request the app gets, by
a fixed ``endpoint`` label, and of those the ones answered with an error status (4xx the client's, 5xx the
server's), wherever in the app the error was answered; ``kvrelay_requests_finished_total`` says ``error`` only for
the server's failures. ``RequestIds`` is driven with fake ASGI apps: no server, no timing."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.server.events import ErrorEvent
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.protocol import SHUTTING_DOWN_CODE
from kvrelay.server.request_failures import finish_reason_of
from kvrelay.server.request_ids import RequestIds, mark_cut


def _answers(status: int, cut_with: int | None = None):
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        if cut_with is not None:  # a stream that ends with an error chunk after its 200
            mark_cut(scope, cut_with)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _serve(app, path: str, metrics: ServerMetrics) -> None:
    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    asyncio.run(RequestIds(app, metrics)(scope, receive, send))


def _count(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("path, endpoint, status", [
    ("/v1/chat/completions", "chat", 400),  # a validation 400 answered before the route ran ("max_tokens": "4")
    ("/v1/completions", "completions", 413),
    ("/v1/responses", "responses", 429),
    ("/metrics", "other", 401),
    ("/v1/no-such-route", "other", 404),
    ("/v1/chat/completions", "chat", 503),
])
def test_every_error_is_also_counted_as_a_request_of_its_endpoint(path, endpoint, status):
    metrics = ServerMetrics()
    _serve(_answers(status), path, metrics)
    assert _count(metrics, "kvrelay_requests_total", endpoint=endpoint) == 1
    assert _count(metrics, "kvrelay_errors_total", endpoint=endpoint, status=str(status)) == 1


def test_an_answer_is_no_error_and_a_client_that_left_is_none_either():
    metrics = ServerMetrics()
    _serve(_answers(200), "/v1/chat/completions", metrics)
    _serve(_answers(499), "/v1/chat/completions", metrics)  # the client left: cancelled_total counts it
    assert _count(metrics, "kvrelay_requests_total", endpoint="chat") == 2
    assert not [s for f in metrics.errors.collect() for s in f.samples if s.value]


def test_a_stream_ended_by_an_error_chunk_counts_the_error_s_status():
    metrics = ServerMetrics()
    _serve(_answers(200, cut_with=503), "/v1/chat/completions", metrics)
    assert _count(metrics, "kvrelay_errors_total", endpoint="chat", status="503") == 1
    assert _count(metrics, "kvrelay_errors_total", endpoint="chat", status="200") == 0


def test_a_path_a_client_makes_up_is_no_series_of_its_own():
    metrics = ServerMetrics()
    for path in ("/v1/a", "/v1/b", "/v1/chat/completions/x"):
        _serve(_answers(404), path, metrics)
    assert {s.labels["endpoint"] for f in metrics.requests.collect() for s in f.samples} == {"other"}
    assert _count(metrics, "kvrelay_requests_total", endpoint="other") == 3


@pytest.mark.parametrize("event, reason", [
    (ErrorEvent(400, "over the context", "messages", "context_length_exceeded"), "rejected"),
    (ErrorEvent(400, "the grammar allows no token", None, "invalid_value"), "rejected"),
    (ErrorEvent(503, "shutting down", None, SHUTTING_DOWN_CODE), "shutdown"),
    (ErrorEvent(500, "generation failed", None, "internal_error"), "error"),
])
def test_only_the_server_s_own_failures_finish_as_error(event, reason):
    assert finish_reason_of(event) == reason
