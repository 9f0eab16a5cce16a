"""JSON schemas too deep, too large or with too costly a pattern are a 400 naming the schema, before jsonschema
(a deep schema was a RecursionError: a 500) and before the grammar compiler (a schema of 5000 optional properties
held a thread for minutes): on /v1/chat/completions (tools, response_format) and /v1/responses (tools,
text.format)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

import kvrelay.server.schemas as schemas
from kvrelay.server.pattern_limits import MAX_NESTED_REPEAT, MAX_PATTERN_REPEAT, pattern_problem
from kvrelay.server.protocol import ApiError
from kvrelay.server.schema_limits import (
    MAX_PROPERTY_PAIRS,
    MAX_REQUEST_SCHEMA_NODES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    MAX_TOOLS,
    SchemaSize,
    check_request_schemas,
)
from tests.server.inproc import MODEL, make_app

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"


def deep_schema_text(num_levels: int) -> str:
    """An object schema ``num_levels`` objects deep, as JSON text (Python's json module cannot write it)."""
    return ('{"type":"object","properties":{"a":' * num_levels + '{"type":"string"}'
            + '},"required":["a"]}' * num_levels)


def objects(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(num_properties)}}


# where a schema goes: (path, body text with the schema's JSON text at {}, the param a 400 names)
SLOTS = {
    "chat response_format": (CHAT, '{"model":"%s","max_tokens":2,"messages":[{"role":"user","content":"hi"}],'
                                   '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{}}}}',
                             "response_format.json_schema.schema"),
    "chat tool": (CHAT, '{"model":"%s","max_tokens":2,"messages":[{"role":"user","content":"hi"}],'
                        '"tools":[{"type":"function","function":{"name":"f","parameters":{}}}]}',
                  "tools.0.function.parameters"),
    "responses text.format": (RESPONSES, '{"model":"%s","max_output_tokens":2,"input":"hi","text":{"format":'
                                         '{"type":"json_schema","name":"x","schema":{}}}}', "text.format.schema"),
    "responses tool": (RESPONSES, '{"model":"%s","max_output_tokens":2,"input":"hi",'
                                  '"tools":[{"type":"function","name":"f","parameters":{}}]}', "tools.0.parameters"),
}
# each just past one limit (so that, were the limit missing, the compile would still end soon)
TOO_BIG = {
    "deep": deep_schema_text(MAX_SCHEMA_DEPTH),
    "optional properties": json.dumps(objects(math.isqrt(MAX_PROPERTY_PAIRS) + 1)),
    "values": json.dumps({"type": "object", "properties": {"unit": {"enum": list(range(MAX_SCHEMA_NODES))}}}),
    "nested counts": json.dumps({"type": "object", "properties": {"host": {
        "type": "string", "pattern": f"^([a-z]{{1,8}}\\.){{1,{MAX_NESTED_REPEAT // 8 + 1}}}[a-z]{{2,6}}$"}}}),
    "one count": json.dumps({"type": "object", "properties": {"s": {
        "type": "string", "pattern": f"^[a-z]{{0,{MAX_PATTERN_REPEAT + 1}}}$"}}}),
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(default_max_tokens=2), raise_server_exceptions=False) as c:
        yield c



def post(client: TestClient, path: str, text: str):
    return client.post(path, content=text, headers={"content-type": "application/json"})


@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("shape", TOO_BIG)
def test_a_schema_past_a_limit_is_a_400_naming_it_and_is_never_compiled(client, compiled, slot, shape):
    path, body, param = SLOTS[slot]
    r = post(client, path, body.replace("%s", MODEL).replace("{}}", TOO_BIG[shape] + "}", 1))
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and "too large to compile" in err["message"], err
    assert compiled == []


