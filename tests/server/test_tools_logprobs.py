"""Log-probabilities of constrained output: where the grammar leaves fewer tokens than ``top_logprobs`` asks, the
masked ones (-inf, not JSON) are not listed, and the answer is a 200 (it was a 500 from the JSON encoder). With tools,
the tokens that wrote call markup only are left out, streamed or not (OpenAI's chat logprobs cover the content)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from kvrelay.server import grammar
from kvrelay.server.events import delta_of
from kvrelay.server.job import Job
from kvrelay.server.tool_protocol import FunctionDef
from kvrelay.server.tool_stream import ToolStream
from kvrelay.server.tools import ToolPlan
from tests.server.inproc import MODEL, make_app

pytestmark = pytest.mark.skipif(grammar.xgr is None, reason="needs the tools extra (xgrammar)")
PICK = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": PICK}}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}}


def _no_constant(name: str):
    raise AssertionError(f"{name} is not JSON")


@pytest.mark.parametrize("stream", [False, True])
def _entries(stream: bool, **kw) -> tuple[list[dict], dict | None]:
    """The logprobs entries of a chat answer (a stream's from its chunks), and the non-streamed message."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "stream": stream, **kw}
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        return reply.json()["choices"][0]["logprobs"]["content"], reply.json()["choices"][0]["message"]
    events = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e, parse_constant=_no_constant) for e in events[:-1]]
    return [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
            for e in c["choices"][0]["logprobs"]["content"]], None


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_of_constrained_json_list_only_tokens_the_grammar_allows(stream):
    entries, _ = _entries(stream, response_format=JSON_FORMAT)
    assert entries and all(math.isfinite(e["logprob"]) for e in entries)
    tops = [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert all(math.isfinite(v) for v in tops)
    assert min(len(e["top_logprobs"]) for e in entries) < 5  # forced text: fewer than 5 tokens were possible


def test_the_first_tokens_top_logprobs_are_the_grammars_too():
    # the first token is sampled inside the engine's prefill: its logprobs came from the unmasked logits
    entries, _ = _entries(False, response_format=JSON_FORMAT)
    listed = [t["token"] for t in entries[0]["top_logprobs"]]
    assert listed and all(t.lstrip().startswith("{") for t in listed), listed  # a JSON object's start


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_a_calls_only_answer_lists_no_tokens_streamed_or_not(choice):
    """Its tokens all wrote call markup (``<tool_call>``, the name, the arguments, the closing tag), which no content
    shows: as OpenAI's, whose chat logprobs cover the content only."""
    whole, message = _entries(False, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    streamed, _ = _entries(True, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert message["content"] is None and len(message["tool_calls"]) == 1
    assert whole == streamed == []


def _listed_tokens(tokens: list[str], mode: str = "auto") -> list[str]:
    """The tokens whose logprobs a job sends when its output is ``tokens``, fed one a step through a ToolStream
    (each entry stands for its token: the job's own logprobs bookkeeping and event batching, no model)."""
    sent: list = []
    job = Job(lambda: None, "ns", "full", None, 1, 0.0, 1.0, 0, [], 0, False, sent.append,
              tool_stream=ToolStream(ToolPlan((FunctionDef(name="search"),), mode)))
    job.seq = SimpleNamespace(output_ids=[])
    for token in tokens:
        job.seq.output_ids.append(len(job.seq.output_ids))
        job.logprobs.append({"token": token})
        job._emit_deltas([delta_of(d) for d in job.tool_stream.feed(token)])
    job._emit_deltas([delta_of(d) for d in job.tool_stream.close("stop")[0]])
    assert all(e.logprobs is None for e in sent if e.tool_call is not None)  # no call piece carries any
    return [entry["token"] for e in sent for entry in (e.logprobs or [])]


CALL = ["<tool", "_call", '>{"name": "search", "arguments": ', '{"q"', ': "a"}', "}</tool_call>"]


@pytest.mark.parametrize(("tokens", "listed"), [
    (["Hi", " <", "tool", *CALL[1:], "\n", "Done"], ["Hi", " <", "\n", "Done"]),  # " <" wrote content too
    ([*CALL, "\n", *CALL], []),  # the newline between two calls is no content
    (["<tool", "s", " here"], ["<tool", "s", " here"]),  # an opener that was none is content
    (["\n", "\n"], ["\n", "\n"]),  # whitespace alone is the answer
    ([*CALL[:3], "[1]", "}</tool_call>"], []),  # arguments that are no object: still a call
    (['<tool_call>{"name": "nope", "arguments": {}}', "</tool_call>"],
     ['<tool_call>{"name": "nope", "arguments": {}}', "</tool_call>"]),  # no callable tool's: content under auto
])
def test_tokens_that_wrote_call_markup_only_are_left_out(tokens, listed):
    assert _listed_tokens(tokens) == listed


def test_markup_naming_no_tool_under_a_forced_call_lists_nothing():
    assert _listed_tokens(['<tool_call>{"name": "nope", "arguments": {}}', "</tool_call>"], "required") == []
