"""OpenAI response bodies and SSE chunks of chat and text completions, from the worker's events
(kvrelay.server.events)."""

from __future__ import annotations

import json
import time
import uuid

from kvrelay.server.events import DeltaEvent, DoneEvent, ToolCall
from kvrelay.server.protocol import ApiError


class Reply:
    """Builds one request's response objects; ``chat`` selects chat.completion vs text_completion."""

    def __init__(self, model: str, chat: bool, logprobs: bool, calls_only: bool = False) -> None:
        self.model, self.chat, self.logprobs = model, chat, logprobs
        # the turn may hold calls only (tool_choice "required" or a named tool): its content is null, as beside
        # calls, even when max_tokens cut the call before its name and no call is left
        self.calls_only = calls_only
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.num_text_chars = 0  # text offsets for completion logprobs

    @staticmethod
    def usage(done: DoneEvent) -> dict:
        return {"prompt_tokens": done.num_prompt_tokens, "completion_tokens": done.num_completion_tokens,
                "total_tokens": done.num_prompt_tokens + done.num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.num_cached_tokens}}

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        if not self.logprobs or entries is None:
            return None
        if self.chat:
            return {"content": entries}
        offsets = []
        for e in entries:
            offsets.append(self.num_text_chars)
            self.num_text_chars += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    # ------------------------------------------------------------------ whole response
    def full(self, deltas: list[DeltaEvent], done: DoneEvent) -> dict:
        entries = None
        if self.logprobs:
            entries = [e for d in deltas for e in (d.logprobs or [])]
        choice: dict = {"index": 0, "finish_reason": done.finish_reason, "logprobs": self._logprobs(entries)}
        if self.chat:
            calls = done.all_calls  # a cut call too, as OpenAI reports it
            content = done.text or (None if calls or self.calls_only else "")
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [tool_call_json(c) for c in calls]
        else:
            choice["text"] = done.text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(done),
                "kvrelay": done.kvrelay}

    # ------------------------------------------------------------------ stream
    def _chunk(self, choices: list[dict], usage: dict | None = None, kvrelay: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        if kvrelay is not None:
            body["kvrelay"] = kvrelay
        return f"data: {json.dumps(body)}\n\n"

    def first_chunk(self, first: DeltaEvent | DoneEvent | None = None) -> str | None:
        """The role chunk, sent with the answer's ``first`` event. Its content starts what the deltas add up to, the
        whole answer's: null where the turn is calls only or the first thing written is a call (an ``auto`` turn of
        calls), "" where it is text."""
        if not self.chat:
            return None
        starts_with_call = (isinstance(first, DeltaEvent) and first.tool_call is not None) or (
            isinstance(first, DoneEvent) and not first.text and bool(first.all_calls))
        content = None if self.calls_only or starts_with_call else ""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                             "finish_reason": None}])

    def delta_chunk(self, event: DeltaEvent) -> str:
        choice: dict = {"index": 0, "logprobs": self._logprobs(event.logprobs), "finish_reason": None}
        if self.chat and event.tool_call:
            piece = event.tool_call
            call: dict = {"index": piece.index, "function": {"arguments": piece.arguments}}
            if piece.id is not None:
                call.update(id=piece.id, type="function")
                call["function"]["name"] = piece.name
            choice["delta"] = {"tool_calls": [call]}
        elif self.chat:
            choice["delta"] = {"content": event.text}
        else:
            choice["text"] = event.text
        return self._chunk([choice])

    def final_chunks(self, done: DoneEvent, include_usage: bool) -> list[str]:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": done.finish_reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        chunks = [self._chunk([choice], kvrelay=done.kvrelay)]
        if include_usage:
            chunks.append(self._chunk([], usage=self.usage(done), kvrelay=done.kvrelay))
        return chunks + ["data: [DONE]\n\n"]


def tool_call_json(call: ToolCall) -> dict:
    """A finished call as OpenAI's ``tool_calls`` entry."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def stream_error_chunk(err: ApiError) -> str:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return f"data: {json.dumps(body)}\n\n"
