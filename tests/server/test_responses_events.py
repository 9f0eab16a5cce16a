"""Response objects and SSE events of ``/v1/responses``, checked against the official client's types."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvrelay.server.events import DoneEvent, ToolCall, delta_of, tool_call_of, tool_calls_of
from kvrelay.server.responses import Reply, tool_call_json
from kvrelay.server.responses_events import ResponseRender, said_unstored
from kvrelay.server.responses_input import ResponsesRequest
from kvrelay.server.tool_protocol import FunctionDef
from kvrelay.server.tool_stream import ToolStream
from kvrelay.server.tools import ToolPlan, call_text

EVENTS = TypeAdapter(ResponseStreamEvent)
KV = {"method": "epic", "num_reused_tokens": 3}


def done(text: str, calls: list[dict] | None = None, finish: str = "stop", cut: dict | None = None) -> DoneEvent:
    return DoneEvent(finish, text, num_prompt_tokens=10, num_completion_tokens=4, num_cached_tokens=3, kvrelay=KV,
                     tool_calls=tuple(ToolCall(**c) for c in calls or []), cut_call=ToolCall(**cut) if cut else None)


def render(**kw) -> ResponseRender:
    return ResponseRender(ResponsesRequest(model="m", input="x", **kw), "m")


def parse(lines: list[str]) -> list:
    events = []
    for line in lines:
        head, data = line.split("\n")[:2]
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        events.append(EVENTS.validate_python(body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


CALL = {"id": "call_1", "name": "get", "arguments": '{"city": "Paris"}'}


def test_full_text_response_is_a_valid_response_with_cached_tokens():
    body = render(instructions="sys", metadata={"k": "v"}).full([], done("hello"))
    r = Response.model_validate(body)
    assert r.output_text == "hello" and r.status == "completed" and r.instructions == "sys"
    assert r.usage.input_tokens_details.cached_tokens == 3 and r.usage.total_tokens == 14
    assert body["kvrelay"] == KV and r.metadata == {"k": "v"}


def test_full_tool_calls_and_incomplete():
    r = Response.model_validate(render(tools=[{"type": "function", "name": "get"}]).full([], done("", [CALL],
                                                                                                   "tool_calls")))
    assert [(o.type, o.call_id, o.name, o.arguments) for o in r.output] == [
        ("function_call", "call_1", "get", CALL["arguments"])]
    cut = Response.model_validate(render(max_output_tokens=4).full([], done("abcd", finish="length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_text_stream_events_in_order_and_final_response_matches():
    r = render()
    lines = r.start() + r.text("hel") + r.text("lo") + r.finish(done("hello"))
    events = parse(lines)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hello"
    final = events[-1].response
    assert final.output_text == "hello" and final.output[0].id == events[2].item.id
    assert final.usage.input_tokens_details.cached_tokens == 3


def test_call_stream_text_then_calls_and_unstreamed_calls_still_appear():
    r = render()
    lines = (r.start() + r.text("ok") + r.call_piece(0, "call_1", "get", '{"city": ') + r.call_piece(0, None, None,
             '"Paris"}') + r.finish(done("ok", [CALL, {"id": "call_2", "name": "get", "arguments": "{}"}],
                                        "tool_calls")))
    events = parse(lines)
    kinds = [e.type for e in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(a.arguments, a.output_index) for a in args] == [(CALL["arguments"], 1), ("{}", 2)]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.output_index == 1)
    assert pieces == CALL["arguments"]
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert [o.call_id for o in final.output[1:]] == ["call_1", "call_2"]
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [o.id for o in final.output]


def test_an_empty_answer_is_an_empty_message_unless_it_was_cut():
    """Completed, an empty answer still streams an empty message; cut by max_output_tokens (a forced call cut before
    its name) it has no item at all, streamed or not."""
    r = render()
    events = parse(r.start() + r.finish(done("", finish="stop")))
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "message"
    assert events[-1].response.output_text == "" and events[-1].response.output[0].status == "completed"
    r = render()
    events = parse(r.start() + r.finish(done("", finish="length")))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.incomplete"]
    assert events[-1].response.output == [] == render().full([], done("", finish="length"))["output"]
    assert [o["type"] for o in render().full([], done("Sun", finish="length"))["output"]] == ["message"]


def test_a_call_cut_by_max_output_tokens_streams_as_an_incomplete_call_and_ends_as_full_s():
    """A call cut off after its name was streamed: its item closes "incomplete" with the arguments decoded so far,
    and response.incomplete's output is the non-streamed response's (the call, no message repeating its text)."""
    cut = {"id": "call_9", "name": "get", "arguments": '{"city": "Pa'}
    answer = done("", [CALL], "length", cut)
    r = render()
    events = parse(r.start() + r.call_piece(0, "call_1", "get", CALL["arguments"])
                   + r.call_piece(1, "call_9", "get", "") + r.call_piece(1, None, None, '{"city": ') + r.finish(answer))
    closed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status, i.arguments) for i in closed] == [
        ("function_call", "completed", CALL["arguments"]), ("function_call", "incomplete", cut["arguments"])]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    full = Response.model_validate(render().full([], answer))

    def shape(response):
        return [(o.type, o.status, o.call_id, o.name, o.arguments) for o in response.output]
    assert shape(final.response) == shape(full) == [("function_call", "completed", "call_1", "get", CALL["arguments"]),
                                                    ("function_call", "incomplete", "call_9", "get", cut["arguments"])]
    assert [o.id for o in final.response.output] == [i.id for i in closed]


def _generated(text: str, finish: str) -> tuple[list, DoneEvent]:
    """``text`` through a ToolStream under "auto", a character at a time: its delta events and done event."""
    stream = ToolStream(ToolPlan((FunctionDef(name="get"),), "auto"))
    deltas = [delta_of(d) for ch in text for d in stream.feed(ch)]
    last, answer = stream.close(finish)
    deltas += [delta_of(d) for d in last]
    return deltas, DoneEvent(answer["finish_reason"], answer["text"], 10, 4, 3, KV, tool_calls_of(answer["tool_calls"]),
                             tool_call_of(answer["cut_call"]), tuple(answer["text_runs"]))


def _streamed(deltas: list, answer: DoneEvent) -> list:
    r = render()
    lines = r.start()
    for d in deltas:
        piece = d.tool_call
        lines += r.text(d.text) if piece is None else r.call_piece(piece.index, piece.id, piece.name, piece.arguments)
    return parse(lines + r.finish(answer))


def _shape(output) -> list[tuple]:
    return [(o.type, o.status, [c.text for c in o.content]) if o.type == "message" else
            (o.type, o.status, o.call_id, o.name, o.arguments) for o in output]


A, B = call_text("get", '{"city": "Paris"}'), call_text("get", '{"city": "Rome"}')


@pytest.mark.parametrize(("text", "finish", "kinds"), [
    (A + "\nDone.", "stop", ["function_call", "message"]),  # text after the call: after it in both
    ("Looking." + A + "\n" + B + " Both sunny.", "stop", ["message", "function_call", "function_call", "message"]),
    ("Looking." + A + " Then Rome." + B, "stop", ["message", "function_call", "message", "function_call"]),
    ("Looking." + A + "\nAnd", "length", ["message", "function_call", "message"]),
])
def test_text_and_calls_are_listed_in_generation_order_streamed_or_not(text, finish, kinds):
    """Text after or between calls is a message item where it was generated, in the stream's last event and in the
    non-streamed response alike; only the last item of a cut answer is incomplete."""
    deltas, answer = _generated(text, finish)
    events = _streamed(deltas, answer)
    full = Response.model_validate(render().full(deltas, answer))
    assert [o.type for o in full.output] == kinds
    assert _shape(events[-1].response.output) == _shape(full.output)
    closed = [e.item for e in events if e.type == "response.output_item.done"]
    assert _shape(closed) == _shape(full.output)
    assert "".join(c.text for o in full.output if o.type == "message" for c in o.content) == answer.text
    assert [o.status for o in full.output] == ["completed"] * (len(kinds) - 1) + [ResponseRender.status_of(answer)]


def _one_item_open_at_a_time(events: list) -> None:
    """OpenAI's stream order: an item's events (and its .done ones) all come between its output_item.added and its
    output_item.done, and the next item is added only after that."""
    open_index = None
    for e in events:
        if e.type == "response.output_item.added":
            assert open_index is None, f"item {e.output_index} added while item {open_index} is open"
            open_index = e.output_index
        elif e.type == "response.output_item.done":
            assert e.output_index == open_index
            open_index = None
        elif hasattr(e, "output_index"):
            assert e.output_index == open_index, f"{e.type} of item {e.output_index} while {open_index} is open"
    assert open_index is None


@pytest.mark.parametrize("text", [A + "\n" + B, "Looking." + A, A + "\nDone.", A + "\n" + B + "\nBoth sunny.",
                                  "Looking." + A + " Then Rome." + B])
def test_each_item_closes_with_its_final_content_before_the_next_is_added(text):
    deltas, answer = _generated(text, "stop")
    events = _streamed(deltas, answer)
    _one_item_open_at_a_time(events)
    final = events[-1].response

    def minted_elsewhere(response: Response) -> dict:  # ids and clocks each render mints for itself
        body = response.model_dump(exclude={"id", "created_at", "completed_at"})
        return body | {"output": [{k: v for k, v in o.items() if k != "id"} for o in body["output"]]}
    assert minted_elsewhere(final) == minted_elsewhere(Response.model_validate(render().full(deltas, answer)))
    closed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in closed] == [o.model_dump() for o in final.output]
    args_done = [(e.item_id, e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    assert args_done == [(o.id, o.arguments) for o in final.output if o.type == "function_call"]
    text_done = [(e.item_id, e.text) for e in events if e.type == "response.output_text.done"]
    assert text_done == [(o.id, o.content[0].text) for o in final.output if o.type == "message"]


def test_two_streamed_calls_close_one_by_one():
    r = render()
    second = {"id": "call_2", "name": "get", "arguments": "{}"}
    lines = (r.start() + r.call_piece(0, "call_1", "get", CALL["arguments"]) + r.call_piece(1, "call_2", "get", "{}")
             + r.finish(done("", [CALL, second], "tool_calls")))
    events = parse(lines)
    assert [(e.type, getattr(e, "output_index", None)) for e in events[2:]] == [
        ("response.output_item.added", 0), ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.completed", None)]
    assert [o.arguments for o in events[-1].response.output] == [CALL["arguments"], "{}"]


def test_the_answers_calls_are_matched_to_the_streamed_ones_by_id():
    """An announced call the parser then read as text (index 0) leaves the answer's first call at stream index 1:
    that call still closes with its final content and is in the last event's output."""
    raw = '<tool_call>{"name": "get", "arguments": [1]}</tool_call>'
    r = render()
    events = parse(r.start() + r.call_piece(0, "call_x", "get", "[1") + r.text(raw)
                   + r.call_piece(1, "call_1", "get", CALL["arguments"]) + r.finish(done(raw, [CALL], "tool_calls")))
    _one_item_open_at_a_time(events)
    args_done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    final = [o for o in events[-1].response.output if o.type == "function_call" and o.call_id == "call_1"]
    assert len(final) == 1 and args_done[final[0].id] == CALL["arguments"]


