"""A tool call left unanswered is a 400 as OpenAI gives it, on chat completions (the tool messages right after the
call) and on the Responses API (a function_call_output after each function_call, the stored chain included);
answered calls, in either API's orders, are still served."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvrelay.server.call_answers import check_chat_calls_answered, check_input_calls_answered
from kvrelay.server.protocol import ApiError, ChatMessage
from tests.server.inproc import MODEL, make_app

USER = {"role": "user", "content": "Weather in Paris?"}


def calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get", "arguments": "{}"}} for i in ids]}


def answer(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "21 C"}


def chat(*messages: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in messages]


@pytest.mark.parametrize("messages", [
    [USER, calls("c1"), answer("c1")],
    [USER, calls("c1", "c2"), answer("c2"), answer("c1"), {"role": "user", "content": "And Rome?"}],
    [USER, calls("c1"), answer("c1"), {"role": "assistant", "content": "Sunny."}, calls("c2"), answer("c2")],
])
def test_calls_the_next_tool_messages_answer_pass(messages):
    check_chat_calls_answered(chat(*messages))


@pytest.mark.parametrize(("messages", "at", "missing"), [
    ([USER, calls("c1"), USER], 1, "c1"),
    ([USER, calls("c1")], 1, "c1"),  # the last message
    ([USER, calls("c1", "c2"), answer("c1"), USER], 1, "c2"),
    ([USER, calls("c1"), answer("c1"), calls("c2", "c3"), USER, answer("c2")], 3, "c2, c3"),  # a user between
])
def test_a_call_the_next_tool_messages_do_not_answer_is_openais_400(messages, at, missing):
    with pytest.raises(ApiError) as err:
        check_chat_calls_answered(chat(*messages))
    assert err.value.status == 400 and err.value.param == f"messages.{at}.tool_calls"
    assert err.value.message.startswith("An assistant message with 'tool_calls' must be followed by tool messages "
                                        "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                                        f"response messages: {missing} ")


def call_item(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get", "arguments": "{}"}


def output_item(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "21 C"}


ASSISTANT = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}


@pytest.mark.parametrize(("items", "history"), [
    ([USER, call_item("c1"), output_item("c1")], []),
    ([call_item("c1"), ASSISTANT, output_item("c1")], []),  # a response's output replayed: call, then its text
    ([output_item("c1"), USER], [USER, calls("c1")]),  # the stored call, answered now
    ("And Rome?", [USER, calls("c1"), answer("c1")]),  # answered in the stored chain
    ([USER, call_item("c1"), {**call_item("c2"), "status": "incomplete"}, output_item("c1")], []),  # c2 was cut
])
def test_function_calls_with_an_output_after_them_pass(items, history):
    check_input_calls_answered(items, history)


@pytest.mark.parametrize(("items", "history", "missing"), [
    ([USER, call_item("c1")], [], "c1"),
    ([call_item("c1"), call_item("c2"), output_item("c2")], [], "c1"),
    ("And Rome?", [USER, calls("c1")], "c1"),  # previous_response_id to a response that called a tool
    ([output_item("c1")], [USER, calls("c1", "c2")], "c2"),
])
def test_a_function_call_without_an_output_is_openais_400(items, history, missing):
    with pytest.raises(ApiError) as err:
        check_input_calls_answered(items, history)
    assert err.value.status == 400 and err.value.param == "input"
    assert err.value.message.startswith(f"No tool output found for function call {missing}.")


# ---------------------------------------------------------------------- through the server (random:tiny)
TOOL = {"type": "function", "name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


def post_chat(client, messages: list[dict]):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})


def test_chat_route_refuses_an_unanswered_call_and_serves_an_answered_one(client):
    refused = post_chat(client, [USER, calls("call_1"), {"role": "user", "content": "Well?"}])
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "messages.1.tool_calls" and "call_1" in error["message"]
    assert post_chat(client, [USER, calls("call_1"), answer("call_1")]).status_code == 200
    wrong = post_chat(client, [USER, calls("call_1"), answer("call_2")])  # the wrong-id 400 comes first
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages.2.tool_call_id"


def respond(client, **kw):
    return client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 40, "temperature": 0, **kw})


def test_responses_refuse_a_stored_call_left_unanswered_and_serve_it_answered(client):
    first = respond(client, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=120).json()  # room to close the call (41 tokens)
    call = next(o for o in first["output"] if o["type"] == "function_call")
    assert first["status"] == call["status"] == "completed"  # a call cut off is no call of the stored chain
    refused = respond(client, previous_response_id=first["id"], input="Well?")
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "input"
    assert error["message"].startswith(f"No tool output found for function call {call['call_id']}.")
    answered = respond(client, previous_response_id=first["id"], input=[output_item(call["call_id"])])
    assert answered.status_code == 200, answered.text
    replayed = respond(client, input=[USER, {k: call[k] for k in ("type", "call_id", "name", "arguments")}, ASSISTANT,
                                      output_item(call["call_id"])])
    assert replayed.status_code == 200, replayed.text  # chat's stricter order is not asked of Responses items
    wrong = respond(client, previous_response_id=first["id"], input=[output_item("call_nope")])
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "input.0.call_id"


def test_a_cut_call_replayed_needs_no_output_as_in_the_stored_chain(client):
    """The cookbook loop (input + the response's output items + outputs, store=false) and previous_response_id read
    the same conversation: the call max_output_tokens cut off is left out of both and needs no output."""
    first = respond(client, input=[USER], tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=30).json()  # past the call's name (36 tokens close it)
    assert first["status"] == "incomplete" and [o["status"] for o in first["output"]] == ["incomplete"]
    stored = respond(client, previous_response_id=first["id"], input="Well?", max_output_tokens=1)
    replayed = respond(client, input=[USER, *first["output"], {"role": "user", "content": "Well?"}],
                       store=False, max_output_tokens=1)
    assert stored.status_code == replayed.status_code == 200, replayed.text
    assert stored.json()["usage"]["input_tokens"] == replayed.json()["usage"]["input_tokens"]
