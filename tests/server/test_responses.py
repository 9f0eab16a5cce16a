"""Chat completion bodies and chunks (kvrelay.server.responses.Reply): what a client assembles from the stream is
the non-streamed message, its null or "" content included, whatever the turn's first event."""

from __future__ import annotations

import json

import pytest

from kvrelay.server.events import DeltaEvent, DoneEvent, ToolCall, ToolCallPiece
from kvrelay.server.responses import Reply

CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')


def _done(text: str = "", calls: tuple[ToolCall, ...] = (), cut: ToolCall | None = None,
          runs: tuple[tuple[int, str], ...] = ()) -> DoneEvent:
    reason = "length" if cut else ("tool_calls" if calls else "stop")
    return DoneEvent(reason, text, 5, 3, 0, {}, tool_calls=calls, cut_call=cut, text_runs=runs)


def _call_pieces(call: ToolCall, index: int = 0) -> list[DeltaEvent]:
    return [DeltaEvent("", ToolCallPiece(index, call.id, call.name, "")),
            DeltaEvent("", ToolCallPiece(index, None, None, call.arguments))]


# (deltas, done): the event sequences a turn can produce, "auto" unless the name says the turn is calls only
TURNS = {
    "text": ([DeltaEvent("It is "), DeltaEvent("sunny.")], _done("It is sunny.")),
    "calls only": (_call_pieces(CALL), _done(calls=(CALL,))),
    "text, then a call": ([DeltaEvent("Let me look."), *_call_pieces(CALL)],
                          _done("Let me look.", (CALL,), runs=((0, "Let me look."),))),
    "a call, then text": ([*_call_pieces(CALL), DeltaEvent("Done.")], _done("Done.", (CALL,), runs=((1, "Done."),))),
    "a cut call only": (_call_pieces(ToolCall("call_2", "get_weather", '{"ci')), _done(
        cut=ToolCall("call_2", "get_weather", '{"ci'))),
    "nothing": ([], _done()),
}


def _assembled(lines: list[str]) -> str | None:
    """The content a client assembles from the chunks (None until a delta carries some, as the openai client)."""
    content = None
    for line in lines:
        body = line.removeprefix("data: ").strip()
        if body == "[DONE]":
            continue
        for choice in json.loads(body)["choices"]:
            piece = choice["delta"].get("content")
            if piece is not None:
                content = (content or "") + piece
    return content


@pytest.mark.parametrize("turn,calls_only", [(turn, False) for turn in TURNS] +
                         [(turn, True) for turn, (_, done) in TURNS.items() if not done.text])  # calls only: no text
def test_the_streamed_content_is_the_answers_null_or_text(turn, calls_only):
    deltas, done = TURNS[turn]
    reply = Reply("m", chat=True, logprobs=False, calls_only=calls_only)
    first = deltas[0] if deltas else done
    lines = [reply.first_chunk(first), *(reply.delta_chunk(d) for d in deltas), *reply.final_chunks(done, False)]
    whole = reply.full(deltas, done)["choices"][0]["message"]["content"]
    assert _assembled(lines) == whole
    assert (whole is None) == (not done.text and (calls_only or bool(done.all_calls)))


def test_the_role_chunk_of_a_call_first_turn_says_null_content():
    deltas, _ = TURNS["calls only"]
    chunk = json.loads(Reply("m", chat=True, logprobs=False).first_chunk(deltas[0]).removeprefix("data: "))
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": None}
