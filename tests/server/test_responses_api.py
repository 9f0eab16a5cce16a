"""``/v1/responses`` driven by the official ``openai`` client against a real server (random:tiny).

Random weights follow no prompt, so what the model must produce (tool calls, JSON) is forced through the
request (tool_choice, text.format) and checked against the schema; everything else is checked against the
same request sent to ``/v1/chat/completions`` (same prompt ids, same sampled text for the same seed).
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.server.conftest import MODEL

DOC = ("The Rhine rises in the Swiss Alps, forms part of the Swiss-Austrian, Swiss-German and Franco-German "
       "borders, then flows through the Rhineland and the Netherlands into the North Sea. ") * 3
# enums: random weights never close a free string, but a constrained enum ends where its grammar does
CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "Local time of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}


def salt() -> str:
    return uuid.uuid4().hex


def create(server, **kw) -> Response:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 12)
    extra = kw.pop("extra_body", {})
    return server.client().responses.create(model=MODEL, extra_body={"cache_salt": kw.pop("salt", salt()), **extra},
                                            **kw)


def valid_weather_args(text: str) -> dict:
    args = json.loads(text)
    assert set(args) == {"city", "unit"} and args["city"] in CITIES and args["unit"] in ("c", "f")
    return args


def test_same_prompt_and_text_as_chat_completions(server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Tell me "},
                                          {"type": "input_text", "text": "about rivers."}]}]
    r = create(server, instructions="You are terse.", input=items, temperature=1.0, top_p=0.9, max_output_tokens=9,
               extra_body={"seed": 5})
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Tell me about rivers."}],
        temperature=1.0, top_p=0.9, max_completion_tokens=9, seed=5, extra_body={"cache_salt": salt()})
    assert r.object == "response" and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 9
    assert r.usage.total_tokens == r.usage.input_tokens + 9
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.temperature, r.top_p, r.max_output_tokens, r.instructions) == (1.0, 0.9, 9, "You are terse.")
    assert r.model_extra["kvrelay"]["method"] == "epic"


def test_cached_tokens_and_the_kvrelay_object(server):
    ns = salt()
    first = create(server, instructions=DOC, input="Where does the Rhine rise?", salt=ns)
    again = create(server, instructions=DOC, input="Where does it end?", salt=ns)
    assert first.usage.input_tokens_details.cached_tokens == 0
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached == again.model_extra["kvrelay"]["num_reused_tokens"]
    other = create(server, instructions=DOC, input="Where does it end?")  # a fresh namespace: nothing to reuse
    assert other.usage.input_tokens_details.cached_tokens == 0


def test_previous_response_id_continues_the_stored_conversation(server):
    ns = salt()
    r1 = create(server, instructions="Answer.", input=DOC + "Summarise.", salt=ns)
    r2 = create(server, instructions="Answer.", input="Shorter.", previous_response_id=r1.id, salt=ns,
                extra_body={"kvrelay": {"debug": True}})
    replay = create(server, instructions="Answer.", salt=salt(), extra_body={"kvrelay": {"debug": True}},
                    input=[{"role": "user", "content": DOC + "Summarise."},
                           {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Shorter."}])
    assert r2.previous_response_id == r1.id
    assert r2.model_extra["kvrelay"]["debug"]["prompt_ids"] == replay.model_extra["kvrelay"]["debug"]["prompt_ids"]
    assert r2.output_text == replay.output_text
    assert r2.usage.input_tokens_details.cached_tokens > 0  # the first turn's KV, output included, is found again
    assert server.client().responses.retrieve(r1.id, extra_query={"cache_salt": ns}).output_text == r1.output_text


def test_previous_response_id_is_per_namespace_and_store_false_keeps_nothing(server):
    ns = salt()
    r1 = create(server, input="hello", salt=ns)
    unstored = create(server, input="hello", salt=ns, store=False)
    assert r1.store is True and unstored.store is False
    for response_id, namespace in ((r1.id, salt()), (unstored.id, ns)):
        with pytest.raises(openai.BadRequestError) as err:
            create(server, input="more", previous_response_id=response_id, salt=namespace)
        assert err.value.body["param"] == "previous_response_id"
        assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(r1.id, extra_query={"cache_salt": salt()})
    server.client().responses.delete(r1.id, extra_query={"cache_salt": ns})
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(r1.id, extra_query={"cache_salt": ns})


def test_required_tool_call_has_schema_valid_arguments(server):
    r = create(server, input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed" and calls[0].name in ("get_weather", "get_time")
    c = calls[0]
    assert c.call_id.startswith("call_") and c.status == "completed"
    if c.name == "get_weather":
        valid_weather_args(c.arguments)
    else:
        assert json.loads(c.arguments)["city"] in CITIES
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]


def test_named_tool_choice_and_no_parallel_calls(server):
    r = create(server, input="Time in Rome?", tools=[WEATHER, TIME], parallel_tool_calls=False,
               tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and json.loads(calls[0].arguments)["city"] in CITIES
    assert r.parallel_tool_calls is False


def test_tool_loop_round_trip_reuses_the_call(server):
    ns = salt()
    r1 = create(server, instructions="Use tools.", input="Weather in Paris?", tools=[WEATHER],
                tool_choice="required", parallel_tool_calls=False, max_output_tokens=60, salt=ns)
    call = next(o for o in r1.output if o.type == "function_call")
    valid_weather_args(call.arguments)
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees, sunny"}]
    again = dict(instructions="Use tools.", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                 max_output_tokens=60, salt=ns)
    r2 = create(server, input=items, **again)
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    # the first step's prompt and the call's decode KV (the call comes back as the text the model generated)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 2
    # the same continuation through previous_response_id: only the tool output is new input
    r3 = create(server, previous_response_id=r1.id, input=[items[2]], **again)
    assert r3.usage.input_tokens == r2.usage.input_tokens


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "name": "city", "strict": True,
     "schema": {"type": "object", "properties": {"name": {"type": "string", "enum": CITIES},
                                                 "people": {"type": "integer", "minimum": 0, "maximum": 9999}},
                "required": ["name", "people"], "additionalProperties": False}},
    {"type": "json_object"}])
def test_text_format_returns_parseable_json(server, fmt):
    r = create(server, input="A city as JSON.", text={"format": fmt}, max_output_tokens=80)
    value = json.loads(r.output_text)
    assert isinstance(value, dict) and r.text.format.type == fmt["type"]
    if fmt["type"] == "json_schema":
        assert value["name"] in CITIES and 0 <= value["people"] <= 9999 and set(value) == {"name", "people"}


def test_stream_events_and_final_response(server):
    kw = dict(instructions="Be brief.", input="Stream a few words.", temperature=1.0, max_output_tokens=10,
              extra_body={"seed": 3})
    whole = create(server, **kw)
    events = list(server.client().responses.create(model=MODEL, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_stream_tool_call_arguments(server):
    events = list(server.client().responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=60, stream=True, extra_body={"cache_salt": salt()}))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == done.arguments
    valid_weather_args(done.arguments)
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].arguments == done.arguments
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.id == final.output[0].id and added.item.name == "get_weather"


def _shape(output) -> list[tuple]:
    return [(o.type, o.status, getattr(o, "name", None), getattr(o, "arguments", None),
             [c.text for c in getattr(o, "content", None) or []]) for o in output]


@pytest.mark.parametrize(("tools", "temperature", "seed", "max_output_tokens", "statuses"), [
    ([WEATHER, TIME], 1.0, 5, 120, ["completed"] * 2),  # two calls, a newline between them
    ([WEATHER, TIME], 1.0, 3, 120, ["completed"] * 2),  # two calls, then a third cut inside "<tool_call>"
    ([WEATHER], 0.0, 1, 45, ["incomplete"]),  # a call cut inside its arguments
    ([WEATHER], 0.0, 1, 12, [])])  # a call cut before its name: no item, not an empty message
def test_streamed_calls_end_as_the_unstreamed_response(server, tools, temperature, seed, max_output_tokens,
                                                       statuses):
    """The stream shows no text between or after calls that the response lacks, and its last event's output is
    the non-streamed response's (a cut call included, "incomplete")."""
    kw = dict(input="Weather in Paris and in Rome?", tools=tools, tool_choice="required", temperature=temperature,
              max_output_tokens=max_output_tokens)
    ns = salt()
    whole = create(server, extra_body={"seed": seed}, salt=ns, **kw)
    events = list(server.client().responses.create(model=MODEL, stream=True, **kw,
                                                   extra_body={"cache_salt": salt(), "seed": seed}))
    assert [(o.type, o.status) for o in whole.output] == [("function_call", s) for s in statuses]
    assert not any(e.type.startswith("response.output_text") for e in events)
    closed = [e.item for e in events if e.type == "response.output_item.done"]
    assert _shape(events[-1].response.output) == _shape(closed) == _shape(whole.output)
    assert events[-1].response.status == whole.status
    if not statuses:  # the stored response too
        assert whole.status == "incomplete" and server.client().responses.retrieve(
            whole.id, extra_query={"cache_salt": ns}).output == []


@pytest.mark.parametrize("kw, param, named", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type", "input_image"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "required": 3}}}},
     "text.format.schema", "schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id", "resp_missing"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input.0.call_id", "call_x"),
    ({"text": {"format": "json_object"}}, "text.format", "object"),
])
def test_refused_parameters_are_400s_naming_the_field(server, kw, param, named):
    kw.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as err:
        create(server, **kw)
    body = err.value.body
    assert body["param"].startswith(param) and named in body["message"]


def test_unknown_model_and_bad_key_shapes(server):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": [{"type": "reasoning"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
