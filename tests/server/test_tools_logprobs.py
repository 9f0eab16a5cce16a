"""Log-probabilities of constrained output: where the grammar leaves fewer tokens than ``top_logprobs`` asks, the
masked ones (-inf, not JSON) are not listed, and the answer is a 200 (it was a 500 from the JSON encoder)."""

from __future__ import annotations

import json
import math

import pytest
from starlette.testclient import TestClient

from kvrelay.server import grammar
from kvrelay.server.tools import call_prefix
from tests.server.inproc import MODEL, make_app

pytestmark = pytest.mark.skipif(grammar.xgr is None, reason="needs the tools extra (xgrammar)")
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}]


def _no_constant(name: str):
    raise AssertionError(f"{name} is not JSON")


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_of_a_forced_call_list_only_tokens_the_grammar_allows(stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick."}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "stream": stream}
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        events = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e, parse_constant=_no_constant) for e in events[:-1]]
        entries = [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                   for e in c["choices"][0]["logprobs"]["content"]]
    else:
        entries = reply.json()["choices"][0]["logprobs"]["content"]
    assert entries and all(math.isfinite(e["logprob"]) for e in entries)
    tops = [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert all(math.isfinite(v) for v in tops)
    assert min(len(e["top_logprobs"]) for e in entries) < 5  # forced text: fewer than 5 tokens were possible


def test_the_first_tokens_top_logprobs_are_the_grammars_too():
    # the first token is sampled inside the engine's prefill: its logprobs came from the unmasked logits
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick."}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    first = reply.json()["choices"][0]["logprobs"]["content"][0]
    listed = [t["token"] for t in first["top_logprobs"]]
    assert listed and all(call_prefix("pick").startswith(t) for t in listed), listed
