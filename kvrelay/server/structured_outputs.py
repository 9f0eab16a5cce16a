"""vLLM's ``structured_outputs`` (and ``response_format`` on ``/v1/completions``), served with xgrammar as vLLM's
xgrammar backend serves them, or refused with a 400 naming the field.

- ``json`` (a schema object or its JSON text), ``json_object``: JSON of the schema (any object), with xgrammar's
  whitespace as vLLM compiles it (any amount between tokens, so greedy answers are vLLM's); ``disable_any_whitespace``:
  none at all (vLLM's compact separators). ``response_format`` on completions is kvrelay's, as on chat: at most
  ``MAX_JSON_WHITESPACE`` whitespace characters in a row (a small model may otherwise pad forever).
- ``regex``: text the regular expression matches as a whole (xgrammar's regex syntax).
- ``choice``: exactly one of the strings (the same EBNF vLLM builds from them).
- ``grammar``: xgrammar's EBNF (GBNF, a ``root`` rule), or Lark, which xgrammar converts; a grammar is read as Lark
  when no line defines a rule with ``::=`` (vLLM's test).
- ``disable_additional_properties``: objects of the schema that do not say ``additionalProperties`` get false (as
  vLLM's guidance backend; xgrammar already refuses undeclared properties there). ``disable_fallback``: a no-op.
- Refused: ``structural_tag``, ``whitespace_pattern`` (xgrammar takes no whitespace pattern), two constraints at
  once, a constraint beside ``response_format`` json_schema / json_object or beside tools the model may call
  (vLLM refuses the first two; kvrelay's tool grammar and a constraint do not combine), and vLLM's removed
  ``guided_*`` fields, which vLLM now drops silently.

Cost is bounded before anything compiles: a schema as ``response_format``'s (kvrelay.server.schema_limits), a regex
as a schema's ``pattern`` (kvrelay.server.pattern_limits) and at most ``MAX_TOTAL_REPEAT`` counted repetitions in
all, a grammar at most ``MAX_GRAMMAR_CHARS`` characters with the same repetition bounds, the choices at most
``MAX_CHOICES`` strings of ``MAX_CHOICE_CHARS`` characters together. Compiles run on the tenant's compile turn
(kvrelay.server.grammar_compiles) and are cached per namespace (kvrelay.server.grammar_cache).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from kvrelay.cache.tenancy import tenant_of
from kvrelay.server.grammar_cache import grammar_key
from kvrelay.server.pattern_limits import MAX_PATTERN_CHARS, MAX_PATTERN_REPEAT, pattern_problem, total_repeat
from kvrelay.server.protocol import ApiError
from kvrelay.server.schema_limits import SchemaSize
from kvrelay.server.structured_protocol import StructuredOutputs
from kvrelay.server.tool_protocol import ResponseFormat

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "guided_whitespace_pattern")
# on a 2-core CPU, xgrammar compiled the EBNF [^x]{1,1000} in 3.1 s and [^x]{1,100} repeated {1,100} in 1.7 s:
# counts side by side add up, so they are bounded together
MAX_TOTAL_REPEAT = MAX_PATTERN_REPEAT
MAX_GRAMMAR_CHARS = 16384
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 65536  # all choices' characters together (4000 choices of ~17 characters compiled in 76 ms)
PARAM = "structured_outputs"


@dataclass(frozen=True)
class Structured:
    """One checked constraint: ``kind`` "json", "regex", "choice" or "grammar"; ``text`` the schema's JSON text,
    the regex or the grammar (EBNF, or Lark when ``lark``); ``param`` the field it came from (for errors)."""

    kind: str
    text: str
    param: str
    lark: bool = False
    compact: bool = False  # no whitespace inside JSON (disable_any_whitespace)
    # JSON whitespace as kvrelay's response_format (kvrelay.server.grammar.MAX_JSON_WHITESPACE in a row), not any
    bounded_whitespace: bool = False
    # a JSON schema's keywords all enforced or a 400 (kvrelay.server.schemas.check_schema): structured_outputs asks
    # for its constraint (vLLM's xgrammar backend too refuses the features it knows xgrammar drops:
    # vllm/v1/structured_output/backend_xgrammar.py); a response_format only with its strict
    strict: bool = True


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def refuse_guided(body: Any) -> None:
    """A 400 naming the first of vLLM's removed ``guided_*`` fields the request sets."""
    for name in GUIDED_FIELDS:
        if getattr(body, name, None) is not None:
            raise _bad(name, "vLLM's guided_* fields are removed (vLLM ignores them); send the constraint in "
                       "structured_outputs, e.g. structured_outputs: {\"regex\": ...} for guided_regex",
                       "unsupported")


