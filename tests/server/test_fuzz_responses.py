"""Hypothesis over near-valid /v1/responses bodies and chat bodies with tools: every item type, tools and schemas
at their boundaries (unsupported keywords, unresolvable and circular $refs, huge bounds, costly patterns, schemas
past the size limits), tool_choice and previous_response_id of every kind (another namespace's stored response
included), sent to the app in process. Never a 5xx; every 4xx is OpenAI's error JSON. Bounded (examples fixed,
derandomized, two tokens of output) to run in about a minute in CI."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvrelay.server.schema_limits import MAX_SCHEMA_DEPTH
from tests.server.inproc import MODEL, make_app
from tests.server.test_fuzz_requests import CHAT, CHAT_BASE, FUZZ, STRINGS, VALUE, WRONG, assert_no_5xx
from tests.server.test_schema_limits import deep_schema_text

RESPONSES = "/v1/responses"
OTHER_SALT = "fuzz-owner"  # the namespace whose stored response the fuzzed bodies name (never theirs)


_SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"a": {"type": "nope"}}}, {"type": "string"}, {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$ref": "#/$defs/missing"}, {"$ref": "http://example.com/schema.json"},
    {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
     "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**30}}},
    {"type": "object", "properties": {"n": {"type": "number", "minimum": 1e308, "maximum": -1e308}}},
    {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0}}},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=a)b"}}},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^([a-z]{1,50}){1,100}$"}}},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "[unclosed"}}},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 10**9, "maxLength": 2}}},
    {"type": "object", "properties": {"l": {"type": "array", "minItems": 5, "maxItems": 2}}},
    {"type": "object", "minProperties": 10**5}, {"type": "object", "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"e": {"enum": []}}}, {"type": "object", "properties": {"e": {"not": {}}}},
    {"type": "object", "properties": {"e": {"type": ["string", "null"], "format": "email"}}},
    {"type": "object", "properties": {"e": {"const": {"deep": [1, {"x": None}]}}}},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
    {"type": "object", "properties": {"\udfff": {"type": "string"}}}, {"type": "object", "title": "x" * 5000},
    {}, json.loads(deep_schema_text(MAX_SCHEMA_DEPTH // 2 - 1)), json.loads(deep_schema_text(200)),
]
# the values under test sit inside well-formed shapes (a name, a schema, an item out of a list of near-valid ones),
# so a body mostly gets past its shape to translation, tool planning and the grammar compile; a wholly wrong value
# (``VALUE``: wrong types, NaN, huge ints, surrogates) goes into one field of one body in four
SCHEMA = st.sampled_from(_SCHEMAS)
NAMES = ["f", "get_weather", "lookup", "f", "get_weather", "a b", "x" * 65, "", "\udfff", "f\x00", "<tool_call>",
         "ünïcode"]
NAME = st.sampled_from(NAMES)
TEXTS = st.sampled_from(STRINGS)
FLAT_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "function", "web_search"]),
                                   "name": NAME}, optional={"description": TEXTS, "parameters": SCHEMA,
                                            "strict": st.booleans()})
TOOL_CHOICE = st.sampled_from(["auto", "none", "required", "bogus", {"type": "function", "name": "f"},
                               {"type": "function"}, {"type": "web_search"}, {"type": "function", "name": "missing"}])
CALL_IDS = st.sampled_from(["c1", "c2", "", "\udfff"])
PARTS = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "text", "refusal", "input_image", "input_file"])},
    optional={"text": TEXTS, "refusal": TEXTS}), max_size=3)
ITEM = st.fixed_dictionaries({"type": st.sampled_from(
    ["message", "message", "function_call", "function_call", "function_call_output", "function_call_output",
     "reasoning", "item_reference", "computer_call", "\ud800"])}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "wizard"]),
    "content": st.one_of(TEXTS, PARTS), "call_id": CALL_IDS, "name": NAME,
    "arguments": st.sampled_from(['{"city": "Paris"}', "{", "", "[]"]), "output": st.one_of(TEXTS, PARTS)})
INPUT = st.one_of(st.lists(ITEM, min_size=1, max_size=4), TEXTS)
TEXT = st.fixed_dictionaries({"format": st.fixed_dictionaries(
    {"type": st.sampled_from(["json_schema", "json_schema", "json_object", "text", "xml"])},
    optional={"name": NAME, "schema": SCHEMA, "strict": st.booleans()})})
SMALL_COUNTS = st.sampled_from([0, -1, 1, 2, True, 2.0, "2", None, 10**30])  # no long generations
INCLUDE = st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "bogus",
                                    "\udfff"]), max_size=2)

RESPONSES_BASE = {"model": MODEL, "input": "What is 2+2?", "max_output_tokens": 2}
RESPONSES_STRUCTURED = {"input": INPUT, "tools": st.lists(FLAT_TOOL, max_size=3), "tool_choice": TOOL_CHOICE,
                        "text": TEXT, "include": INCLUDE, "stream": st.booleans(), "store": st.booleans(),
                        "parallel_tool_calls": st.booleans(), "instructions": TEXTS,
                        "metadata": st.dictionaries(TEXTS, TEXTS, max_size=3)}
RESPONSES_SCALARS = ["model", "input", "tools", "tool_choice", "text", "max_output_tokens", "top_logprobs",
                     "temperature", "top_p", "previous_response_id", "truncation", "background", "conversation",
                     "prompt", "max_tool_calls", "seed", "cache_salt", "kvrelay", "user", "reasoning", "metadata"]

CHAT_TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": NAME}, optional={"description": TEXTS, "parameters": SCHEMA, "strict": st.booleans()})})
CHAT_TOOL_CALL = st.fixed_dictionaries({"id": CALL_IDS, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": NAME, "arguments": st.sampled_from(["{}", "{", "[]"])})})
TOOL_MESSAGES = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.sampled_from([None, "ok"])},
                          optional={"tool_calls": st.lists(CHAT_TOOL_CALL, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": TEXTS}, optional={"tool_call_id": CALL_IDS}),
    st.just({"role": "user", "content": "and now?"})), min_size=1, max_size=4)
RESPONSE_FORMAT = st.fixed_dictionaries(
    {"type": st.sampled_from(["json_schema", "json_schema", "json_object", "text"])},
    optional={"json_schema": st.fixed_dictionaries({"name": NAME}, optional={"schema": SCHEMA,
                                                                             "strict": st.booleans()})})
CHAT_STRUCTURED = {"tools": st.lists(CHAT_TOOL, max_size=3),
                   "tool_choice": st.one_of(TOOL_CHOICE, st.just({"type": "function", "function": {"name": "f"}})),
                   "response_format": RESPONSE_FORMAT, "stream": st.booleans(), "parallel_tool_calls": st.booleans(),
                   "messages": TOOL_MESSAGES.map(lambda m: CHAT_BASE["messages"] + m)}
CHAT_SCALARS = ["tools", "tool_choice", "response_format", "messages", "n", "max_tokens", "seed", "temperature",
                "frequency_penalty", "presence_penalty", "logit_bias", "parallel_tool_calls"]
LOGIT_BIAS = st.dictionaries(st.integers(-3, 60000).map(str), VALUE, max_size=3)


def _body(draw, base: dict, structured: dict, scalars: list[str]) -> dict:
    body = dict(base)
    for name, values in structured.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    if draw(st.sampled_from([False, False, False, True])):
        name = draw(st.sampled_from(scalars))
        special = {"n": SMALL_COUNTS, "max_tokens": SMALL_COUNTS, "max_output_tokens": SMALL_COUNTS,
                   "top_logprobs": SMALL_COUNTS, "logit_bias": st.one_of(LOGIT_BIAS, VALUE)}
        body[name] = draw(special.get(name, st.one_of(VALUE, st.sampled_from(WRONG))))
    return body


@st.composite
def _responses_body(draw) -> dict:
    return _body(draw, RESPONSES_BASE, RESPONSES_STRUCTURED, RESPONSES_SCALARS)


@st.composite
def _chat_tools_body(draw) -> dict:
    return _body(draw, CHAT_BASE, CHAT_STRUCTURED, CHAT_SCALARS)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(default_max_tokens=2), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def other_id(client) -> str:
    """A response stored in another namespace than any fuzzed body's."""
    r = client.post(RESPONSES, json={**RESPONSES_BASE, "cache_salt": OTHER_SALT})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _check(client: TestClient, path: str, body: dict) -> None:
    sent = json.dumps(body)
    r = client.post(path, content=sent, headers={"content-type": "application/json"})
    if assert_no_5xx(r, sent):
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        last = r.text.rstrip()
        assert last.endswith("data: [DONE]") or "event: response.completed" in last \
            or "event: response.incomplete" in last or '"error"' in last, last[-500:]
    else:
        assert ("output" if path == RESPONSES else "choices") in r.json()


