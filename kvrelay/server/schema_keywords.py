"""The JSON-schema keywords constrained decoding enforces: a schema that asks for a guarantee (``strict: true``, or
vLLM's ``structured_outputs.json``) holding any other is a 400 before compile. Without ``strict`` any valid schema
is taken, as OpenAI does, and the grammar enforces what it can (kvrelay.server.schemas.check_schema).

xgrammar (kvrelay.server.grammar compiles every schema with it) drops what it cannot express, some of it with a
line on stderr, some silently: a schema with ``allOf`` of two branches, ``not``, ``if``/``then``, ``uniqueItems``,
``dependentRequired``, ``contains``, a remote ``$ref`` or a lookahead in ``pattern`` compiled, and the answer broke
the schema. So a schema is checked keyword by keyword against what xgrammar 0.2.9 was seen to enforce
(tests/server/test_schema_keywords.py checks each both ways against the installed library): a keyword outside
``SUPPORTED`` and ``ANNOTATIONS`` is refused, as are the combinations that library drops (a ``pattern`` or
``format`` beside ``minLength``/``maxLength``, keywords beside ``anyOf``/``oneOf``/``allOf``/``$ref``, string or
number keywords without a ``type``, ``required`` names the object does not list, ...). The 400 names the keyword and
where it is in the schema (a JSON pointer, as a ``$ref`` writes one).
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator

from kvrelay.server.protocol import ApiError

# keywords that describe and never constrain (2020-12's meta-data and content vocabularies, OpenAPI's
# ``discriminator`` which pydantic writes beside a ``oneOf``); ``x-`` extensions too
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                         "$comment", "$schema", "$anchor", "$dynamicAnchor", "discriminator", "contentEncoding",
                         "contentMediaType", "contentSchema"})
ONE_SCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems", "propertyNames")
SCHEMA_MAPS = ("properties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
SUPPORTED = frozenset({*ONE_SCHEMA, *SCHEMA_MAPS, *SCHEMA_LISTS, *STRING_KEYWORDS, *NUMBER_KEYWORDS, "type", "enum",
                       "const", "required", "minItems", "maxItems", "minProperties", "maxProperties", "$ref", "$id",
                       "uniqueItems"})  # uniqueItems: false only
# the string formats the grammar writes exactly (others, such as iri or idn-email, it reads as any string)
FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
REFUSED = {
    "not": "the grammar cannot exclude a schema",
    "if": "conditional schemas (if/then/else) are not enforced",
    "then": "conditional schemas (if/then/else) are not enforced",
    "else": "conditional schemas (if/then/else) are not enforced",
    "dependentRequired": "properties required by another's presence are not enforced",
    "dependentSchemas": "schemas applied by a property's presence are not enforced",
    "dependencies": "properties required by another's presence are not enforced",
    "uniqueItems": "the grammar cannot keep an array's items distinct",
    "contains": "the grammar cannot require an item somewhere in an array",
    "minContains": "the grammar cannot count matching items",
    "maxContains": "the grammar cannot count matching items",
    "patternProperties": "the grammar matches a key against the whole pattern (JSON Schema searches it) and lets "
                         "a key repeat",
    "$dynamicRef": "only local references ($ref \"#/...\") are resolved",
    "additionalItems": "a draft-07 keyword: use items (after prefixItems)",
}
_DEFINITIONS = frozenset({"$defs", "definitions"})


def _way_out(param: str) -> str:
    """Why the schema is refused and what the client can send instead: the schema without the guarantee."""
    if param.startswith("structured_outputs"):
        return ("structured_outputs asks for the constraint. A response_format json_schema without \"strict\": true "
                "accepts the schema and leaves such keywords unenforced")
    # tools.0.function.parameters -> tools.0.function.strict; response_format.json_schema.schema -> ...strict
    return (f"strict asks for the schema to be followed. Without {param.rsplit('.', 1)[0]}.strict: true the schema "
            "is accepted and such keywords are not enforced (the grammar follows the rest)")


def _refused(param: str, where: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} (at {where} in the schema); constrained decoding (xgrammar) would not "
                         f"enforce it, so the output could break the schema, and {_way_out(param)}. Supported "
                         "keywords: docs/agents.md", param=param, code="invalid_value")


def _pointer(parent: str, *keys: Any) -> str:
    return parent + "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in keys)


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    return None if t is None else {t} if isinstance(t, str) else set(t)


def check_keywords(schema: Any, param: str) -> None:
    """A 400 naming ``param``, the keyword and its place unless every keyword of ``schema`` (a valid JSON schema:
    kvrelay.server.schemas.check_schema runs this after the meta-schema check) is one the grammar enforces."""
    stack: list[tuple[Any, str, bool]] = [(schema, "#", False)]
    while stack:
        node, where, key_schema = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false
        _check_node(node, where, key_schema, schema, param)
        children: list[tuple[Any, str, bool]] = []
        for key, value in node.items():
            if key in ONE_SCHEMA:
                children.append((value, _pointer(where, key), key == "propertyNames"))
            elif key in SCHEMA_MAPS:
                children.extend((v, _pointer(where, key, k), False) for k, v in value.items())
            elif key in SCHEMA_LISTS:
                children.extend((v, _pointer(where, key, i), key_schema and key != "prefixItems")
                                for i, v in enumerate(value))
        stack.extend(reversed(children))


def _check_node(node: dict, where: str, key_schema: bool, root: dict, param: str) -> None:
    """``key_schema``: ``node`` is a ``propertyNames`` schema (or a branch of one), whose values are strings."""
    for key, value in node.items():
        if key in ANNOTATIONS or key.startswith("x-") or (key == "uniqueItems" and value is False):
            continue
        if key in REFUSED:
            raise _refused(param, where, f'"{key}" is not supported: {REFUSED[key]}')
        if key not in SUPPORTED:
            raise _refused(param, where, f'"{key}" is not a supported keyword')
    if "$id" in node and where != "#":
        raise _refused(param, where, '"$id" is supported only at the root: below it, it changes what the "#" '
                                     'of a $ref means')
    combinator = next((k for k in COMBINATORS if k in node), None)
    if combinator is not None:
        _check_combinator(node, combinator, where, root, param)
        return
    if "enum" in node or "const" in node:
        _check_values(node, where, param)
        return
    _check_strings(node, where, key_schema, param)
    _check_numbers(node, where, param)
    _check_objects(node, where, param)
    if "unevaluatedItems" in node and "items" in node:
        raise _refused(param, where, '"unevaluatedItems" beside "items" is not supported')


def _check_combinator(node: dict, combinator: str, where: str, root: dict, param: str) -> None:
    if "allOf" in node and len(node["allOf"]) > 1:
        raise _refused(param, where, f'"allOf" of {len(node["allOf"])} schemas is not supported (one is): merge '
                                     'them into one schema')
    if "$ref" in node and not (node["$ref"] == "#" or node["$ref"].startswith("#/")):
        raise _refused(param, where, f'"$ref" {node["$ref"]!r} is not supported: only a reference inside the '
                                     'schema ("#" or "#/...") is resolved')
    for key in node:
        if key != combinator and key not in ANNOTATIONS and key not in _DEFINITIONS and key != "$id" \
                and not key.startswith("x-"):
            raise _refused(param, where, f'"{key}" beside "{combinator}" is not supported: the grammar follows '
                                         f'"{combinator}" alone there; move "{key}" into each branch')
    if combinator == "oneOf":
        overlap = _overlapping(node["oneOf"], root)
        if overlap is not None:
            raise _refused(param, where, f'"oneOf" {overlap} may both match a value, and the grammar enforces '
                                         '"oneOf" as "anyOf" then: use "anyOf", or make the branches differ by type, '
                                         'by fixed values or by a required "const" property')


def _check_values(node: dict, where: str, param: str) -> None:
    """The grammar writes one of ``enum``'s (or ``const``'s) values whatever the keywords beside it: each must meet
    them."""
    for key in ("const", "enum"):
        if key not in node:
            continue
        rest = {k: v for k, v in node.items() if k != key and k not in ANNOTATIONS and k not in _DEFINITIONS}
        if not rest:
            continue
        for value in (node["enum"] if key == "enum" else [node["const"]]):
            try:
                ok = Draft202012Validator(rest).is_valid(value)
            except Exception:  # a $ref it cannot resolve on its own: not provably met
                ok = False
            if not ok:
                raise _refused(param, where, f'the "{key}" value {json.dumps(value)[:60]} breaks the keywords '
                                             f'beside it ({", ".join(rest)}), which the grammar does not apply to '
                                             'it')


def _check_strings(node: dict, where: str, key_schema: bool, param: str) -> None:
    present = [k for k in STRING_KEYWORDS if k in node]
    if not present:
        return
    types = _types(node)
    if types is None and not key_schema:
        raise _refused(param, where, f'"{present[0]}" without "type": "string" is not supported: the grammar '
                                     'applies it only to a schema typed string')
    if not key_schema and "string" not in types:
        return  # string keywords on a schema of no string type: nothing to apply
    length = next((k for k in ("minLength", "maxLength") if k in node), None)
    shape = next((k for k in ("pattern", "format") if k in node), None)
    if length and shape:
        fix = ("write the length into the pattern ({m,n})" if shape == "pattern" else
               "drop the length, or write a pattern with the length in it ({m,n}) in place of the format")
        raise _refused(param, where, f'"{shape}" together with "{length}" is not supported: the grammar drops the '
                                     f'length; {fix}')
    if "format" in node and node["format"] not in FORMATS:
        raise _refused(param, where, f'"format" {node["format"]!r} is not supported (supported: '
                                     f'{", ".join(FORMATS)})')
    if "pattern" in node:
        problem = ignored_in_pattern(node["pattern"])
        if problem:
            raise _refused(param, where, f'"pattern" {node["pattern"]!r}: {problem} is not supported')


def _check_numbers(node: dict, where: str, param: str) -> None:
    present = [k for k in NUMBER_KEYWORDS if k in node]
    if not present:
        return
    types = _types(node)
    if types is None:
        raise _refused(param, where, f'"{present[0]}" without "type": "integer" or "number" is not supported: the '
                                     'grammar applies it only to a schema typed so')
    if "multipleOf" in node:
        step = node["multipleOf"]
        if "number" in types:
            raise _refused(param, where, '"multipleOf" on "type": "number" is not supported (on "integer" it is)')
        if "integer" in types and not float(step).is_integer():
            raise _refused(param, where, f'"multipleOf" {step} on integers is not supported (a whole number is)')


def _check_objects(node: dict, where: str, param: str) -> None:
    properties = node.get("properties", {})
    for name in node.get("required", ()):
        if name not in properties:
            raise _refused(param, where, f'"required" names {name!r}, which "properties" does not list: the grammar '
                                         'requires listed properties only')
    # undeclared keys: where additionalProperties allows them, or where propertyNames alone names them (the grammar
    # then takes any value for them)
    free_keys = any(k in node and node[k] is not False for k in ("additionalProperties", "unevaluatedProperties")) \
        or ("propertyNames" in node and "additionalProperties" not in node)
    if node.get("minProperties", 0) > 0 and free_keys:
        raise _refused(param, where, '"minProperties" beside "additionalProperties" is not supported: the grammar '
                                     'lets an undeclared key repeat, and a repeated key counts once')
    if "unevaluatedProperties" in node and "additionalProperties" in node:
        raise _refused(param, where, '"unevaluatedProperties" beside "additionalProperties" is not supported')
    if "propertyNames" in node:
        names = node["propertyNames"]
        for name in properties:
            try:
                ok = Draft202012Validator(names if isinstance(names, dict) else {"not": {}} if names is False
                                          else {}).is_valid(name)
            except Exception:
                ok = False
            if not ok:
                raise _refused(param, where, f'the property {name!r} breaks "propertyNames", which the grammar '
                                             'applies to undeclared keys only')


def _resolve(schema: Any, root: dict, num_hops: int = 0) -> Any:
    """``schema`` with a local ``$ref`` followed (to None when it leads nowhere or loops past 16 hops)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
        if num_hops > 16:
            return None
        num_hops += 1
        target: Any = root
        for part in schema["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        schema = target
    return schema


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _kinds(schema: Any, root: dict) -> set[str] | None:
    """The JSON types a value of ``schema`` may have (None: any, as far as this can tell)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return None
    values = _values(schema, root)
    if values is not None:
        return {_json_type(v) for v in values}
    types = _types(schema)
    if types is not None:
        return types | ({"integer"} if "number" in types else set())
    branches = schema.get("anyOf", schema.get("oneOf"))
    if branches is not None:
        kinds = [_kinds(b, root) for b in branches]
        return None if any(k is None for k in kinds) else set().union(*kinds)
    return None


def _values(schema: Any, root: dict) -> list | None:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return None
    return [schema["const"]] if "const" in schema else schema.get("enum")


def _canonical(value: Any) -> str:
    """JSON text equal for values JSON Schema calls equal (1 and 1.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


# a oneOf's branches are compared pair by pair up to this many (beyond, only fixed values, compared at once): the
# pairs grow with the square, and a schema may hold thousands of values
MAX_ONEOF_PAIRWISE = 128


def _signature(schema: Any, root: dict) -> tuple[set[str] | None, set[str] | None, dict[str, set[str]]]:
    """What ``_disjoint`` compares of one branch: its JSON types, its fixed values (canonical), and the fixed values
    of each property it requires."""
    values = _values(schema, root)
    schema = _resolve(schema, root)
    tags: dict[str, set[str]] = {}
    if isinstance(schema, dict):
        for name in schema.get("required", ()):
            tag = _values(schema.get("properties", {}).get(name), root)
            if tag is not None:
                tags[name] = {_canonical(v) for v in tag}
    return _kinds(schema, root), None if values is None else {_canonical(v) for v in values}, tags


def _disjoint(a: tuple, b: tuple) -> bool:
    """No value can match both branches (``_signature``s; a sound test, not a complete one): different types,
    different fixed values, or a property both require with different fixed values (a discriminator, as pydantic
    writes)."""
    (kinds_a, values_a, tags_a), (kinds_b, values_b, tags_b) = a, b
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    if values_a is not None and values_b is not None:
        return not values_a & values_b
    return any(not tags_a[name] & tags_b[name] for name in tags_a.keys() & tags_b.keys())


def _overlapping(branches: list, root: dict) -> str | None:
    """Two of a oneOf's branches that may both match a value ("branches 0 and 2"), or None."""
    signatures = [_signature(b, root) for b in branches]
    if all(values is not None for _, values, _ in signatures):  # fixed values only: each in one branch
        seen: dict[str, int] = {}
        for j, (_, values, _) in enumerate(signatures):
            for value in values:
                if value in seen and seen[value] != j:
                    return f"branches {seen[value]} and {j}"
                seen[value] = j
        return None
    if len(branches) > MAX_ONEOF_PAIRWISE:
        return f"has {len(branches)} branches, not all fixed values, and some"
    for j, b in enumerate(signatures):
        for i in range(j):
            if not _disjoint(signatures[i], b):
                return f"branches {i} and {j}"
    return None


def ignored_in_pattern(pattern: str) -> str | None:
    """What in ``pattern`` the grammar ignores: a lookaround, or an anchor (^, $) inside it."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]" or pattern[i + 1:i + 3] == "^]":  # a leading "]" is a literal
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return "a lookaround assertion"
        elif c == "^" and i > 0 and pattern[i - 1] not in "(|" and pattern[i - 3:i] != "(?:":
            return "an anchor ^ inside the pattern"
        elif c == "$" and i + 1 < len(pattern) and pattern[i + 1] not in ")|":
            return "an anchor $ inside the pattern"
        i += 1
    return None
