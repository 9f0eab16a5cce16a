"""The output side of tool calling: the model's text split into content and OpenAI ``tool_calls``, as streaming
deltas and a final answer (the call format is kvrelay.server.tools')."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvrelay.server.tools import CALL_CLOSE, CALL_OPEN, ToolPlan, new_call_id

# a call's head, up to its arguments: {"name": "NAME", "arguments":
_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


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
