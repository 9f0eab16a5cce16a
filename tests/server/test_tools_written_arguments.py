"""A tool call's arguments as the model wrote them, over HTTP: a schema without ``type`` is decoded as an object's,
and arguments that are still no object (a schema the grammar library reads as another value) leave the call the
stream announced a call, on chat completions and /v1/responses, streamed and not, never content."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from kvrelay.server import grammar
from kvrelay.server.tools import CALL_OPEN, ToolPlan
from tests.server.inproc import MODEL, make_app

pytestmark = pytest.mark.skipif(grammar.xgr is None, reason="needs the tools extra (xgrammar)")
# stands for a tool schema the grammar library reads as a non-object (xgrammar reads a top-level anyOf or const
# beside "type": "object" so): the grammar then writes these arrays as the arguments
ARRAY = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "maxItems": 2}
CHOICES = ["required", {"type": "function", "function": {"name": "f"}}]


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


def _chat(client, stream: bool, **kw) -> tuple[str | None, list[tuple[str, str]], str, str]:
    """(content, [(name, arguments)], finish_reason, the raw reply) of a chat answer, assembled from a stream's
    deltas as a client does."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}], "max_tokens": 60,
            "temperature": 0, "parallel_tool_calls": False, "stream": stream, **kw}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls")
                 or []]
        return choice["message"]["content"], calls, choice["finish_reason"], reply.text
    content, calls, finish = None, {}, None
    for line in reply.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            delta, finish = choice.get("delta", {}), choice["finish_reason"] or finish
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], ["", ""])
                call[0] += piece["function"].get("name") or ""
                call[1] += piece["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, reply.text


@pytest.mark.parametrize("choice", CHOICES)
def test_a_call_with_arguments_that_are_no_object_is_the_same_call_streamed_or_not(client, choice, monkeypatch):
    monkeypatch.setattr(ToolPlan, "schema_of", lambda self, name: ARRAY)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    whole = _chat(client, False, tools=tools, tool_choice=choice)
    streamed = _chat(client, True, tools=tools, tool_choice=choice)
    assert whole[:3] == streamed[:3]
    content, calls, finish, _ = whole
    assert (content, finish, [name for name, _ in calls]) == (None, "tool_calls", ["f"])
    assert isinstance(json.loads(calls[0][1]), list)  # the grammar wrote no object: the call is still reported
    assert CALL_OPEN not in whole[3] and CALL_OPEN not in streamed[3]


def _response(client, stream: bool) -> tuple[list[tuple], str]:
    """The output items (type, name, arguments, text) of a /v1/responses answer (a stream's from its last event)."""
    body = {"model": MODEL, "input": "Call f.", "max_output_tokens": 60, "temperature": 0, "stream": stream,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": "required", "parallel_tool_calls": False}
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        events = [json.loads(line[len("data: "):]) for line in reply.text.splitlines() if line.startswith("data: {")]
        response = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
    else:
        response = reply.json()
    items = [(i["type"], i.get("name"), i.get("arguments"), json.dumps(i.get("content"))) for i in response["output"]]
    return items, reply.text


def test_on_responses_such_a_call_is_a_function_call_item_streamed_or_not(client, monkeypatch):
    monkeypatch.setattr(ToolPlan, "schema_of", lambda self, name: ARRAY)
    whole, raw = _response(client, False)
    streamed, raw_stream = _response(client, True)
    assert whole == streamed and [item[:2] for item in whole] == [("function_call", "f")]
    assert isinstance(json.loads(whole[0][2]), list)
    assert CALL_OPEN not in raw and CALL_OPEN not in raw_stream


@pytest.mark.parametrize("seed", range(1, 6))
def test_arguments_of_a_schema_without_type_are_an_object(client, seed):
    """``parameters: {}`` (what clients send for a tool without parameters) was decoded as any JSON value."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    content, calls, finish, _ = _chat(client, False, tools=tools, tool_choice="required", seed=seed,
                                      temperature=1.0)
    assert (content, len(calls)) == (None, 1)
    assert calls[0][1].startswith("{")  # max_tokens may cut a random model's object: its start is an object's
    if finish == "tool_calls":
        assert isinstance(json.loads(calls[0][1]), dict)
