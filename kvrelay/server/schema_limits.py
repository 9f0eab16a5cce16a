"""How large a JSON schema a request may bring (tool parameters, ``response_format``), checked before it reaches
jsonschema (which recurses once per nesting level: a deep enough schema is a RecursionError) or the grammar
compiler (whose time grows faster than linearly with a schema's size: on a 2-core CPU, xgrammar took 5 s for one
object of 800 optional properties and over 5 minutes for 5000, holding a thread and gigabytes meanwhile). The limits
are far above what a tool's arguments or an answer's shape need, and below what stalls the server.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvrelay.server.pattern_limits import pattern_problem
from kvrelay.server.protocol import ApiError

MAX_TOOLS = 128  # as OpenAI's
MAX_SCHEMA_DEPTH = 64  # nested JSON objects and arrays in one schema (an object property is two: itself, properties)
MAX_SCHEMA_NODES = 4096  # JSON values (objects, arrays, scalars) in one schema
# ... and in one request's schemas together (one grammar): 128 tools of a typical MCP server's size (8 arguments,
# about 35 values each) fit; the compile of twice that many values takes a few seconds of one compile thread
MAX_REQUEST_SCHEMA_NODES = 8192
# keywords whose text value the grammar never sees (annotations): not counted in MAX_SCHEMA_NODES. Frameworks put
# one on every property (pydantic a title, MCP servers a description), nearly doubling a schema's count: 128
# ordinary MCP tools counted past the limit on their descriptions alone
ANNOTATIONS = frozenset({"title", "description", "$comment", "$schema"})
# every ``properties`` map's size, squared, summed over the request's schemas: compile time grows about so with
# optional properties (on a 2-core CPU one object of 256 took 0.4 s, seven of 256 took 9 s)
MAX_PROPERTY_PAIRS = 1 << 16


def _too_big(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param} is too large to compile for constrained decoding: {what}", param=param,
                    code="invalid_value")


class SchemaSize:
    """What a request's schemas hold so far (``add``): JSON values and property pairs, each against its limit."""

    def __init__(self) -> None:
        self.num_nodes = 0
        self.num_property_pairs = 0

    def add(self, schema: Any, param: str) -> None:
        """Count ``schema`` in; a 400 naming ``param`` past ``MAX_SCHEMA_DEPTH`` nesting levels, or when the
        schema passes ``MAX_SCHEMA_NODES``, or the request's schemas so far pass ``MAX_REQUEST_SCHEMA_NODES`` or
        ``MAX_PROPERTY_PAIRS``. Iterative, and stops at the first limit passed: its cost is bounded by the limits,
        not by the schema."""
        stack: list[tuple[Any, int]] = [(schema, 1)]
        num_own_nodes = 0
        while stack:
            value, depth = stack.pop()
            self.num_nodes += 1
            num_own_nodes += 1
            if num_own_nodes > MAX_SCHEMA_NODES:
                raise _too_big(param, f"more than {MAX_SCHEMA_NODES} JSON values in one schema")
            if self.num_nodes > MAX_REQUEST_SCHEMA_NODES:
                raise _too_big(param, f"more than {MAX_REQUEST_SCHEMA_NODES} JSON values in the request's schemas "
                                      "together")
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_big(param, f"nested more than {MAX_SCHEMA_DEPTH} levels deep, counting each JSON object "
                                      "and array of the schema's text and the values in them (an object property "
                                      "is two levels below its object: \"properties\" and the property's schema; "
                                      f"so {MAX_SCHEMA_DEPTH // 2 - 1} objects nested as properties around "
                                      '{"type": "string"})')
            if isinstance(value, dict):
                self._check_patterns(value, param)
                properties = value.get("properties")
                if isinstance(properties, dict):
                    self.num_property_pairs += len(properties) ** 2
                    if self.num_property_pairs > MAX_PROPERTY_PAIRS:
                        raise _too_big(param, "too many properties: the number of each object's properties, "
                                       f"squared and summed over the request's schemas, is over {MAX_PROPERTY_PAIRS} "
                                       "(one object of 256 properties, or 64 objects of 32)")
                stack.extend((v, depth + 1) for k, v in value.items()
                             if not (k in ANNOTATIONS and isinstance(v, str)))
            elif isinstance(value, list):
                stack.extend((v, depth + 1) for v in value)


    @staticmethod
    def _check_patterns(schema: dict, param: str) -> None:
        """A 400 naming ``param`` when a regular expression of ``schema`` (its ``pattern``, its
        ``patternProperties``' keys) would take long to compile (kvrelay.server.pattern_limits)."""
        pattern, by_pattern = schema.get("pattern"), schema.get("patternProperties")
        patterns = ([pattern] if isinstance(pattern, str) else []) + list(by_pattern if isinstance(by_pattern, dict)
                                                                          else ())
        for text in patterns:
            problem = pattern_problem(text)
            if problem is not None:
                raise _too_big(param, problem)


def check_total_size(schemas: Iterable[tuple[Any, str]]) -> None:
    """A 400 when a request's schemas together (every tool's, the answer's: ``(schema, param)`` pairs) pass a
    limit: they are compiled into one grammar. It names the schema that passed it."""
    size = SchemaSize()
    for schema, param in schemas:
        size.add(schema, param)


def check_request_schemas(tool_parameters: list[Any], answer: Any | None) -> None:
    """A 400 when a request has more than ``MAX_TOOLS`` tools, or its tools' ``parameters`` and its answer's
    schema (``response_format``) together pass a limit (``check_total_size``). Cheap whatever the request: run it
    before anything validates or compiles a schema (jsonschema took 0.1 s per schema of 1000 values)."""
    if len(tool_parameters) > MAX_TOOLS:
        raise ApiError(400, f"tools: at most {MAX_TOOLS} tools, as OpenAI (got {len(tool_parameters)})", param="tools",
                       code="invalid_value")
    schemas = [(p, f"tools.{i}.function.parameters") for i, p in enumerate(tool_parameters) if p is not None]
    check_total_size([*schemas, *([(answer, "response_format.json_schema.schema")] if answer is not None else [])])
