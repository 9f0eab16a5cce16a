"""Tools and structured output on /v1/chat/completions, through the official client against a real server
(random:tiny: the grammar alone makes its output a valid call or JSON value)."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from jsonschema import Draft202012Validator

from tests.server.conftest import MODEL
from tests.server.test_grammar import SCHEMAS

SYSTEM = {"role": "system", "content": "You answer weather questions."}
USER = {"role": "user", "content": "What is the weather in Paris?"}


def tool(name: str, schema: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool",
                                             "parameters": schema or SCHEMAS["enum"]}}


def ask(server, namespace: str | None = None, **kw):
    kw.setdefault("messages", [SYSTEM, USER])
    kw.setdefault("max_tokens", 300)
    kw.setdefault("seed", 1)
    extra = {"kvrelay": {"debug": True}, "cache_salt": namespace or uuid.uuid4().hex}
    return server.client().chat.completions.create(model=MODEL, extra_body=extra, **kw)


@pytest.mark.parametrize("name", SCHEMAS)
def test_required_and_named_calls_follow_the_schema(server, name):
    validator = Draft202012Validator(SCHEMAS[name])
    tools = [tool("other"), tool("target", SCHEMAS[name])]
    for seed, choice in [(1, "required"), (2, "required"), (3, {"type": "function", "function": {"name": "target"}})]:
        r = ask(server, tools=tools, tool_choice=choice, seed=seed)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
        calls = choice0.message.tool_calls
        assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["target"]
        for c in calls:
            validator.validate(json.loads(c.function.arguments)) if c.function.name == "target" else \
                Draft202012Validator(SCHEMAS["enum"]).validate(json.loads(c.function.arguments))


def test_parallel_tool_calls_false_gives_one_call(server):
    for seed in range(1, 4):
        r = ask(server, tools=[tool("a", SCHEMAS["required"]), tool("b")], tool_choice="required",
                parallel_tool_calls=False, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_streamed_tool_call_deltas_rebuild_the_answer(server):
    kw = {"tools": [tool("get_weather")], "tool_choice": "required", "seed": 5, "parallel_tool_calls": False}
    whole = ask(server, **kw).choices[0].message.tool_calls[0]
    chunks = list(ask(server, stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    head, rest = pieces[0], pieces[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(rest) >= 2 and all(p.id is None and p.function.name is None and p.index == 0 for p in rest)
    assert "".join(p.function.arguments for p in rest) == whole.function.arguments
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens > 0


def test_tools_change_the_prompt(server):
    plain = ask(server, max_tokens=2)
    with_tools = ask(server, max_tokens=2, tools=[tool("get_weather")], tool_choice="auto")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 40


def _prompt_text(server, response) -> str:
    from kvrelay.weights.loader import load_tokenizer

    return load_tokenizer().decode(response.model_extra["kvrelay"]["debug"]["prompt_ids"], skip_special_tokens=False)


def test_tool_history_is_rendered(server):
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"unit": "celsius", "city": "Paris"}'}}
    history = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 21 C"}]
    r = ask(server, messages=history, max_tokens=2, tools=[tool("get_weather")])
    text = _prompt_text(server, r)
    assert ('<tool_call>{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}</tool_call>'
            in text)
    assert '<tool_response name="get_weather">\nSunny, 21 C\n</tool_response>' in text
    without = ask(server, messages=[SYSTEM, USER], max_tokens=2, tools=[tool("get_weather")])
    assert r.usage.prompt_tokens > without.usage.prompt_tokens + 20


def test_a_json_format_beside_tools_is_shown_in_the_prompt(server):
    # the grammar lets an "auto" turn be calls or JSON of the format: a model never told the answer's form keeps
    # calling tools (the Agents SDK's tools + output_type agent looped on SmolLM2); the text is the same in every
    # tool mode, so a step forced to call and the next one under "auto" share the system prompt's KV
    schema = {"type": "object", "properties": {"temperature_c": {"type": "integer"}}, "required": ["temperature_c"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    for choice in ("auto", "required", "none"):
        text = _prompt_text(server, ask(server, max_tokens=2, tools=[tool("get_weather")], tool_choice=choice,
                                        response_format=fmt))
        assert json.dumps(schema) in text, choice


def call_then_answer(server, **answer_kw):
    """One tool loop in a fresh namespace: a forced call of get_weather, then a step that reads its result."""
    namespace = uuid.uuid4().hex
    tools = [tool("get_weather")]
    first = ask(server, namespace, tools=tools, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    return first, ask(server, namespace, messages=history, tools=tools, max_tokens=8, **answer_kw)


def test_a_tool_loop_reuses_the_generated_call(server):
    first, second = call_then_answer(server)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    refs = second.model_extra["kvrelay"]["debug"]["refs"]
    spliced = [r for r in refs if r["kind"] == "output"]
    # the call's text is the first step's generated ids, and its decode KV is what step two reads
    assert spliced and spliced[0]["end"] - spliced[0]["start"] == first.usage.completion_tokens


def _rebuilt(chunks) -> tuple[str | None, list[tuple[str, str, str]]]:
    """A chat stream's content (None while no delta has any) and calls, as a client accumulates them."""
    content, calls = None, {}
    for piece in (ch.choices[0].delta for ch in chunks if ch.choices):
        if piece.content is not None:
            content = (content or "") + piece.content
        for tc in piece.tool_calls or []:
            call = calls.setdefault(tc.index, [tc.id, tc.function.name, ""])
            call[2] += tc.function.arguments or ""
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("max_tokens", [12, 22, 30])
def test_a_call_cut_by_max_tokens_streams_as_it_answers(server, max_tokens):
    """Cut before its name the call is nothing (the turn is calls only: content null, streamed too); after it, the
    answer reports the call the stream announced, with its arguments so far: the stream never shows a call the
    answer lacks, or its text."""
    kw = {"tools": [tool("get_weather")], "tool_choice": "required", "max_tokens": max_tokens}
    r = ask(server, **kw).choices[0]
    assert r.finish_reason == "length" and r.message.content is None
    chunks = list(ask(server, stream=True, **kw))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    calls = [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []]
    content, streamed = _rebuilt(chunks)
    assert content is None and [(name, args) for _, name, args in streamed] == calls
    if max_tokens == 30:  # past the call's name (on random:tiny's tokenizer)
        assert calls and calls[0][0] == "get_weather"
    if max_tokens == 12:  # before it: no call, and still no content
        assert not calls


