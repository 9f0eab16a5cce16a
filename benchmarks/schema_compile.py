"""How long the grammar compiler takes on schemas at kvrelay's schema limits, and (``--past-limits``) on the ones
that set them: the numbers in docs/serving-errors.md ("JSON schemas: size limits").

Each schema is compiled as the server compiles a ``response_format`` (kvrelay.server.grammar's structural tag), and
each request of several tools as it compiles their calls (``tool_choice`` "required": one grammar for all), on the
default model's tokenizer, with no compile cache, one compile thread. The limits' checker
(kvrelay.server.schema_limits) is run first and says whether the server would compile it at all.

    python benchmarks/schema_compile.py --json benchmarks/results/schema-compile-cpu.json
    python benchmarks/schema_compile.py --past-limits   # minutes: the slow ones the limits refuse
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvrelay.eval.harness import environment
from kvrelay.server.grammar import json_format, tool_format, vocabulary
from kvrelay.server.protocol import ApiError
from kvrelay.server.schema_limits import SchemaSize
from kvrelay.server.tool_protocol import FunctionDef
from kvrelay.server.tools import ToolPlan
from kvrelay.weights.loader import load_tokenizer


def _object(prefix: str, num_properties: int) -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"} for i in range(num_properties)}}


def _string(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


def _ref_chain(num_defs: int, prefix: str = "d") -> dict:
    return {"$defs": {f"{prefix}{i}": {"type": "object", "properties": {
        "x": {"$ref": f"#/$defs/{prefix}{i + 1}"}, "y": {"$ref": f"#/$defs/{prefix}{i + 1}"}}} for i in range(num_defs)}
        | {f"{prefix}{num_defs}": {"type": "string"}}, "$ref": f"#/$defs/{prefix}0"}


def _server_tool(k: int) -> dict:
    """A tool as an MCP server's arguments come (pydantic: a title and a description on every property), its
    argument names its own so that no two tools' grammars are the same."""
    texts = {f"owner{k}": "string", f"repo{k}": "string", f"title{k}": "string", f"body{k}": "string",
             f"head{k}": "string", f"base{k}": "string", f"draft{k}": "boolean", f"modify{k}": "boolean"}
    return {"type": "object", "title": f"Tool{k}Arguments", "required": list(texts)[:6], "properties": {
        name: {"type": kind, "title": name.title(), "description": f"The {name} of the change"}
        for name, kind in texts.items()}}


WITHIN = {
    "one object of 256 optional properties": _object("a", 256),
    "3 objects of 128 in one": {"type": "object", "properties": {f"o{j}": _object(f"o{j}_", 128) for j in range(3)}},
    "oneOf 6 objects of 100": {"oneOf": [_object(f"b{j}", 100) for j in range(6)]},
    "anyOf 580 one-key objects": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}},
                                             "required": [f"k{i}"]} for i in range(580)]},
    "enum of 4000": {"enum": [f"value{i}" for i in range(4000)]},
    "$ref chain of 500": _ref_chain(500),
    "pattern ^[a-z]{1,1000}$": _string("^[a-z]{1,1000}$"),
    "pattern ^([a-z]{1,4}){1,4}$": _string("^([a-z]{1,4}){1,4}$"),
    "pattern ^(.{1,4}){1,4}$": _string("^(.{1,4}){1,4}$"),
    "pattern ^.{1,1000}$": _string("^.{1,1000}$"),
}
# whole requests: their tools' schemas, one grammar
WITHIN_REQUESTS = {
    "128 tools of 8 documented arguments": [_server_tool(k) for k in range(128)],
    "2 tools, each a $ref chain of 500": [_ref_chain(500, "a"), _ref_chain(500, "b")],
}
PAST = {
    "one object of 800 optional properties": _object("a", 800),
    "7 objects of 256 in one": {"type": "object", "properties": {f"o{j}": _object(f"o{j}_", 256) for j in range(7)}},
    "pattern ^(.{1,8}){1,8}$": _string("^(.{1,8}){1,8}$"),
    "pattern ^[a-z]{0,20000}$": _string("^[a-z]{0,20000}$"),
    "pattern ^([a-z]{1,10}){1,30}$": _string("^([a-z]{1,10}){1,30}$"),
    "pattern ^([a-z]{1,50}){1,100}$": _string("^([a-z]{1,50}){1,100}$"),
    "one object of 5000 optional properties": _object("a", 5000),
}


def _refusal(schemas: list[dict]) -> str | None:
    """The limits' 400 message for a request of these schemas, or None when the server compiles it."""
    size = SchemaSize()
    try:
        for i, schema in enumerate(schemas):
            size.add(schema, f"tools.{i}")
    except ApiError as exc:
        return exc.message
    return None


def run(schemas: dict[str, dict], requests: dict[str, list[dict]]) -> list[dict]:
    vocab = vocabulary(load_tokenizer())
    rows = []
    formats = {name: ([schema], json_format(schema)) for name, schema in schemas.items()}
    for name, tools in requests.items():
        plan = ToolPlan(tuple(FunctionDef(name=f"tool{i}", parameters=t) for i, t in enumerate(tools)), "required")
        formats[name] = (tools, tool_format(plan, None))
    for name, (parts, fmt) in formats.items():
        refused = _refusal(parts)
        t0 = time.perf_counter()
        compiled = vocab.compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
        row = {"schema": name, "compile_s": round(time.perf_counter() - t0, 3),
               "compiled_mb": round(compiled.memory_size_bytes / 1e6, 2), "refused_by_limits": refused}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--past-limits", action="store_true", help="also the schemas the limits refuse (minutes)")
    parser.add_argument("--json", type=Path, help="write the rows and the machine here")
    args = parser.parse_args()
    rows = run(WITHIN | (PAST if args.past_limits else {}), WITHIN_REQUESTS)
    if args.json:
        args.json.write_text(json.dumps({"env": environment("cpu"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
