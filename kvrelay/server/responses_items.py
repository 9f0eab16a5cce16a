"""The input items of a stored response (``GET /v1/responses/{id}/input_items``, the openai client's
``responses.input_items.list``): what the response was generated from, as Responses items with ids, one page at a
time.

A response's input items are the items the model read: a continued response's (``previous_response_id``) start with
the previous response's input items and its output, then the request's own ``input``; ``instructions`` are not
items (OpenAI does not carry them over either). Reasoning items in ``input`` are not read here
(kvrelay.server.responses_input), so they are not listed. Every item gets an id of the server's at put time (a
client's ``id`` on an input item is not kept: ids must be unique within the list for ``after`` to page by them);
items of a previous response's output keep the ids that response returned.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvrelay.server.protocol import ApiError
from kvrelay.server.responses_input import IGNORED_INCLUDES, LOGPROBS_INCLUDE

MAX_PAGE_ITEMS = 100
DEFAULT_PAGE_ITEMS = 20


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _parts(content: Any, role: str) -> list[dict]:
    """A message's content as the parts OpenAI lists: ``output_text`` (or ``refusal``) for the assistant's,
    ``input_text`` for the others'. ``content`` was checked when the request was translated."""
    if content is None:
        return []
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    parts = []
    for part in content:
        if part["type"] == "refusal":
            parts.append({"type": "refusal", "refusal": part["refusal"]})
        elif role == "assistant":
            parts.append({"type": "output_text", "text": part["text"], "annotations": []})
        else:
            parts.append({"type": "input_text", "text": part["text"]})
    return parts


def input_items(items: str | list[dict[str, Any]]) -> list[dict]:
    """A request's ``input`` as the Responses items ``input_items`` lists, each with a new id. Call it on an
    ``input`` that ``input_messages`` translated without a 400."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type") or "message"
        if kind == "message":
            listed.append({"id": _new_id("msg_"), "type": "message", "role": item["role"], "status": "completed",
                           "content": _parts(item.get("content"), item["role"])})
        elif kind == "function_call":
            status = "incomplete" if item.get("status") == "incomplete" else "completed"  # a cut call stays one
            listed.append({"id": _new_id("fc_"), "type": "function_call", "status": status,
                           "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]})
        elif kind == "function_call_output":
            listed.append({"id": _new_id("fco_"), "type": "function_call_output", "status": "completed",
                           "call_id": item["call_id"], "output": item.get("output") or ""})
    return listed


def check_includes(values: list[str]) -> None:
    """The ``include`` values OpenAI documents are accepted (the items listed carry what they carry); another
    is a 400 naming it."""
    for i, value in enumerate(values):
        if value != LOGPROBS_INCLUDE and value not in IGNORED_INCLUDES:
            raise ApiError(400, f"include[{i}] {value!r} is not one of "
                                f"{', '.join((LOGPROBS_INCLUDE, *IGNORED_INCLUDES))}", param="include",
                           code="invalid_value")


def item_page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """One page of ``items`` (stored oldest first) as OpenAI's list object: ``limit`` items in ``order``, starting
    after the item whose id is ``after``; a 400 naming ``after`` when no item has that id."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((k + 1 for k, item in enumerate(ordered) if item["id"] == after), -1)
        if start < 0:
            raise ApiError(400, f"after {after!r} is not the id of an input item of this response", param="after",
                           code="invalid_value")
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
