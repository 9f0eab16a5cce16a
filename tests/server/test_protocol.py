"""Request validation errors as OpenAI's 400s: the message and ``param`` name the request's own field (no server)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvrelay.server.http_errors import add_error_handlers
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    add_error_handlers(app, ServerMetrics())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {}

    return TestClient(app)


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize("tool_choice, param", [
    ("sometimes", "tool_choice"),
    (5, "tool_choice"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice.type"),
    ({"type": "function"}, "tool_choice.function"),
])
def test_a_bad_tool_choice_names_the_field_not_a_model_class(client, tool_choice, param):
    # a union member that is a model is tagged with its class name in pydantic's location ("NamedToolChoice"),
    # which the param showed as if it were a field of the request
    r = client.post("/v1/chat/completions", json={**BODY, "tool_choice": tool_choice})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert "NamedToolChoice" not in error["message"]


def test_a_bad_content_part_still_names_the_part_it_got_to(client):
    body = {**BODY, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "messages.0.content.0.type", error


@pytest.mark.parametrize("field, value", [
    ("parallel_tool_calls", "yes"), ("parallel_tool_calls", 0),
    ("tools", [{"type": "function", "function": {"name": "f", "strict": "true"}}]),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 1}}),
])
def test_tool_booleans_are_strict_as_every_other_boolean(client, field, value):
    # "yes" was read as true: the one lax boolean of the request, where OpenAI refuses it
    r = client.post("/v1/chat/completions", json={**BODY, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.json()
