"""JSON schemas a request brings (tool parameters, ``response_format``): checked before anything runs."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from kvrelay.server.protocol import ApiError
from kvrelay.server.schema_keywords import check_keywords
from kvrelay.server.schema_limits import SchemaSize


def check_schema(schema: Any, param: str, *, strict: bool, arguments: bool = False) -> None:
    """A 400 naming ``param`` unless ``schema`` is a valid JSON schema within the size limits (an object schema when
    ``arguments``: a tool's arguments are a JSON object) and, when ``strict``, every keyword of it is one constrained
    decoding enforces (kvrelay.server.schema_keywords). Without ``strict``, as OpenAI, any valid schema is taken and
    the grammar enforces what it can of it: clients that never asked for a guarantee (an agent framework's tools
    without ``strict``) keep working."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param, code="invalid_value")
    SchemaSize().add(schema, param)  # before jsonschema, which recurses per nesting level
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ApiError(400, f"{param} is not a valid JSON schema: {exc.message}", param=param,
                       code="invalid_value") from exc
    if strict:
        check_keywords(schema, param)
    if arguments and schema.get("type", "object") != "object":
        raise ApiError(400, f"{param} must describe a JSON object (type \"object\"): a tool's arguments are one",
                       param=param, code="invalid_value")


def is_valid(instance: Any, schema: dict) -> bool:
    return Draft202012Validator(schema).is_valid(instance)
