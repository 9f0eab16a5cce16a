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
import re
import uuid
from dataclasses import dataclass, field

from kvrelay.server.protocol import ApiError, ChatCompletionRequest, ChatMessage
from kvrelay.server.tool_protocol import FunctionDef, NamedToolChoice

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_SEP = "\n"  # between two calls of one turn
_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
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


# ---------------------------------------------------------------------- output side
@dataclass
class _Call:
    index: int
    body: str = ""  # text after CALL_OPEN
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    num_sent_arg_chars: int = 0


class ToolStream:
    """Splits the model's output text into content and tool calls, as streaming deltas and a final answer.

    ``feed`` takes each new piece of text and returns delta events (see kvrelay.server.chat_route); ``close``
    returns the last deltas and the done event's fields. A call is announced (its first delta) once its head
    ``{"name": "NAME", "arguments": `` names a callable tool, and from then on it is a call, streamed or not: closed,
    its arguments are the text the model wrote (``_written_arguments``), never content. Markup naming no callable tool
    is never announced and no call: content under "auto", dropped where the turn is calls only ("required" or a named
    tool: the grammar allows no text there), so markup never answers a forced call. So is a call cut off before its
    name. A call cut off (by max_tokens, a stop string or a stop token id) after its name is the answer's
    ``cut_call``, with the arguments decoded so far (OpenAI's way; the finish_reason stays "length", or "stop"). A
    stop string that took only the closing tag (``stop: ["</tool_call>"]``) leaves a whole call: it is one of
    ``calls``, as vLLM's parsers read an unclosed last call. Under "none" every piece is content: the grammar keeps
    ``<tool_call>`` out of the text, and where no grammar runs (a server without xgrammar) text that looks like a call
    is still no call.

    Text comes in runs, each after the calls that closed before it (``text_runs``: (number of calls before it,
    its text)), so an answer can list text and calls in the order they were generated, as a stream shows them. A run
    that is whitespace only so far (the newline between two calls) is held back until more text or the end shows
    whether it is an answer: beside calls it is none, so the stream sends exactly the answer's text.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.pending = ""  # text outside calls not sent yet (a possible start of CALL_OPEN)
        self.held = ""  # whitespace-only text not sent yet: no answer if a call comes (see ``_text``)
        self.runs: list[list] = []  # [number of calls before it, text] per run of text (see the class docstring)
        self.call: _Call | None = None
        self.calls: list[dict] = []
        self.cut_call: dict | None = None  # the call cut off after its name (see the class docstring)
        self.num_calls_opened = 0

    def feed(self, delta: str) -> list[dict]:
        events: list[dict] = []
        if not self.plan.may_call:
            self._text(delta, events)
            return events
        if self.call is None:
            self.pending += delta
        else:
            self.call.body += delta
        while True:
            if self.call is None:
                at = self.pending.find(CALL_OPEN)
                if at < 0:
                    keep = _held_back(self.pending, CALL_OPEN)
                    self._text(self.pending[: len(self.pending) - keep], events)
                    self.pending = self.pending[len(self.pending) - keep :]
                    return events
                self._text(self.pending[:at], events)
                self.call = _Call(self.num_calls_opened, self.pending[at + len(CALL_OPEN) :])
                self.num_calls_opened += 1
                self.pending = ""
            end = self.call.body.find(CALL_CLOSE)
            if end < 0:
                self._stream_call(self.call, self.call.body, events)
                return events
            rest = self.call.body[end + len(CALL_CLOSE) :]
            self._close_call(self.call, self.call.body[:end], events)
            self.call, self.pending = None, rest

    @property
    def undecided(self) -> bool:
        """Whether text fed so far may still become content: a possible opener, whitespace held, a call whose name
        is not read yet (the job's logprobs of its tokens wait for what it becomes)."""
        return bool(self.pending or self.held) or (self.call is not None and self.call.name is None)

    def close(self, finish_reason: str) -> tuple[list[dict], dict]:
        """The remaining deltas and {"text", "text_runs", "tool_calls", "cut_call", "finish_reason"} of the done
        event."""
        events: list[dict] = []
        if self.call is not None:
            self._cut(self.call, finish_reason, events)
            self.call = None
        if self.plan.mode == "auto":  # else the turn is calls only: a cut "<tool_call>" is no text
            self._text(self.pending, events)
        self.pending = ""
        if self.held and not self.calls and self.cut_call is None:  # whitespace alone is the answer
            self.runs.append([0, self.held])
            events.append({"type": "delta", "text": self.held})
        self.held = ""  # beside calls, the newlines between them are no answer
        if self.calls and self.cut_call is None and finish_reason != "length":  # a cut call keeps why it was cut
            finish_reason = "tool_calls"
        return events, {"text": "".join(text for _, text in self.runs), "text_runs": [tuple(r) for r in self.runs],
                        "tool_calls": list(self.calls), "cut_call": self.cut_call, "finish_reason": finish_reason}

    # ------------------------------------------------------------------ internals
    def _text(self, text: str, events: list[dict]) -> None:
        """Send ``text`` of the answer; while its run is whitespace only, hold it (a call or ``close`` decides)."""
        if not text:
            return
        in_run = bool(self.runs) and self.runs[-1][0] == len(self.calls)
        if self.plan.may_call and not in_run and not (self.held + text).strip():
            self.held += text
            return
        text, self.held = self.held + text, ""
        if in_run:
            self.runs[-1][1] += text
        else:
            self.runs.append([len(self.calls), text])
        events.append({"type": "delta", "text": text})

    def _cut(self, call: _Call, finish_reason: str, events: list[dict]) -> None:
        """A call the output ended inside (see the class docstring)."""
        self._stream_call(call, call.body, events)  # its name, if the last piece completed it
        if call.name is None:
            self._no_call(CALL_OPEN + call.body, events)
            return
        sent = _sent_args(call.body, call)
        whole = call.body[: len(call.body) - _held_back(call.body, CALL_CLOSE)]
        arguments = _whole_arguments(whole)  # complete but for (the rest of) CALL_CLOSE
        complete = arguments is not None and arguments.startswith(sent)
        if not complete:
            arguments = call.body[_HEAD_RE.match(call.body).end() :]
        self._args(call, arguments[len(sent) :], events)
        answer = {"id": call.id, "name": call.name, "arguments": arguments}
        if complete and finish_reason != "length":  # a stop string took its closing tag (stop: ["</tool_call>"])
            self.calls.append(answer)
        else:
            self.cut_call = answer
        self.held = ""

    def _stream_call(self, call: _Call, body: str, events: list[dict]) -> None:
        """Stream what is certain of an open call: its name, then its arguments up to the last '}' and the
        whitespace before it (they may close the call rather than the arguments)."""
        head = _HEAD_RE.match(body)
        if head is None:
            return
        if call.name is None:
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return
            if name not in self.plan.callable_names:  # never announced: no call (the grammar writes none)
                return
            call.name = name
            events.append({"type": "delta", "text": "", "tool_call": {"index": call.index, "id": call.id,
                                                                      "name": call.name, "arguments": ""}})
        args = body[head.end() :]
        cut = args.rfind("}")
        safe = len(args[: cut if cut >= 0 else len(args)].rstrip())
        if safe > call.num_sent_arg_chars:
            self._args(call, args[call.num_sent_arg_chars : safe], events)
            call.num_sent_arg_chars = safe

    def _close_call(self, call: _Call, body: str, events: list[dict]) -> None:
        """A closed call: a known tool's once its name was read (the stream has announced it then), whatever its
        arguments; else no call (see ``_no_call``)."""
        self._stream_call(call, body, events)  # the head piece, if the call closed within one delta
        if call.name is None:
            self._no_call(CALL_OPEN + body + CALL_CLOSE, events)
            return
        arguments = _written_arguments(body)
        self._args(call, arguments[call.num_sent_arg_chars :], events)
        self.calls.append({"id": call.id, "name": call.name, "arguments": arguments})
        self.held = ""  # whitespace before a call is no answer

    def _no_call(self, text: str, events: list[dict]) -> None:
        """Call markup that is no known tool's call: content under "auto" (as the model's text), dropped where the
        turn is calls only ("required", a named tool), so internal markup never becomes a forced call's answer."""
        if self.plan.mode == "auto":
            self._text(text, events)

    def _args(self, call: _Call, piece: str, events: list[dict]) -> None:
        if piece:
            events.append({"type": "delta", "text": "", "tool_call": {"index": call.index, "id": None,
                                                                      "name": None, "arguments": piece}})


def _sent_args(body: str, call: _Call) -> str:
    head = _HEAD_RE.match(body)
    return body[head.end() :][: call.num_sent_arg_chars] if head else ""


def _written_arguments(body: str) -> str:
    """A closed call's body (its name read) after ``"arguments":``, less the body's closing brace: the arguments as
    written, a JSON object wherever the tool's schema let the grammar write only one. No parse decides whether it is a
    call, so what a stream sent (up to the last '}', ``_stream_call``) always starts it."""
    rest = body[_HEAD_RE.match(body).end() :].rstrip()
    try:
        json.loads(rest)  # the arguments alone, without a closing brace (no grammar writes that)
    except (json.JSONDecodeError, RecursionError):
        rest = rest.removesuffix("}").rstrip()
    return rest


def _whole_arguments(body: str) -> str | None:
    """The arguments' JSON text of the body of a call whose name was read, or None unless the body is the whole
    call, an arguments object (a stop string may have taken its closing tag)."""
    arguments = _written_arguments(body)
    try:
        whole = json.loads(body)
        return arguments if set(whole) == {"name", "arguments"} and isinstance(whole["arguments"], dict) and \
            json.loads(arguments) == whole["arguments"] else None
    except (json.JSONDecodeError, RecursionError):
        return None


def _held_back(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that could start ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