@pytest.mark.parametrize("stop", [["celsius", "fahrenheit"], ["</tool_call>"]])
def test_a_call_a_stop_string_cuts_streams_as_it_answers(server, stop):
    """A stop string matches wherever the text does, inside a forced call too: cut in its arguments, the answer is
    the announced call with its arguments so far and finish_reason "stop"; cut at its closing tag, a whole call."""
    kw = {"tools": [tool("get_weather")], "tool_choice": "required", "parallel_tool_calls": False, "stop": stop}
    r = ask(server, **kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in r.message.tool_calls]
    assert r.message.content is None and [name for name, _ in calls] == ["get_weather"]
    if stop == ["</tool_call>"]:
        assert r.finish_reason == "tool_calls" and set(json.loads(calls[0][1])) == {"unit", "city"}
    else:
        assert r.finish_reason == "stop" and calls[0][1].endswith('"')  # cut before the enum's value
    chunks = list(ask(server, stream=True, **kw))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.finish_reason]
    content, streamed = _rebuilt(chunks)
    assert content is None and [(name, args) for _, name, args in streamed] == calls


def test_response_format_json_schema_and_json_object(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "why": {"type": "string", "maxLength": 12}},
              "required": ["ok", "n", "why"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    for seed in range(1, 4):
        r = ask(server, response_format=fmt, seed=seed).choices[0]
        assert r.finish_reason == "stop"
        Draft202012Validator(schema).validate(json.loads(r.message.content))
    r = ask(server, response_format={"type": "json_object"}, seed=1, max_tokens=600, temperature=0.7).choices[0]
    assert r.finish_reason == "stop" and isinstance(json.loads(r.message.content), dict)


@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [tool("a", {"type": "object", "properties": {"x": {"type": "nope"}}})]},
     "tools.0.function.parameters"),
    ({"tools": [tool("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}},
     "tool_choice.function.name"),
    ({"tools": [tool("a"), tool("a")]}, "tools.1.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tool_choice": "sometimes", "tools": [tool("a")]}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [SYSTEM, USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages.2.tool_call_id"),
])
def test_bad_tool_and_format_parameters_are_a_400_naming_the_field(server, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        ask(server, **kw)
    body = err.value.body
    assert err.value.status_code == 400 and (body["param"] or "").startswith(param), body


def test_the_deprecated_functions_api_is_refused(server):
    with pytest.raises(openai.BadRequestError) as err:
        ask(server, functions=[{"name": "f", "parameters": {"type": "object"}}])
    assert err.value.body["param"] == "functions"
