"""Constrained decoding (kvrelay.server.grammar) on the default tokenizer: whatever the logits, the output is a
valid call or JSON value, a stop token comes only when it is complete, and "auto" is free until the call marker."""

from __future__ import annotations

import json

import pytest
import torch
from jsonschema import Draft202012Validator

from kvrelay.server.grammar import constraint_for
from kvrelay.server.tool_protocol import FunctionDef, ResponseFormat
from kvrelay.server.tool_stream import ToolStream
from kvrelay.server.tools import ToolPlan, call_prefix
from kvrelay.weights.loader import load_tokenizer

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                              "city": {"type": "string", "maxLength": 12}},
             "required": ["unit", "city"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "required": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8},
                                                  "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                                                  "exact": {"type": "boolean"}},
                 "required": ["q", "exact"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def walk(tokenizer, constraint, seed: int, max_tokens: int = 400, scale: float = 3.0) -> tuple[str, bool]:
    """Sample under the mask from random logits: (the text, True when a stop token ended it)."""
    gen = torch.Generator().manual_seed(seed)
    mask, ids = constraint.new_mask(), []
    for _ in range(max_tokens):
        logits = mask.apply(torch.randn(tokenizer.vocab_size, generator=gen) * scale)
        token_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        mask.advance(token_id)
        if token_id in tokenizer.stop_ids:
            return tokenizer.decode(ids), True
        ids.append(token_id)
    return tokenizer.decode(ids), False


def allowed(tokenizer, mask) -> set[int]:
    return set(torch.isfinite(mask.apply(torch.zeros(tokenizer.vocab_size))).nonzero().flatten().tolist())


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_calls_follow_the_schema_whatever_the_logits(tokenizer, name, mode):
    plan = ToolPlan((FunctionDef(name="other"), FunctionDef(name="tool", parameters=SCHEMAS[name])), mode,
                    "tool" if mode == "named" else None, parallel=mode == "required")
    constraint = constraint_for(plan, None, tokenizer)
    validator = Draft202012Validator(SCHEMAS[name])
    for seed in range(4):
        text, stopped = walk(tokenizer, constraint, seed)
        assert stopped, f"no stop within the budget: {text!r}"
        stream = ToolStream(plan)
        stream.feed(text)
        _, done = stream.close("stop")
        assert done["finish_reason"] == "tool_calls" and done["text"] == "", text
        if mode == "named":
            assert [c["name"] for c in done["tool_calls"]] == ["tool"]
        for call in done["tool_calls"]:
            if call["name"] == "tool":
                validator.validate(json.loads(call["arguments"]))
            else:
                assert json.loads(call["arguments"]) == {}


def test_a_stop_token_only_once_the_call_is_complete(tokenizer):
    plan = ToolPlan((FunctionDef(name="tool", parameters=SCHEMAS["enum"]),), "required", parallel=False)
    mask = constraint_for(plan, None, tokenizer).new_mask()
    text = call_prefix("tool") + '{"unit": "celsius", "city": "Oslo"}}</tool_call>'
    for token_id in tokenizer.encode(text):
        assert not allowed(tokenizer, mask) & tokenizer.stop_ids
        assert token_id in allowed(tokenizer, mask)
        mask.advance(token_id)
    assert allowed(tokenizer, mask) <= tokenizer.stop_ids  # one call, not parallel: only the end is left


def test_parallel_calls_may_follow_on_a_new_line(tokenizer):
    plan = ToolPlan((FunctionDef(name="tool"),), "required", parallel=True)
    mask = constraint_for(plan, None, tokenizer).new_mask()
    for token_id in tokenizer.encode(call_prefix("tool") + "{}}</tool_call>"):
        mask.advance(token_id)
    now = allowed(tokenizer, mask)
    assert now & tokenizer.stop_ids and tokenizer.encode("\n")[0] in now
    assert all(i in tokenizer.stop_ids or tokenizer.decode([i]).startswith("\n") for i in now)


def test_auto_is_free_text_until_the_call_marker(tokenizer):
    plan = ToolPlan((FunctionDef(name="get_weather", parameters=SCHEMAS["enum"]),), "auto")
    mask = constraint_for(plan, None, tokenizer).new_mask()
    free = allowed(tokenizer, mask)
    assert len(free) > tokenizer.vocab_size // 2 and free & tokenizer.stop_ids  # text, or an answer that ends now
    special = tokenizer.token_to_id("<|im_start|>")
    assert special not in free  # special tokens other than the stop tokens: never under a grammar
    for token_id in tokenizer.encode("Sure. <tool_call>"):
        mask.advance(token_id)
    forced = call_prefix("get_weather")[len("<tool_call>"):]
    now = allowed(tokenizer, mask)
    assert now and all(forced.startswith(tokenizer.decode([i])) for i in now)


def test_response_format_json(tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "items": {"type": "array", "items": {"enum": ["a", "b"]},
                                                         "maxItems": 3}},
              "required": ["ok", "n", "items"], "additionalProperties": False}
    strict = constraint_for(None, ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": schema}}), tokenizer)
    any_object = constraint_for(None, ResponseFormat(type="json_object"), tokenizer)
    for seed in range(4):
        text, stopped = walk(tokenizer, strict, seed)
        assert stopped
        Draft202012Validator(schema).validate(json.loads(text))
        text, stopped = walk(tokenizer, any_object, seed, max_tokens=600, scale=1.0)
        assert isinstance(json.loads(text), dict) if stopped else text.startswith("{")
    assert constraint_for(None, ResponseFormat(type="text"), tokenizer) is None
    assert constraint_for(None, None, tokenizer) is None


def test_auto_tools_with_a_json_format_give_a_call_or_the_json_answer(tokenizer):
    """An agent with tools and a typed final answer (the Agents SDK's tools + output_type): each turn is either
    calls or JSON of the format, whatever the logits; plain text is neither."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False}
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
    plan = ToolPlan((FunctionDef(name="tool", parameters=SCHEMAS["enum"]),), "auto", parallel=False)
    constraint = constraint_for(plan, fmt, tokenizer)
    kinds = set()
    for seed in range(8):
        text, stopped = walk(tokenizer, constraint, seed)
        assert stopped, text
        stream = ToolStream(plan)
        stream.feed(text)
        _, done = stream.close("stop")
        if done["tool_calls"]:
            assert done["text"] == "" and done["finish_reason"] == "tool_calls"
            Draft202012Validator(SCHEMAS["enum"]).validate(json.loads(done["tool_calls"][0]["arguments"]))
            kinds.add("call")
        else:
            Draft202012Validator(answer).validate(json.loads(text))
            kinds.add("json")
    assert kinds == {"call", "json"}  # both branches are open
    free = allowed(tokenizer, constraint.new_mask())
    assert tokenizer.encode("Sure")[0] not in free


def test_without_the_grammar_library_a_request_that_needs_it_is_a_clear_400(tokenizer, monkeypatch):
    from kvrelay.server import grammar
    from kvrelay.server.protocol import ApiError

    monkeypatch.setattr(grammar, "xgr", None)
    with pytest.raises(ApiError) as err:
        constraint_for(None, ResponseFormat(type="json_object"), tokenizer)
    assert (err.value.status, err.value.param, err.value.code) == (400, "response_format", "unsupported")
    assert "kvrelay[tools]" in err.value.message
    assert constraint_for(None, None, tokenizer) is None  # plain text needs no grammar


@pytest.mark.parametrize("schema, reason", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "Cannot find field '$defs' in #/$defs/nope"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Invalid range: minimum greater than maximum"),
])
def test_a_schema_the_library_cannot_take_is_a_400_with_its_reason_alone(tokenizer, schema, reason):
    """The library's reason, without its log line's time and source file, and a JSON pointer kept whole once the
    error body's path redaction has run (it took "#/$defs/" for a directory)."""
    from kvrelay.server.protocol import ApiError, redact_paths

    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(ApiError) as err:
        constraint_for(None, fmt, tokenizer)
    message = redact_paths(err.value.message)
    assert message == f"response_format: this JSON schema cannot be used for constrained decoding: {reason}", message