def _schema(value: str | dict, param: str, drop_extra_properties: bool) -> str:
    """The schema's JSON text, within the size limits (cheap, on the event loop); whether it is a valid JSON schema
    is checked where it is compiled (jsonschema takes up to a fraction of a second: ``compile_structured``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise _bad(param, f"is not valid JSON text: {exc}") from None
    if not isinstance(value, dict):
        raise _bad(param, "must be a JSON schema object")
    SchemaSize().add(value, param)
    if drop_extra_properties:
        value = copy.deepcopy(value)
        _close_objects(value)
    return json.dumps(value)


def _close_objects(schema: Any) -> None:
    """``additionalProperties: false`` on every object schema that declares properties and says nothing of others
    (vLLM's ``disable_additional_properties``). Iterative: ``SchemaSize`` bounded the schema's size."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "additionalProperties" not in item and (isinstance(item.get("properties"), dict)
                                                       or isinstance(item.get("patternProperties"), dict)):
                item["additionalProperties"] = False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _check_repetition(text: str, param: str, max_chars: int) -> None:
    problem = pattern_problem(text, max_chars)
    if problem is None and total_repeat(text) > MAX_TOTAL_REPEAT:
        problem = f"counted repetitions ({{m,n}}) adding up to over {MAX_TOTAL_REPEAT}"
    if problem is not None:
        raise _bad(param, f"is too large to compile for constrained decoding: {problem}")


def choice_grammar(choices: list[str]) -> str:
    """vLLM's EBNF for ``choice`` (vllm.v1.structured_output.utils.choice_as_grammar), so both decode alike."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escaped(text: str) -> str:
        return "".join(escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                       for c in text)

    return "root ::= " + " | ".join(f'"{escaped(c)}"' for c in choices)


_EBNF_RULE = re.compile(r"::=")
_COMMENT = re.compile(r"(#|//).*$")


def is_lark(grammar: str) -> bool:
    """vLLM's test (``grammar_is_likely_lark``): no line, comments removed, defines a rule with ``::=``."""
    return bool(grammar) and not any(_EBNF_RULE.search(_COMMENT.sub("", line)) for line in grammar.split("\n"))


def _one(so: StructuredOutputs) -> Structured:
    """The one constraint of ``so`` (its options applied), checked; a 400 naming the field otherwise."""
    names = so.constraints()
    if len(names) != 1:
        raise _bad(PARAM, "set exactly one of json, regex, choice, grammar, json_object (vLLM's rule); got "
                   f"{', '.join(names) if names else 'none'}")
    name, param = names[0], f"{PARAM}.{names[0]}"
    if so.whitespace_pattern is not None:
        raise _bad(f"{PARAM}.whitespace_pattern", "is not supported: xgrammar takes no whitespace pattern; send "
                   "disable_any_whitespace: true for JSON without whitespace", "unsupported")
    if name == "structural_tag":
        raise _bad(param, "is not supported: send response_format json_schema, or tools for tool calls",
                   "unsupported")
    if name in ("json", "json_object"):
        if so.json_object is False:
            raise _bad(param, "must be true when set (omit it for free text)")
        schema = so.json_ if name == "json" else {"type": "object"}
        return Structured("json", _schema(schema, param, so.disable_additional_properties), param,
                          compact=so.disable_any_whitespace)
    if name == "regex":
        if "\x00" in so.regex:
            raise _bad(param, "must not contain a NUL character")
        _check_repetition(so.regex, param, MAX_PATTERN_CHARS)
        return Structured("regex", so.regex, param)
    if name == "choice":
        if not so.choice:
            raise _bad(param, "needs at least one string")
        if len(so.choice) > MAX_CHOICES or sum(map(len, so.choice)) > MAX_CHOICE_CHARS:
            raise _bad(param, f"is too large: at most {MAX_CHOICES} strings of {MAX_CHOICE_CHARS} characters "
                       "together")
        return Structured("grammar", choice_grammar(so.choice), param)
    _check_repetition(so.grammar, param, MAX_GRAMMAR_CHARS)
    return Structured("grammar", so.grammar, param, lark=is_lark(so.grammar))