@FUZZ
@given(body=_responses_body(), name_other=st.sampled_from([False, False, False, True]))
def test_fuzz_responses_bodies(client, other_id, body, name_other):
    if name_other and "previous_response_id" not in body:
        body["previous_response_id"] = other_id
    _check(client, RESPONSES, body)
    if body.get("previous_response_id") == other_id and body.get("cache_salt") != OTHER_SALT:
        r = client.post(RESPONSES, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code != 200  # another namespace's stored response is never continued


@FUZZ
@given(body=_chat_tools_body())
def test_fuzz_chat_bodies_with_tools(client, body):
    _check(client, CHAT, body)


def test_another_namespace_s_response_is_the_same_error_as_an_unknown_one(client, other_id):
    answers = [client.post(RESPONSES, json={**RESPONSES_BASE, "previous_response_id": rid}).json()["error"]
               for rid in (other_id, "resp_" + "0" * 24)]
    assert [a["code"] for a in answers] == ["previous_response_not_found"] * 2
    assert answers[0]["message"].replace(other_id, "<id>") == answers[1]["message"].replace("resp_" + "0" * 24, "<id>")
    assert client.get(f"{RESPONSES}/{other_id}").status_code == 404
    assert client.delete(f"{RESPONSES}/{other_id}").status_code == 404
    assert client.get(f"{RESPONSES}/{other_id}", params={"cache_salt": OTHER_SALT}).status_code == 200


SCHEMA_SLOTS = {  # every near-valid schema reaches the checks and the compile, whatever the examples drawn above
    "chat response_format": lambda s: (CHAT, {**CHAT_BASE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
    "chat tool": lambda s: (CHAT, {**CHAT_BASE, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": s}}]}),
    "responses text.format": lambda s: (RESPONSES, {**RESPONSES_BASE, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": s}}}),
    "responses tool": lambda s: (RESPONSES, {**RESPONSES_BASE, "tool_choice": "required", "tools": [
        {"type": "function", "name": "f", "parameters": s}]}),
}


@pytest.mark.parametrize("slot", SCHEMA_SLOTS)
@pytest.mark.parametrize("schema", _SCHEMAS, ids=range(len(_SCHEMAS)))
def test_every_near_valid_schema_in_every_slot(client, slot, schema):
    _check(client, *SCHEMA_SLOTS[slot](schema))
