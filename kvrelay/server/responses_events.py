"""Response objects and SSE events of ``/v1/responses``, from the chat job's events (kvrelay.server.events).

One ``ResponseRender`` per request. Non-streaming: ``full(done)`` is the response object. Streaming: the
SSE events in OpenAI's order, each with a ``sequence_number``:
``response.created``, ``response.in_progress``; per output item ``response.output_item.added``, then for a
message ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, and for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; ``response.output_item.done``; finally ``response.completed``
(or ``response.incomplete`` when ``max_output_tokens`` cut the output), whose response equals ``full``'s.
Both list the items in the order the model generated them (OpenAI's order): text after a call is a message item
after it, and text between calls a message item between them. As OpenAI's stream does, an item is closed (its
``.done`` events) before the next one is added: the tool parser (tool_stream.ToolStream) has sent all of a
call's arguments by the time anything after it comes, so a call closes on its streamed content, which is the
answer's.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvrelay.server.events import DeltaEvent, DoneEvent, ToolCall
from kvrelay.server.responses_input import ResponsesRequest


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage_of(done: DoneEvent) -> dict:
    num_in, num_out = done.num_prompt_tokens, done.num_completion_tokens
    # cache writes are not counted per request (a publish can be skipped later for lack of room): 0, as
    # OpenAI reports for requests that wrote none
    details = {"cached_tokens": done.num_cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": num_in, "input_tokens_details": details,
            "output_tokens": num_out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_in + num_out}


def _logprobs(entries: list[dict] | None) -> list[dict]:
    """Chat-completions logprob entries in the Responses shape (no token ids)."""
    return [{"token": e["token"], "bytes": e["bytes"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]}
                              for t in e.get("top_logprobs", [])]} for e in entries or []]


class ResponseRender:
    def __init__(self, body: ResponsesRequest, model_id: str) -> None:
        self.body, self.model_id = body, model_id
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.num_events = 0
        self.items: list[dict] = []  # output items, streamed or built at the end
        self.message: dict | None = None  # the message item being streamed
        self.had_message = False
        self.text_logprobs: list[dict] = []
        self.calls_by_index: dict[int, dict] = {}  # function_call items being streamed, by call index

    # ------------------------------------------------------------------ the response object
    def envelope(self, status: str, done: DoneEvent | None = None) -> dict:
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        response: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model_id, "output": [dict(item) for item in self.items] if done else [],
            "instructions": b.instructions, "previous_response_id": b.previous_response_id,
            "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p, "max_output_tokens": b.max_output_tokens,
            "text": {"format": fmt}, "truncation": b.truncation or "disabled", "metadata": b.metadata or {},
            "store": b.store is not False, "error": None, "incomplete_details": None, "usage": None}
        if done is not None:
            response["usage"] = usage_of(done)
            response["kvrelay"] = done.kvrelay
            if done.finish_reason == "length":
                response["incomplete_details"] = {"reason": "max_output_tokens"}
            response["completed_at"] = int(time.time()) if status == "completed" else None
        return response

    @staticmethod
    def status_of(done: DoneEvent) -> str:
        return "incomplete" if done.finish_reason == "length" else "completed"

    def _message_item(self, text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(self.text_logprobs)}
        return {"id": self.message["id"] if self.message else _new_id("msg_"), "type": "message",
                "role": "assistant", "status": status, "content": [part]}

    @staticmethod
    def _call_item(call: dict, status: str, item_id: str | None = None) -> dict:
        return {"id": item_id or _new_id("fc_"), "type": "function_call", "status": status, "call_id": call["id"],
                "name": call["name"], "arguments": call["arguments"]}

    def full(self, deltas: list[DeltaEvent], done: DoneEvent) -> dict:
        """The whole response object (non-streaming)."""
        for d in deltas:
            self.text_logprobs += d.logprobs or []
        status = self.status_of(done)
        parts = done.parts or _empty_answer(status)
        for i, part in enumerate(parts):
            if isinstance(part, str):  # a message the model went on from (to a call) was completed
                self.items.append(self._message_item(part, status if i == len(parts) - 1 else "completed"))
            else:
                self.items.append(self._call_item(vars(part), "incomplete" if part is done.cut_call else "completed"))
        return self.envelope(status, done)

    # ------------------------------------------------------------------ stream
    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def start(self) -> list[str]:
        created = self.envelope("in_progress")
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def text(self, delta: str, logprobs: list[dict] | None = None) -> list[str]:
        out = self._close_calls()
        if self.message is None:
            self.had_message = True
            self.message = {"id": _new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                            "content": [], "text": ""}
            index = len(self.items)
            self.message["output_index"] = index
            self.items.append({})  # its place; the item is written when it closes
            item = {k: v for k, v in self.message.items() if k not in ("text", "output_index")}
            out += [self._event("response.output_item.added", output_index=index, item=item),
                    self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []})]
        self.message["text"] += delta
        self.text_logprobs += logprobs or []
        if delta:
            out.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                   output_index=self.message["output_index"], content_index=0, delta=delta,
                                   logprobs=_logprobs(logprobs)))
        return out

    def _close_message(self, text: str, status: str) -> list[str]:
        if self.message is None:
            return []
        index, item = self.message["output_index"], self._message_item(text, status)
        part = item["content"][0]
        self.items[index] = item
        out = [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=part["logprobs"]),
               self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
               self._event("response.output_item.done", output_index=index, item=item)]
        self.message = None
        return out

    def call_piece(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        """A streamed piece of tool call ``index``: its first piece carries the id and the name."""
        out = self._close_message(self.message["text"], "completed") if self.message else []
        call = self.calls_by_index.get(index)
        if call is None:
            out += self._close_calls()  # the call before this one is whole (see the module docstring)
            call = {"item_id": _new_id("fc_"), "id": call_id or _new_id("call_"), "name": name or "",
                    "arguments": "", "output_index": len(self.items), "closed": False}
            self.calls_by_index[index] = call
            self.items.append({})
            item = self._call_item(call, "in_progress", call["item_id"]) | {"arguments": ""}
            out.append(self._event("response.output_item.added", output_index=call["output_index"], item=item))
        if arguments:
            call["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=call["item_id"],
                                   output_index=call["output_index"], delta=arguments))
        return out

    def _close_call(self, call: dict, final: ToolCall | None = None, status: str = "completed") -> list[str]:
        if call["closed"]:
            return []
        call["closed"] = True
        if final is not None:
            call["id"], call["name"], call["arguments"] = final.id, final.name, final.arguments
        item = self._call_item(call, status, call["item_id"])
        self.items[call["output_index"]] = item
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=call["output_index"], name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=call["output_index"], item=item)]

    def _close_calls(self) -> list[str]:
        return [e for call in self.calls_by_index.values() for e in self._close_call(call)]

    def finish(self, done: DoneEvent) -> list[str]:
        """The closing events: the items still open, calls the stream did not show, the final response.
        The done event's calls are authoritative (the streamed pieces are their text as it was decoded)."""
        status = self.status_of(done)
        calls = done.all_calls
        out: list[str] = []
        if not self.had_message and not self.calls_by_index and (done.text or (not calls and _empty_answer(status))):
            out += self.text(done.text)  # a text the stream did not show (or an empty answer's message)
        if self.message is not None:  # the last run of text (those before a call closed at the call)
            out += self._close_message(next((p for p in done.parts[::-1] if isinstance(p, str)), done.text), status)
        streamed = {call["id"]: index for index, call in self.calls_by_index.items()}
        for final in calls:
            index = streamed.get(final.id)
            if index is None:  # a call the stream did not show: its item now
                index = max(self.calls_by_index, default=-1) + 1
                out += self.call_piece(index, final.id, final.name, final.arguments)
            out += self._close_call(self.calls_by_index[index], final,
                                    "incomplete" if final is done.cut_call else "completed")
        self.items = [item for item in self.items if item]
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self._event(kind, response=self.envelope(status, done))]

    def error(self, status: int, message: str, param: str | None, code: str | None) -> str:
        return self._event("error", code=code, message=message, param=param)


def _empty_answer(status: str) -> tuple[str, ...]:
    """The parts of an answer with no text and no call: an empty message when it completed; none when
    max_output_tokens cut it (a forced call cut before its name), as OpenAI's incomplete responses can have none."""
    return () if status == "incomplete" else ("",)


def said_unstored(line: str) -> str:
    """An SSE event line as it reads once its response was not stored: a response object in it says
    ``store: false`` (the closing ``response.completed``; its other lines carry none)."""
    head, sep, data = line.partition("data: ")
    body = json.loads(data) if sep else None
    if not isinstance(body, dict) or not isinstance(body.get("response"), dict):
        return line
    body["response"]["store"] = False
    return f"{head}{sep}{json.dumps(body)}\n\n"
