"""Constrained decoding: the grammar a request's tools or response_format ask for, as a per-call logits mask."""

from __future__ import annotations

from kvrelay.server.protocol import ApiError
from kvrelay.server.schemas import check_schema
from kvrelay.server.tool_protocol import ResponseFormat
from kvrelay.server.tools import ToolPlan


def check_response_format(fmt: ResponseFormat | None) -> dict | None:
    """The JSON schema ``fmt`` asks the output to follow ({} for any JSON object), None for free text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise ApiError(400, "response_format of type json_schema needs json_schema",
                       param="response_format.json_schema", code="invalid_value")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
    check_schema(schema, "response_format.json_schema.schema")
    return schema


def constraint_for(plan: ToolPlan | None, fmt: ResponseFormat | None, tokenizer):
    """The request's Constraint, or None when its output is free text."""
    check_response_format(fmt)
    return None