def test_a_deep_schema_within_the_limit_is_served(client, compiled):
    path, body, _ = SLOTS["chat response_format"]
    # each level is two nestings (the object, its properties) and the string schema one more
    r = post(client, path, body.replace("%s", MODEL).replace("{}}", deep_schema_text(MAX_SCHEMA_DEPTH // 2 - 1) + "}"))
    assert r.status_code == 200, r.text[:300]
    assert len(compiled) == 1


def test_the_request_s_schemas_count_together(client, compiled):
    """Each tool is within the limits; all of them together are over MAX_PROPERTY_PAIRS (one grammar): the 400
    names the tool where the sum passed it."""
    num_tools = 2  # two tools each a little over half the limit: the prompt stays within the context
    num_properties = math.isqrt(MAX_PROPERTY_PAIRS // num_tools) + 1
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": objects(num_properties)}}
             for i in range(num_tools)]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    r = post(client, CHAT, json.dumps(body))
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == f"tools.{num_tools - 1}.function.parameters"
    assert compiled == []
    r = post(client, CHAT, json.dumps({**body, "tools": tools[:-1]}))
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("pattern", [r"^(\d{1,3}\.){3}\d{1,3}$", r"^\d{4}-\d{2}-\d{2}$", r"^.{1,200}$",
                                     "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                                     r"[\]{5000}]+", rf"^[a-z]{{{MAX_PATTERN_REPEAT}}}$",
                                     rf"^(a{{{MAX_PATTERN_REPEAT}}})+$", "((a{2}){2}){4}"])
def test_common_patterns_are_within_the_limits(pattern):
    assert pattern_problem(pattern) is None


@pytest.mark.parametrize("pattern", [rf"^[a-z]{{0,{MAX_PATTERN_REPEAT + 1}}}$", "a{" + "9" * 5000 + "}",
                                     f"((a{{2}}){{4}}){{{MAX_NESTED_REPEAT // 8 + 1}}}", r"(\w{1,10}){7,}x{1,7}",
                                     f"((a{{1,{MAX_NESTED_REPEAT}}}))*{{1,2}}", "(?:b|a{1,9}){1,9}"])
def test_costly_patterns_are_refused(pattern):
    assert pattern_problem(pattern) is not None


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_more_tools_than_openai_allows_is_a_400_naming_tools(client, compiled, path):
    tools = [{"name": f"t{i}", "parameters": {"type": "object"}} for i in range(MAX_TOOLS + 1)]
    if path == CHAT:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": t} for t in tools]}
    else:
        body = {"model": MODEL, "max_output_tokens": 2, "input": "hi", "tools": [{"type": "function", **t}
                                                                                 for t in tools]}
    r = post(client, path, json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text[:300]
    assert compiled == []


class _RecordingValidator:
    """jsonschema's validator class, recording whether each schema check ran on the event loop's thread."""

    on_event_loop: list[bool] = []

    @classmethod
    def check_schema(cls, schema):
        try:
            asyncio.get_running_loop()
            cls.on_event_loop.append(True)
        except RuntimeError:
            cls.on_event_loop.append(False)
        return Draft202012Validator.check_schema(schema)

    def __new__(cls, *args, **kw):
        return Draft202012Validator(*args, **kw)


@pytest.mark.parametrize("slot", SLOTS)
def test_schemas_are_validated_off_the_event_loop(client, monkeypatch, slot):
    """jsonschema's check takes about 0.1 s per schema of 1000 values: on the event loop, which answers every
    tenant's requests and streams, a request of many tools would stall all of them."""
    monkeypatch.setattr(schemas, "Draft202012Validator", _RecordingValidator)
    monkeypatch.setattr(_RecordingValidator, "on_event_loop", [])
    path, body, _ = SLOTS[slot]
    schema = objects(3 + list(SLOTS).index(slot))  # one per slot: a namespace's repeat takes its compiled grammar
    r = post(client, path, body.replace("%s", MODEL).replace("{}}", json.dumps(schema) + "}", 1))
    assert r.status_code == 200, r.text[:300]
    assert _RecordingValidator.on_event_loop == [False]


class _CreatePullRequest(BaseModel):  # a GitHub MCP server's tool, as FastMCP makes its arguments' schema (pydantic)
    owner: str = Field(description="Repository owner (user or organization)")
    repo: str = Field(description="Repository name")
    title: str = Field(description="Pull request title")
    body: str | None = Field(None, description="Pull request description")
    head: str = Field(description="The branch containing the changes")
    base: str = Field(description="The branch to merge into")
    draft: bool = Field(False, description="Create as a draft pull request")
    maintainer_can_modify: bool = Field(True, description="Allow maintainers to push to the branch")


def test_as_many_framework_tools_as_openai_allows_are_within_the_limits():
    """128 tools of eight arguments, with the title and description pydantic and MCP servers give every property:
    the annotations are text the grammar never sees, and no limit counts them against a request's tools."""
    schema = _CreatePullRequest.model_json_schema()
    check_request_schemas([schema] * MAX_TOOLS, None)
    # with room: an answer's schema of a thousand values beside them (a typed final answer)
    check_request_schemas([schema] * MAX_TOOLS, enum_of(1000))


def enum_of(num_values: int) -> dict:
    """A schema of ``num_values`` JSON values: itself, its enum list and the enum's values."""
    return {"enum": list(range(num_values - 2))}


def test_one_schema_and_the_request_s_schemas_have_their_own_value_limits():
    """One schema holds at most MAX_SCHEMA_NODES values; a request's schemas together twice as many (128 tools of
    a typical server's size fit), the 400 naming the schema where the sum passed the limit."""
    check_request_schemas([enum_of(MAX_SCHEMA_NODES)], None)
    with pytest.raises(ApiError) as err:
        check_request_schemas([enum_of(MAX_SCHEMA_NODES + 1)], None)
    assert err.value.param == "tools.0.function.parameters" and "in one schema" in err.value.message
    per_tool = MAX_SCHEMA_NODES * 3 // 4
    num_fit = MAX_REQUEST_SCHEMA_NODES // per_tool
    check_request_schemas([enum_of(per_tool)] * num_fit, None)
    with pytest.raises(ApiError) as err:
        check_request_schemas([enum_of(per_tool)] * num_fit, enum_of(per_tool))
    assert err.value.param == "response_format.json_schema.schema" and "together" in err.value.message


def test_the_depth_message_states_the_rule_it_applies():
    """The message says how levels are counted and how many nested object properties fit: exactly as many as
    ``SchemaSize`` lets through."""
    fits = MAX_SCHEMA_DEPTH // 2 - 1
    SchemaSize().add(json.loads(deep_schema_text(fits)), "p")
    with pytest.raises(ApiError) as err:
        SchemaSize().add(json.loads(deep_schema_text(fits + 1)), "p")
    assert f"more than {MAX_SCHEMA_DEPTH} levels deep" in err.value.message
    assert '"properties" and the property\'s schema' in err.value.message
    assert f"so {fits} objects nested as properties" in err.value.message
