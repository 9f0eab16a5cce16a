"""What the engine worker tells a request's HTTP side: typed events, in order any number of ``DeltaEvent``, then one
``DoneEvent`` or one ``ErrorEvent``. The worker emits them from its thread (``Job.emit``); the routes render them
as OpenAI JSON or SSE (kvrelay.server.responses, kvrelay.server.responses_events). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.protocol import ApiError


@dataclass(frozen=True)
class ToolCallPiece:
    """A piece of tool call ``index`` as it streams: its first piece has the call's ``id`` ("call_...") and ``name``
    and ``arguments`` ""; each later piece has ``id`` and ``name`` None and a piece of the arguments' JSON text (the
    pieces of one index concatenated are that call's arguments)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """A tool call: a known tool's name and the arguments' text as the model wrote it (a JSON object wherever the
    tool's schema let the grammar write only one; see kvrelay.server.tool_stream.ToolStream)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class DeltaEvent:
    """Text of the message content, or (``text`` "") a piece of a tool call; ``logprobs``: the OpenAI logprob
    entries of the tokens since the last delta that carried some (None without logprobs)."""

    text: str
    tool_call: ToolCallPiece | None = None
    logprobs: list[dict] | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The end of a request that was served.

    ``finish_reason`` is "tool_calls" when at least one call completed and none was cut; "length" when max_tokens
    cut the output, "stop" when a stop string or stop token id did. A call cut off is not in ``tool_calls``: it is
    ``cut_call``, with the arguments decoded so far, once its name was decoded, as the stream announced it; before
    that its text is in ``text`` under tool_choice "auto".
    ``text``: the message content (calls not included), "" when only calls came. ``text_runs``: where that text
    was generated among the calls, as runs (number of calls before it, its text) that join to ``text``; empty
    means one run before any call. ``kvrelay``: the response's extension object, as sent.
    """

    finish_reason: str
    text: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    kvrelay: dict[str, Any]
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)
    cut_call: ToolCall | None = None
    text_runs: tuple[tuple[int, str], ...] = ()

    @property
    def all_calls(self) -> tuple[ToolCall, ...]:
        """The calls an answer reports: the completed ones, then the one cut off."""
        return self.tool_calls + ((self.cut_call,) if self.cut_call is not None else ())

    @property
    def parts(self) -> tuple[str | ToolCall, ...]:
        """The answer's runs of text (str) and its calls, in the order they were generated."""
        runs = self.text_runs or (((0, self.text),) if self.text else ())
        calls, out, num_placed = self.all_calls, [], 0
        for at, text in runs:
            out += calls[num_placed:at]
            num_placed = max(num_placed, at)
            out.append(text)
        return (*out, *calls[num_placed:])


@dataclass(frozen=True)
class ErrorEvent:
    """A request that failed: the HTTP status and OpenAI's error fields."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # the error's own HTTP headers (a 503 shutting_down's Retry-After)

    @classmethod
    def of(cls, exc: ApiError) -> ErrorEvent:
        return cls(exc.status, exc.message, exc.param, exc.code, tuple((exc.headers or {}).items()))

    def api_error(self) -> ApiError:
        return ApiError(self.status, self.message, "invalid_request_error" if self.status < 500 else "server_error",
                        self.param, self.code, dict(self.headers) or None)


Event = DeltaEvent | DoneEvent | ErrorEvent


def delta_of(piece: dict) -> DeltaEvent:
    """A delta of kvrelay.server.tool_stream.ToolStream (``{"text", "tool_call"?}``) as a typed event."""
    call = piece.get("tool_call")
    return DeltaEvent(piece["text"], ToolCallPiece(call["index"], call["id"], call["name"], call["arguments"])
                      if call is not None else None)


def tool_call_of(call: dict | None) -> ToolCall | None:
    """ToolStream's cut call (``{"id", "name", "arguments"}``, or None) as a typed call."""
    return ToolCall(call["id"], call["name"], call["arguments"]) if call is not None else None


def tool_calls_of(calls: list[dict]) -> tuple[ToolCall, ...]:
    """ToolStream's closed calls (``{"id", "name", "arguments"}``) as typed calls."""
    return tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in calls)
