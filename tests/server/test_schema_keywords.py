"""JSON-schema keywords the grammar does not enforce are a 400 naming the keyword and where it is when the schema
asks for a guarantee (``strict: true``, ``structured_outputs.json``), and without ``strict`` the same schema is
served, as OpenAI serves it (the grammar enforces the rest); keywords it enforces compile. Each row is checked
against the installed xgrammar both ways: a refused schema's grammar accepts a value that breaks the schema (so the
refusal is needed), an accepted keyword's grammar rejects a value that breaks it (so it is enforced), with no
warning from the library."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import referencing.exceptions
from jsonschema import Draft202012Validator
from starlette.testclient import TestClient

from kvrelay.server.grammar import json_format
from kvrelay.server.protocol import ApiError
from kvrelay.server.schema_keywords import ignored_in_pattern
from kvrelay.server.schemas import check_schema
from tests.server.inproc import MODEL, make_app
from tests.server.test_schema_limits import CHAT, SLOTS, post

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

OBJ = {"type": "object"}
INTS = {"type": "array", "items": {"type": "integer"}}


def props(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


def breaks(schema: dict, text: str) -> bool:
    """Whether the value ``text`` holds breaks ``schema`` (jsonschema asserts no ``format``: a format row's value is
    one no such string can be; a reference outside the schema, which the grammar reads as any value, is unknown)."""
    try:
        return "format" in json.dumps(schema) or not Draft202012Validator(schema).is_valid(json.loads(text))
    except referencing.exceptions.Unresolvable:
        return True


def accepts(schema: dict, text: str) -> bool:
    """Whether the grammar the server compiles for ``schema`` (kvrelay.server.grammar.json_format) takes ``text``."""
    grammar = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": json_format(schema)}))
    return _is_grammar_accept_string(grammar, text)


# name: (schema, what the 400 names, its place, a value that breaks the schema and the grammar takes)
REFUSED = {
    "allOf of two": ({**OBJ, "allOf": [props(a={"type": "integer"}), props(b={"type": "string"})]},
                     '"allOf" of 2 schemas', "#", '"x"'),
    "not": (props(v={"not": {"type": "string"}}), '"not"', "#/properties/v", '{"v":"s"}'),
    "if/then": ({**props(a={"type": "integer"}, b={"type": "integer"}), "required": ["a"],
                 "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '"if"', "#", '{"a":1}'),
    "dependentRequired": ({**props(a={"type": "integer"}, b={"type": "integer"}), "required": ["a"],
                           "dependentRequired": {"a": ["b"]}}, '"dependentRequired"', "#", '{"a":1}'),
    "dependentSchemas": ({**props(a={"type": "integer"}, b={"type": "integer"}), "required": ["a"],
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '"dependentSchemas"', "#", '{"a":1}'),
    "uniqueItems": (props(v={**INTS, "uniqueItems": True}), '"uniqueItems"', "#/properties/v", '{"v":[1,1]}'),
    "contains": (props(v={**INTS, "contains": {"const": 7}}), '"contains"', "#/properties/v", '{"v":[1]}'),
    "patternProperties": ({**OBJ, "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False,
                           "minProperties": 2}, '"patternProperties"', "#", '{"x_":1,"x_":2}'),
    "minProperties beside additionalProperties": (
        {**OBJ, "additionalProperties": {"type": "integer"}, "minProperties": 2}, '"minProperties"', "#",
        '{"a":1,"a":1}'),
    "minProperties beside propertyNames": ({**OBJ, "propertyNames": {"pattern": "^[a-z]+$"}, "minProperties": 2},
                                           '"minProperties"', "#", '{"a":1,"a":1}'),
    "remote $ref": (props(a={"$ref": "https://example.com/s.json"}), "'https://example.com/s.json'",
                    "#/properties/a", '{"a":"x"}'),
    "anchor $ref": ({"$defs": {"P": {"$anchor": "p", "type": "integer"}}, "$ref": "#p"}, "'#p'", "#", '"x"'),
    "$dynamicRef": ({"$dynamicAnchor": "m", **OBJ, "properties": {"n": {"$dynamicRef": "#m"}}}, '"$dynamicRef"',
                    "#/properties/n", '{"n":1}'),
    "pattern with minLength": (props(v={"type": "string", "pattern": "^[0-9]+$", "minLength": 3, "maxLength": 4}),
                               '"pattern" together with "minLength"', "#/properties/v", '{"v":"12345"}'),
    "format with maxLength": (props(u={"type": "string", "format": "uri", "maxLength": 12}),
                              '"format" together with "maxLength"', "#/properties/u",
                              '{"u":"http://example.com/abcdef"}'),
    "lookahead": (props(v={"type": "string", "pattern": "^(?!b)[ab]+$"}), "lookaround", "#/properties/v",
                  '{"v":"ba"}'),
    "anchor inside a pattern": ({"type": "string", "pattern": "a^b"}, "anchor ^", "#", '"ab"'),
    "multipleOf on numbers": ({"type": "number", "multipleOf": 0.5}, '"multipleOf"', "#", "0.3"),
    "fractional multipleOf on integers": ({"type": "integer", "multipleOf": 2.5}, '"multipleOf"', "#", "3"),
    "minLength without type": ({"minLength": 2}, '"minLength" without "type"', "#", '"a"'),
    "minimum without type": ({"minimum": 2}, '"minimum" without "type"', "#", "1"),
    "format the grammar does not know": ({"type": "string", "format": "iri"}, "'iri'", "#", '" %% "'),
    "required not in properties": ({**OBJ, "required": ["a"], "additionalProperties": {"type": "integer"}},
                                   "'a'", "#", "{}"),
    "type beside anyOf": ({"type": "object", "anyOf": [{"type": "integer"}, OBJ]}, '"type" beside "anyOf"', "#",
                          "1"),
    "required beside anyOf": ({**props(a={"type": "integer"}), "anyOf": [{"required": ["a"]}]},
                              '"type" beside "anyOf"', "#", '{}'),
    "keywords beside allOf": ({**props(a={"type": "integer"}), "allOf": [props(b={"type": "integer"})]},
                              '"type" beside "allOf"', "#", '{"b":1}'),
    "minimum beside $ref": ({"$defs": {"P": {"type": "integer"}}, "$ref": "#/$defs/P", "minimum": 5},
                            '"minimum" beside "$ref"', "#", "1"),
    "overlapping oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, '"oneOf" branches 0 and 1', "#",
                          "1"),
    "oneOf of equal fixed values": ({"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]}, '"oneOf" branches 0 and 1', "#",
                                    "1"),
    "oneOf of many branches": ({"oneOf": [{"type": "integer"}] + [{"const": f"s{i}"} for i in range(200)]},
                               '"oneOf" has 201 branches', "#", None),
    "enum value of another type": ({"type": "string", "enum": ["a", 1]}, '"enum" value 1', "#", "1"),
    "enum value too short": ({"type": "string", "enum": ["a", "abc"], "minLength": 2}, '"enum" value "a"', "#",
                             '"a"'),
    "propertyNames a property breaks": ({**props(ABC={"type": "integer"}), "additionalProperties": {"type": "integer"},
                                         "propertyNames": {"pattern": "^[a-z]+$"}}, "'ABC'", "#", '{"ABC":1}'),
    "unknown keyword": (props(v={"type": "string", "nullable": True}), '"nullable"', "#/properties/v", None),
    "$id below the root": (props(v={"$id": "https://x/v", "type": "string"}), '"$id"', "#/properties/v", None),
    "in $defs": ({"$defs": {"P": {**INTS, "uniqueItems": True}}, "$ref": "#/$defs/P"}, '"uniqueItems"', "#/$defs/P",
                 "[1,1]"),
    "in a branch": ({"anyOf": [{"type": "null"}, {**INTS, "contains": {"const": 1}}]}, '"contains"', "#/anyOf/1",
                    "[2]"),
    "under a key with a slash": (props(**{"a/b": {"not": {}}}), '"not"', "#/properties/a~1b", None),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_keyword_the_grammar_does_not_enforce_is_a_400_naming_it_and_its_place(name):
    schema, what, where, breaking = REFUSED[name]
    with pytest.raises(ApiError) as err:
        check_schema(schema, "response_format.json_schema.schema", strict=True)
    e = err.value
    assert e.status == 400 and e.param == "response_format.json_schema.schema" and e.code == "invalid_value"
    assert what in e.message and f"(at {where} in the schema)" in e.message, e.message
    if breaking is not None:  # the refusal is needed: the installed library's grammar writes a breaking value
        assert breaks(schema, breaking) and accepts(schema, breaking)


PYDANTIC_URL = {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}  # HttpUrl, AnyUrl


@pytest.mark.parametrize(("schema", "advice", "not_advised"), [
    ({"type": "string", "pattern": "^[0-9]+$", "maxLength": 4}, "write the length into the pattern ({m,n})", None),
    (PYDANTIC_URL, "drop the length, or write a pattern with the length in it", "write the length into the pattern"),
])
def test_a_length_beside_a_pattern_or_format_is_refused_with_advice_that_fits(schema, advice, not_advised):
    with pytest.raises(ApiError) as err:
        check_schema(schema, "tools.0.function.parameters", strict=True)
    assert advice in err.value.message and "Without tools.0.function.strict: true" in err.value.message
    assert not_advised is None or not_advised not in err.value.message


# name: (schema, a value breaking the keyword, which the grammar must refuse)
SUPPORTED = {
    "allOf of one": ({"allOf": [props(a={"type": "integer"})]}, "{}"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "null"),
    "oneOf by type": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "null"),
    "oneOf by discriminator": ({"$defs": {"Cat": props(k={"const": "cat"}, x={"type": "integer"}),
                                          "Dog": props(k={"const": "dog"}, y={"type": "string"})},
                                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                "discriminator": {"propertyName": "k"}}, '{"k":"cat","y":"s"}'),
    "oneOf of fixed values": ({"oneOf": [{"const": "a", "description": "A"}, {"enum": ["b", 1]}]}, '"c"'),
    "oneOf of many fixed values": ({"oneOf": [{"const": f"s{i}"} for i in range(1000)]}, '"s1000"'),
    "local $ref": ({"$defs": {"P": {"type": "integer"}}, "$ref": "#/$defs/P", "description": "p"}, '"x"'),
    "definitions": ({"definitions": {"P": {"type": "integer"}}, **props(a={"$ref": "#/definitions/P"})}, '{"a":"x"}'),
    "recursive $ref": ({**OBJ, "properties": {"n": {"$ref": "#"}}}, '{"n":1}'),
    "type list": ({"type": ["string", "null"], "minLength": 2}, '"a"'),
    "const": ({"const": {"a": [1, 2]}}, '{"a":[1]}'),
    "enum with type": ({"type": "string", "enum": ["red", "green"]}, '"blue"'),
    "required": (props(a={"type": "integer"}), "{}"),
    "additionalProperties false": ({**props(a={"type": "integer"}), "additionalProperties": False}, '{"a":1,"b":1}'),
    "additionalProperties schema": ({**OBJ, "additionalProperties": {"type": "string"}}, '{"b":1}'),
    "unevaluatedProperties": ({**props(a={"type": "integer"}), "unevaluatedProperties": False}, '{"a":1,"b":2}'),
    "minProperties of declared properties": ({**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                              "minProperties": 1}, "{}"),
    "maxProperties": ({**OBJ, "additionalProperties": {"type": "integer"}, "maxProperties": 1}, '{"a":1,"b":2}'),
    "propertyNames": ({**OBJ, "additionalProperties": {"type": "integer"}, "propertyNames": {"maxLength": 2}},
                      '{"abc":1}'),
    "prefixItems and items": ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}},
                              '["a","b"]'),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, "[1,2]"),
    "minItems": ({**INTS, "minItems": 2, "maxItems": 3}, "[1]"),
    "maxItems": ({**INTS, "minItems": 2, "maxItems": 3}, "[1,2,3,4]"),
    "uniqueItems false": ({**INTS, "uniqueItems": False, "maxItems": 1}, "[1,1]"),
    "minLength": ({"type": "string", "minLength": 3, "maxLength": 4}, '"ab"'),
    "maxLength": ({"type": "string", "minLength": 3, "maxLength": 4}, '"abcde"'),
    "pattern": ({"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}, '"12-3"'),
    "pattern with a group": ({"type": "string", "pattern": "^(?:a|b)+$"}, '"abc"'),
    **{f"format {f}": ({"type": "string", "format": f}, '" %% "') for f in
       ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")},
    "format on an integer": ({"type": "integer", "format": "int32"}, '"x"'),
    "minimum and maximum": ({"type": "integer", "minimum": 3, "maximum": 5}, "6"),
    "exclusive bounds": ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "1"),
    "multipleOf on integers": ({"type": ["integer", "null"], "multipleOf": 5}, "7"),
}
ANNOTATED = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/answer",
             "title": "T", "description": "d", "$comment": "c", "examples": [{"a": 1}], "default": {"a": 1},
             "deprecated": False, "readOnly": False, "writeOnly": False, "x-vendor": {"not": 1},
             **props(a={"type": "integer", "title": "A", "contentEncoding": "base64", "contentMediaType": "text/plain",
                        "contentSchema": {"not": {}}, "$anchor": "a"})}


@pytest.mark.parametrize("name", SUPPORTED)
def test_a_keyword_the_grammar_enforces_is_accepted_and_compiles_without_warnings(name, capfd):
    schema, breaking = SUPPORTED[name]
    check_schema(schema, "response_format.json_schema.schema", strict=True)
    assert breaks(schema, breaking)
    capfd.readouterr()
    assert not accepts(schema, breaking)
    # xgrammar logs what it drops; a oneOf it cannot prove disjoint it enforces as anyOf, the same on the branches
    # schema_keywords proved disjoint
    logged = [line for line in capfd.readouterr().err.splitlines() if "Warning" in line
              and not (name.startswith("oneOf") and "falling back to anyOf semantics" in line)]
    assert logged == []


def test_annotations_and_extensions_are_accepted(capfd):
    check_schema(ANNOTATED, "response_format.json_schema.schema", strict=True)
    capfd.readouterr()
    assert not accepts(ANNOTATED, '{"a":"x"}') and accepts(ANNOTATED, '{"a":1}')
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.parametrize("pattern", [r"^[^(?=]+$", r"^\(?=a$", r"[]?=]", r"^(?<name>a)+$", r"^a\$b$", "^a$|^b$",
                                     "^(?:^b)$"])
def test_patterns_without_lookaround_or_inner_anchors_pass(pattern):
    assert ignored_in_pattern(pattern) is None


# ---------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(default_max_tokens=2), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def vocabularies(monkeypatch) -> list:
    """Each time the server took a tokenizer's grammar compiler (after a schema's checks, before its compile)."""
    import kvrelay.server.grammar as grammar

    calls, real = [], grammar.vocabulary
    monkeypatch.setattr(grammar, "vocabulary", lambda tokenizer: calls.append(tokenizer) or real(tokenizer))
    return calls


def slot_body(slot: str, schema: dict, strict: bool | None, salt: str = "") -> str:
    """The request of the SLOTS row ``slot`` carrying ``schema``, its tool or format's ``strict`` as given (absent
    when None), in the namespace of ``cache_salt`` ``salt`` (a cached grammar would skip the compile)."""
    _, body, _ = SLOTS[slot]
    flag = "" if strict is None else f'"strict":{json.dumps(strict)},'
    body = body.replace('"schema":{}', flag + '"schema":{}').replace('"parameters":{}', flag + '"parameters":{}')
    body = body.replace('{"model":', f'{{"cache_salt":"{salt}","model":', 1) if salt else body
    return body.replace("%s", MODEL).replace("{}}", json.dumps(schema) + "}", 1)


@pytest.mark.parametrize("slot", SLOTS)
def test_every_schema_the_server_compiles_is_checked_before_compile(client, vocabularies, slot):
    path, _, param = SLOTS[slot]
    schema = props(tags={**INTS, "uniqueItems": True})
    r = post(client, path, slot_body(slot, schema, True))
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["param"] in err["message"], err
    assert '"uniqueItems"' in err["message"] and "#/properties/tags" in err["message"], err
    assert vocabularies == []


@pytest.mark.parametrize("name", REFUSED)
def test_without_strict_every_refused_schema_is_accepted(name):
    """As OpenAI for a tool or format without ``strict``: any valid schema, its keywords enforced as far as the
    grammar goes (the size limits and the meta-schema still apply: tests/server/test_schema_limits.py)."""
    check_schema(REFUSED[name][0], "response_format.json_schema.schema", strict=False)


# a few that agent frameworks write: pydantic's set[str], constr(pattern=..., max_length=...), an allOf of models
NON_STRICT = {name: REFUSED[name] for name in ("allOf of two", "uniqueItems", "pattern with minLength")}


@pytest.mark.parametrize("strict", [None, False, True])
@pytest.mark.parametrize("name", NON_STRICT)
@pytest.mark.parametrize("slot", SLOTS)
def test_the_server_refuses_an_unenforced_keyword_only_under_strict(client, compiled, vocabularies, slot, name,
                                                                   strict):
    """Without ``strict`` (absent or false) the request is answered with the schema compiled into its grammar;
    with ``strict: true`` it is a 400 naming the keyword and the way out (the ``strict`` field, in the endpoint's
    own terms)."""
    path, _, param = SLOTS[slot]
    schema, what, where, _ = NON_STRICT[name]
    r = post(client, path, slot_body(slot, schema, strict, salt=f"{slot}/{name}/{strict}"))
    if strict:
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and what in err["message"] and f"(at {where} in the schema)" in err["message"]
        assert f"Without {param.rsplit('.', 1)[0]}.strict: true the schema is accepted" in err["message"], err
        assert vocabularies == []  # refused before the compile
        return
    assert r.status_code == 200, r.text[:300]
    assert len(compiled) == 1
    plan, fmt, _ = compiled[0]
    assert (fmt.json_schema.schema_ if plan is None else plan.functions[0].parameters) == schema


def test_a_strict_schema_is_refused_after_the_same_schema_was_served_without_strict(client, compiled):
    """The namespace's cached grammar of the non-strict request is no way around the strict check."""
    schema = NON_STRICT["uniqueItems"][0]
    assert post(client, CHAT, slot_body("chat response_format", schema, None, salt="cached")).status_code == 200
    r = post(client, CHAT, slot_body("chat response_format", schema, True, salt="cached"))
    assert r.status_code == 400 and '"uniqueItems"' in r.json()["error"]["message"], r.text[:300]
    assert len(compiled) == 2 and compiled[1][1].json_schema.strict is True


