"""``tool_choice: "none"``: the tools stay in the prompt exactly as under "auto" (OpenAI's and vLLM's semantics), and
the answer is a plain message that never holds a tool call: the grammar keeps ``<tool_call>`` out of its text."""

from __future__ import annotations

import json
import uuid

import pytest
from jsonschema import Draft202012Validator

from kvrelay.server import grammar
from kvrelay.server.grammar import constraint_for
from kvrelay.server.protocol import ApiError, ChatCompletionRequest
from kvrelay.server.tool_protocol import FunctionDef, ResponseFormat
from kvrelay.server.tool_stream import ToolStream
from kvrelay.server.tools import CALL_OPEN, ToolPlan, call_text, plan_tools
from kvrelay.weights.loader import load_tokenizer
from tests.server.conftest import SMOL
from tests.server.test_grammar import SCHEMAS, allowed, walk
from tests.server.test_responses_api import WEATHER as RESPONSES_WEATHER
from tests.server.test_responses_api import create
from tests.server.test_tools import USER, ask, call_then_answer, tool

needs_grammar = pytest.mark.skipif(grammar.xgr is None, reason="needs the tools extra (xgrammar)")
NONE_PLAN = ToolPlan((FunctionDef(name="get_weather", parameters=SCHEMAS["enum"]),), "none")
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# ---------------------------------------------------------------------- plan and parser
def test_none_plans_the_tools_as_shown_and_uncallable():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], "tools": [tool("get_weather")],
                                                 "tool_choice": "none"})
    plan = plan_tools(body)
    assert plan is not None and plan.mode == "none" and [f.name for f in plan.functions] == ["get_weather"]
    assert not plan.may_call and plan.callable_names == ()


def test_the_stream_reads_no_call_under_none():
    # a server without the grammar library decodes "none" unconstrained: a call's text is then content
    text = "Here: " + call_text("get_weather", '{"unit": "celsius", "city": "Paris"}')
    stream = ToolStream(NONE_PLAN)
    events = [e for at in range(0, len(text), 4) for e in stream.feed(text[at : at + 4])]  # pieces, as decoded
    assert all("tool_call" not in e for e in events) and "".join(e["text"] for e in events) == text
    _, done = stream.close("stop")
    assert done == {"text": text, "text_runs": [(0, text)], "tool_calls": [], "cut_call": None,
                    "finish_reason": "stop"}


# ---------------------------------------------------------------------- grammar
@needs_grammar
def test_none_is_free_text_that_never_opens_a_call(tokenizer):
    mask = constraint_for(NONE_PLAN, None, tokenizer).new_mask()
    free = allowed(tokenizer, mask)
    assert len(free) > tokenizer.vocab_size // 2 and free & tokenizer.stop_ids
    said = "Sure <tool_"
    for token_id in tokenizer.encode(said):
        mask.advance(token_id)
    now = allowed(tokenizer, mask)
    opener = CALL_OPEN[:-1]  # "<tool_call": the opener, and lookalikes such as <tool_call name="f">, are out
    closing = [i for i in range(tokenizer.vocab_size) if opener in said + tokenizer.decode([i])]
    assert closing and not now & set(closing)  # no token completes the opener
    assert len(now) > tokenizer.vocab_size // 2  # anything else goes on


@needs_grammar
def test_none_with_a_json_format_gives_that_json(tokenizer):
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    constraint = constraint_for(NONE_PLAN, fmt, tokenizer)
    for seed in range(3):
        text, stopped = walk(tokenizer, constraint, seed)
        assert stopped, text
        Draft202012Validator(ANSWER).validate(json.loads(text))


def test_without_the_grammar_library_none_is_unconstrained_and_a_format_still_a_400(tokenizer, monkeypatch):
    monkeypatch.setattr(grammar, "xgr", None)
    assert constraint_for(NONE_PLAN, None, tokenizer) is None
    with pytest.raises(ApiError) as err:
        constraint_for(NONE_PLAN, ResponseFormat(type="json_object"), tokenizer)
    assert (err.value.status, err.value.param, err.value.code) == (400, "response_format", "unsupported")
    with pytest.raises(ApiError) as err:  # "auto" still needs the grammar
        constraint_for(ToolPlan(NONE_PLAN.functions, "auto"), None, tokenizer)
    assert err.value.param == "tools"


# ---------------------------------------------------------------------- server (random:tiny)
def _prompt_ids(response) -> list[int]:
    return response.model_extra["kvrelay"]["debug"]["prompt_ids"]


@pytest.mark.parametrize("response_format", [None, {"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": ANSWER}}])
def test_none_renders_the_same_prompt_as_auto(server, response_format):
    kw = {"tools": [tool("get_weather")], "max_tokens": 2}
    if response_format is not None:
        kw["response_format"] = response_format
    auto = ask(server, tool_choice="auto", **kw)
    none = ask(server, tool_choice="none", **kw)
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens and _prompt_ids(none) == _prompt_ids(auto)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_a_required_step_then_none_reuses_the_whole_previous_prompt(server):
    first, second = call_then_answer(server, tool_choice="none")
    assert _prompt_ids(second)[: first.usage.prompt_tokens] == _prompt_ids(first)  # an exact prefix
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    message = second.choices[0].message
    assert message.tool_calls is None and CALL_OPEN not in (message.content or "")


def test_responses_none_keeps_the_tools_and_the_prefix(server):
    namespace = uuid.uuid4().hex
    auto = create(server, input="Weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice="auto")
    none = create(server, input="Weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice="none")
    assert none.usage.input_tokens == auto.usage.input_tokens
    r1 = create(server, input="Weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=60, salt=namespace)
    call = next(o for o in r1.output if o.type == "function_call")
    r2 = create(server, previous_response_id=r1.id, tools=[RESPONSES_WEATHER], tool_choice="none", salt=namespace,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees, sunny"}])
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    assert [o.type for o in r2.output] == ["message"] and CALL_OPEN not in r2.output_text


# ---------------------------------------------------------------------- a real model that calls under "auto"
def _calling_conversation() -> list[dict]:
    """Two earlier turns where the assistant called get_weather: SmolLM2 then calls it again under "auto"."""
    messages = [{"role": "system", "content": "You answer weather questions. Always call get_weather first."}]
    for i, city in enumerate(["Paris", "Rome"]):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": "Sunny, 21 C"},
                     {"role": "assistant", "content": f"It is sunny and 21 C in {city}."}]
    return messages + [{"role": "user", "content": "What is the weather in Berlin?"}]


@pytest.mark.slow
@needs_grammar
def test_smollm2_calls_under_auto_and_answers_in_text_under_none(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    kw = {"model": SMOL, "messages": _calling_conversation(), "tools": [tool("get_weather", schema)],
          "temperature": 0, "max_tokens": 60}
    client = smol.client()
    auto = client.chat.completions.create(tool_choice="auto", extra_body={"cache_salt": uuid.uuid4().hex}, **kw)
    assert auto.choices[0].finish_reason == "tool_calls"  # the precondition: this prompt makes the model call
    none = client.chat.completions.create(tool_choice="none", extra_body={"cache_salt": uuid.uuid4().hex}, **kw)
    answer = none.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content and CALL_OPEN not in answer.message.content
    chunks = list(client.chat.completions.create(tool_choice="none", stream=True,
                                                 extra_body={"cache_salt": uuid.uuid4().hex}, **kw))
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer.message.content