def _from_response_format(fmt: ResponseFormat) -> Structured | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema, param, strict = {"type": "object"}, "response_format", False
    elif fmt.json_schema is None:
        raise _bad("response_format.json_schema", "is needed by response_format of type json_schema")
    else:
        schema, param = fmt.json_schema.schema_ or {}, "response_format.json_schema.schema"
        strict = bool(fmt.json_schema.strict)
    return Structured("json", _schema(schema, param, False), param, bounded_whitespace=True, strict=strict)


def structured_of(body: Any, tools_may_call: bool = False) -> Structured | None:
    """The constraint ``body`` (a chat or completions request) asks for in ``structured_outputs`` (on completions
    also in ``response_format``), None when it asks for none there; a 400 for what is refused (module docstring).
    A chat request's own ``response_format`` alone is left to kvrelay.server.grammar (None here)."""
    refuse_guided(body)
    so, fmt = body.structured_outputs, body.response_format
    if so is None:
        chat = hasattr(body, "messages")
        return None if chat or fmt is None else _from_response_format(fmt)
    if fmt is not None and fmt.type != "text":
        raise _bad(PARAM, f"cannot be sent with response_format {fmt.type} (one constraint per request, as vLLM)")
    if tools_may_call:
        raise _bad(PARAM, "cannot be sent with tools the model may call: send tool_choice \"none\", or a tool's "
                   "parameters schema for its arguments")
    return _one(so)


def compile_structured(structured: Structured, tokenizer) -> Any:
    """The compiled constraint (kvrelay.server.grammar.Constraint); a 400 naming the field when it does not
    compile. Slow (up to seconds): on a compile thread (``structured_constraint``)."""
    import torch

    from kvrelay.server import grammar

    if grammar.xgr is None:
        raise _bad(structured.param, "needs constrained decoding, and this server has no grammar library: install "
                   "it with pip install 'kvrelay[tools]' (xgrammar)", "unsupported")
    if structured.kind == "json":
        from kvrelay.server.schemas import check_schema

        check_schema(json.loads(structured.text), structured.param, strict=structured.strict)
    compiler = grammar.vocabulary(tokenizer).compiler
    try:
        if structured.kind == "json":
            compiled = compiler.compile_json_schema(
                structured.text, any_whitespace=not structured.compact,
                separators=(",", ":") if structured.compact else None,
                max_whitespace_cnt=grammar.MAX_JSON_WHITESPACE if structured.bounded_whitespace else None)
        elif structured.kind == "regex":
            compiled = compiler.compile_regex(structured.text)
        elif structured.lark:
            compiled = compiler.compile_lark(structured.text)
        else:
            compiled = compiler.compile_grammar(structured.text)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for what it cannot take
        what = {"json": "this JSON schema", "regex": "this regular expression",
                "grammar": "this Lark grammar" if structured.lark else "this EBNF grammar"}[structured.kind]
        raise _bad(structured.param, f"{what} cannot be used for constrained decoding: "
                   f"{grammar.library_reason(exc)}") from exc
    constraint = grammar.Constraint(compiled, grammar.vocabulary(tokenizer))
    # xgrammar compiles a grammar that matches no text (root ::= root); its first mask allows no token, not even
    # the end, and sampling from it would fail the request as the server's error
    probe = constraint.new_mask()
    if not bool(torch.isfinite(probe.apply(torch.zeros(probe.vocab.size))).any()):
        raise _bad(structured.param, "matches no text: no token can start it")
    return constraint


async def structured_constraint(structured: Structured, namespace: str, ctx: Any) -> Any:
    """``compile_structured`` on the tenant's compile turn, or the namespace's cached compile of the same
    constraint (kvrelay.server.grammar_cache)."""
    key = "structured:" + grammar_key(structured, None)

    def cached_or_compiled():  # on the tenant's turn: a request just before it may have compiled the same
        constraint = ctx.grammars.get(namespace, key)
        if constraint is None:
            constraint = compile_structured(structured, ctx.tokenizer)
            ctx.grammars.put(namespace, key, constraint, constraint.compiled.memory_size_bytes)
        return constraint

    cached = ctx.grammars.get(namespace, key)
    return cached if cached is not None else await ctx.compiles.run(tenant_of(namespace), cached_or_compiled)