@pytest.mark.parametrize("strict", [None, False, True])
def test_completions_response_format_follows_its_strict(client, vocabularies, strict):
    """/v1/completions compiles its response_format as a structured output: the same rule."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": NON_STRICT["allOf of two"][0]}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    body = {"model": MODEL, "max_tokens": 2, "prompt": "hi", "response_format": fmt, "cache_salt": f"c{strict}"}
    r = post(client, "/v1/completions", json.dumps(body))
    if strict:
        assert r.status_code == 400 and '"allOf" of 2 schemas' in r.json()["error"]["message"], r.text[:300]
        assert vocabularies == []
    else:
        assert r.status_code == 200, r.text[:300]
        assert vocabularies  # compiled (the tokenizer's compiler is taken for the compile and its check)


def test_vllm_structured_outputs_json_is_checked(client, vocabularies):
    """structured_outputs has no strict flag and is the client's explicit constraint: always checked."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"json": {"type": "object", "not": {"required": ["x"]}}}}
    r = post(client, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "structured_outputs.json" and '"not"' in err["message"], err
    assert vocabularies == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_json_schema_format_without_schema_is_a_json_object(client, compiled, path):
    """OpenAI types ``schema`` optional; here its absence asks for a JSON object, as ``json_object``. (A salt per
    path: the namespace's cached grammar would otherwise skip the second compile.)"""
    if path == "/v1/responses":
        body = {"model": MODEL, "max_output_tokens": 2, "input": "hi", "cache_salt": "responses",
                "text": {"format": {"type": "json_schema", "name": "x"}}}
    else:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}, "cache_salt": "chat"}
    r = post(client, path, json.dumps(body))
    assert r.status_code == 200, r.text[:300]
    assert len(compiled) == 1
    from kvrelay.server.grammar import check_response_format

    assert check_response_format(compiled[0][1]) == {"type": "object"}
