"""Tool calling on chat completions: the request's tools checked and rendered into the prompt, the model's
output parsed back into OpenAI ``tool_calls``.

One model-agnostic format for every chat template (neither embedded model's template, SmolLM2's or Gemma 3's,
has tool support; a template's own tool syntax is not used even where it has one): the tools' JSON schemas go
into the system message, and a call is written

    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>

several calls one per line. Constrained decoding (kvrelay.server.grammar) forces exactly this text, so the
rendering of an assistant message's ``tool_calls`` in a later request (``call_text``) is byte for byte what
the model generated: the registry then finds that text and splices the generated ids, and the next step
reuses their decode KV. Tool results go back as a user turn of ``<tool_response>`` blocks (templates such as
Gemma 3's accept only alternating user/model turns).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from kvrelay.server.protocol import ApiError, ChatCompletionRequest, ChatMessage
from kvrelay.server.tool_protocol import FunctionDef, NamedToolChoice

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_SEP = "\n"  # between two calls of one turn
EMPTY_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool parameters ask for."""

    functions: tuple[FunctionDef, ...]  # the tools the prompt shows, under every mode
    # "auto": text or calls; "required": at least one call; "named": one call of ``forced_name``; "none": text only
    # (the tools stay in the prompt, as OpenAI's and vLLM's: the model still knows them, and a step switching to
    # "none" keeps the previous step's prompt as its exact prefix)
    mode: str
    forced_name: str | None = None
    parallel: bool = True  # several calls in one turn

    def schema_of(self, name: str) -> dict:
        """The schema a call's arguments are decoded under: the tool's, an object at its top (a schema without
        ``type``, ``{}`` say, would otherwise let the grammar write any JSON value there)."""
        for f in self.functions:
            if f.name == name:
                if f.parameters is None:
                    return EMPTY_ARGUMENTS_SCHEMA
                return f.parameters if "type" in f.parameters else {"type": "object", **f.parameters}
        raise KeyError(name)

    @property
    def may_call(self) -> bool:
        return self.mode != "none"

    @property
    def callable_names(self) -> tuple[str, ...]:
        if not self.may_call:
            return ()
        return (self.forced_name,) if self.forced_name else tuple(f.name for f in self.functions)


def call_prefix(name: str) -> str:
    """The fixed text before a call's arguments (the grammar forces it, ``call_text`` renders it)."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": '


def call_text(name: str, arguments: str) -> str:
    return f"{call_prefix(name)}{arguments}}}{CALL_CLOSE}"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------------- request side
def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tools), or an ApiError 400 naming the field at fault."""
    from kvrelay.server.schemas import check_schema  # jsonschema: imported with the first tool request

    if body.functions is not None or body.function_call is not None:
        param = "functions" if body.functions is not None else "function_call"
        raise ApiError(400, f"{param} is the deprecated function-calling API and is not supported: send tools "
                            "and tool_choice", param=param, code="unsupported")
    tools = body.tools or []
    names = [t.function.name for t in tools]
    for i, t in enumerate(tools):
        if names.index(t.function.name) != i:
            raise ApiError(400, f"tools[{i}].function.name {t.function.name!r} is given twice",
                           param=f"tools.{i}.function.name", code="invalid_value")
        if t.function.parameters is not None:
            check_schema(t.function.parameters, f"tools.{i}.function.parameters", strict=bool(t.function.strict),
                         arguments=True)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    if not tools:
        return None
    parallel = body.parallel_tool_calls is not False
    functions = tuple(t.function for t in tools)
    if choice == "none":
        return ToolPlan(functions, "none", None, parallel=False)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not one of "
                                f"the tools ({', '.join(names)})", param="tool_choice.function.name",
                           code="invalid_value")
        return ToolPlan(functions, "named", choice.function.name, parallel=False)
    return ToolPlan(functions, choice, None, parallel)


def answer_schema(body: ChatCompletionRequest) -> dict | None:
    """The JSON schema ``response_format`` asks a text answer to follow (None: free text); checked elsewhere
    (kvrelay.server.grammar.check_response_format)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        return fmt.json_schema.schema_
    return {"type": "object"}


def tool_system_text(functions: tuple[FunctionDef, ...], answer: dict | None = None) -> str:
    """The model-agnostic tool instructions appended to the system message. ``answer``: the JSON schema of a
    final answer (a response_format beside tools under "auto"): the grammar lets the turn be calls or that JSON,
    and a model that is never told the answer's form keeps calling tools."""
    lines = ["You can call these tools. Each is a JSON object with the tool's name, what it does and the "
             "JSON schema of its arguments:"]
    for f in functions:
        spec = {"name": f.name, "description": f.description or "",
                "parameters": f.parameters if f.parameters is not None else EMPTY_ARGUMENTS_SCHEMA}
        lines.append(json.dumps(spec, ensure_ascii=False))
    lines.append(f'To call a tool, answer with {CALL_OPEN}{{"name": <tool name>, "arguments": <arguments '
                 f"object>}}{CALL_CLOSE}, one call per line. The results come back as <tool_response> blocks.")
    if answer is not None:
        lines.append("Call the tools you need first. When <tool_response> blocks answer the question, call no "
                     "more tools: give the final answer as one JSON value of this JSON schema: "
                     f"{json.dumps(answer, ensure_ascii=False)}")
    return "\n".join(lines)


def _assistant_text(m: ChatMessage) -> str:
    text = m.text()
    calls = [call_text(c.function.name, c.function.arguments) for c in (m.tool_calls or [])]
    return text + CALL_SEP.join(calls)


def render_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> list[dict[str, str]]:
    """The messages as the chat template receives them: the tools in the system message, an assistant's calls
    in the call format, tool results (and a user message right after them) merged into one user turn.
    Message checks (roles, content) are the caller's."""
    out: list[dict[str, str]] = []
    names_by_id = {c.id: c.function.name for m in body.messages for c in (m.tool_calls or [])}
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        if role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": _assistant_text(m)})
        elif role == "tool":
            name = names_by_id.get(m.tool_call_id or "", "")
            block = f'<tool_response name="{name}">\n{m.text()}\n</tool_response>' if name else \
                f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_turn": "1"})
        elif role == "user" and out and out[-1].get("tool_turn"):
            out[-1]["content"] += "\n\n" + m.text()
        else:
            out.append({"role": role, "content": m.text()})
    for m in out:
        m.pop("tool_turn", None)
    if plan is not None:
        text = tool_system_text(plan.functions, answer_schema(body))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def check_tool_messages(body: ChatCompletionRequest) -> None:
    """Tool-call history the prompt can render: a tool message answers a call made before it."""
    seen: set[str] = set()
    for i, m in enumerate(body.messages):
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, f"messages[{i}] has tool_calls but role {m.role!r}: only an assistant makes calls",
                           param=f"messages.{i}.tool_calls", code="invalid_value")
        for c in m.tool_calls or []:
            seen.add(c.id)
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(400, f"messages[{i}] is a tool result without tool_call_id",
                               param=f"messages.{i}.tool_call_id", code="invalid_value")
            if m.tool_call_id not in seen:
                raise ApiError(400, f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no earlier tool call",
                               param=f"messages.{i}.tool_call_id", code="invalid_value")