def test_a_call_a_stop_string_cuts_is_an_incomplete_item_of_a_completed_response_streamed_or_not():
    """A stop string is no max_output_tokens: the response is "completed" (no incomplete_details), and the call it cut
    after its name is the function_call item the stream announced, "incomplete" (its arguments are partial)."""
    deltas, answer = _generated("Looking." + A[: -len('"Paris"}}</tool_call>')], "stop")
    events = _streamed(deltas, answer)
    full = Response.model_validate(render().full(deltas, answer))
    assert (full.status, full.incomplete_details, events[-1].type) == ("completed", None, "response.completed")
    assert _shape(full.output) == [("message", "completed", ["Looking."]),
                                   ("function_call", "incomplete", answer.cut_call.id, "get", '{"city": ')]
    assert _shape(events[-1].response.output) == _shape(full.output)


def test_chat_answers_report_a_cut_call_as_openai_does():
    cut = ToolCall("call_9", "get", '{"city": "Pa')
    answer = DoneEvent("length", "", 10, 4, 3, KV, (), cut)
    message = Reply("m", True, False).full([], answer)["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"] == [tool_call_json(cut)]


def test_error_event_shape():
    r = render()
    event = parse([r.error(400, "bad", "input", "invalid_value")])[0]
    assert event.type == "error" and event.message == "bad" and event.code == "invalid_value"


def test_an_unstored_response_says_store_false_in_the_events_that_carry_it():
    render = ResponseRender(ResponsesRequest(model="m", input="hi"), "m")
    created, in_progress = render.start()
    out = said_unstored(created)
    assert out.startswith("event: response.created\ndata: ") and out.endswith("\n\n")
    body = json.loads(out.partition("data: ")[2])
    assert body["response"]["store"] is False and body["sequence_number"] == 0
    assert json.loads(created.partition("data: ")[2])["response"]["store"] is True
    delta = render.text("Hello")
    assert [said_unstored(line) for line in delta] == delta  # no response object: unchanged
