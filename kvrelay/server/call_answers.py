"""Every tool call a conversation holds is answered, as OpenAI requires: a 400 otherwise.

The model is never shown a call without its result (it would answer as if the tool had said nothing), and a client
that forgot an answer learns it at once rather than from a confused reply. A result for a call that was never made
is a separate 400 (kvrelay.server.tools.check_tool_messages, kvrelay.server.responses_input.check_call_outputs),
checked first.

Chat completions: an assistant message's ``tool_calls`` are answered by the ``tool`` messages right after it, one per
``tool_call_id`` (OpenAI's rule and wording). The Responses API: each ``function_call`` (in ``input``, or in the
stored conversation ``previous_response_id`` continues) has a ``function_call_output`` with its ``call_id`` after it;
other items may stand between them, as a client replaying a response's output items (a call, then a message) sends.
A call cut off by ``max_output_tokens`` (``status: "incomplete"``) needs none: the stored conversation leaves it out,
and so does a replayed one (kvrelay.server.responses_input.is_cut_call).
"""

from __future__ import annotations

from typing import Any

from kvrelay.server.protocol import ApiError, ChatMessage
from kvrelay.server.responses_input import is_cut_call


def check_chat_calls_answered(messages: list[ChatMessage]) -> None:
    """400 (param ``messages.<i>.tool_calls``) for the first assistant message whose calls the tool messages right
    after it do not all answer."""
    for i, m in enumerate(messages):
        if m.role != "assistant" or not m.tool_calls:
            continue
        answered = set()
        for later in messages[i + 1 :]:
            if later.role != "tool":
                break
            answered.add(later.tool_call_id)
        missing = [c.id for c in m.tool_calls if c.id not in answered]
        if missing:
            raise ApiError(400, "An assistant message with 'tool_calls' must be followed by tool messages responding "
                           "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                           f"{', '.join(missing)} (messages[{i}])", param=f"messages.{i}.tool_calls",
                           code="invalid_value")


def check_input_calls_answered(items: str | list[dict[str, Any]], history: list[dict]) -> None:
    """400 (param ``input``) naming the first call, of the stored ``history`` (chat messages) or of ``items``, that
    no later output answers."""
    pending: dict[str, None] = {}  # call ids not answered yet, in the order they were made
    for m in history:
        for call in m.get("tool_calls") or []:
            pending[call.get("id")] = None
        if m.get("role") == "tool":
            pending.pop(m.get("tool_call_id"), None)
    for item in [] if isinstance(items, str) else items:
        if item.get("type") == "function_call" and not is_cut_call(item):
            pending[item.get("call_id")] = None
        elif item.get("type") == "function_call_output":
            pending.pop(item.get("call_id"), None)
    if pending:
        call_id = next(iter(pending))
        raise ApiError(400, f"No tool output found for function call {call_id}. Each function_call (in input or in "
                       "the response previous_response_id continues) needs a function_call_output item with its "
                       "call_id after it.", param="input", code="invalid_value")
