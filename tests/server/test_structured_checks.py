"""The checks and rewrites of ``structured_outputs`` that need no server: vLLM's choice grammar and Lark test, and
``disable_additional_properties``' schema rewrite."""

from __future__ import annotations

import json

import pytest

from kvrelay.server.protocol import ApiError, ChatCompletionRequest
from kvrelay.server.structured_outputs import choice_grammar, is_lark, structured_of


def _structured(so: dict):
    return structured_of(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "structured_outputs": so}))


def test_choices_are_escaped_as_vllm_escapes_them():
    assert choice_grammar(['say "hi"', "a\\b", "two\nlines", "tab\tbell\x07"]) == (
        'root ::= "say \\"hi\\"" | "a\\\\b" | "two\\nlines" | "tab\\tbell\\u0007"')


@pytest.mark.parametrize(("grammar", "lark"), [("rule: 'abc'", True), ("rule ::= 'abc'", False),
                                               ("# a ::= comment\nstart: \"x\"", True),
                                               ("root ::= \"x\" // ::= after", False), ("", False)])
def test_a_grammar_is_lark_unless_a_line_defines_an_ebnf_rule(grammar, lark):
    assert is_lark(grammar) is lark


def test_disable_additional_properties_closes_the_objects_that_do_not_say():
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"a": {"type": "string"}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}}}
    closed = json.loads(_structured({"json": schema, "disable_additional_properties": True}).text)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True  # said: kept
    assert json.loads(_structured({"json": schema}).text) == schema  # without the option: as sent


def test_a_schema_past_the_size_limits_is_refused_before_anything_compiles():
    deep: dict = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ApiError) as err:
        _structured({"json": deep})
    assert err.value.param == "structured_outputs.json" and "too large" in err.value.message
