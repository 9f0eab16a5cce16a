"""Agents with tools on vLLM's own tool calling (``--enable-auto-tool-choice --tool-call-parser hermes``, the
exported folder's chat template rendering the tools) with kvrelay's connector, through the official ``openai``
client, as a user deploys them (docs/vllm.md "Tools").

Agent A is forced to call a tool, gets its result and answers; agent B, in another conversation, quotes the tool
result and A's answer. A's second step finds its first step's prompt and generated call as an exact stored prefix
(the template renders the call as the model wrote it), so its answer is plain vLLM's; B finds them at new positions
(``epic``), within epic's fidelity. The plain reference is the same server under a fresh ``cache_salt``: nothing is
reused there (its ``cached_tokens`` is 0), so vLLM prefills the same prompt ids itself.

Slow (a vLLM server starts; minutes on a loaded 2-core machine): ``make vllm-test``.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest

from tests.vllm.test_connector_server import CONNECTOR, MAX_KL_FIRST_TOKEN

TOOL_ARGS = ("--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a tool's result as weather services send it: long enough that B's quote of it outweighs the tokens the connector
# computes itself (B's own opening, epic's first 16 of each moved run); a short result is left to vLLM's prefill
FORECAST = json.dumps({"city": "Paris", "country": "FR", "now": {"temp_c": 21, "sky": "sunny", "wind_kmh": 12,
                                                                "wind_dir": "W", "humidity_pct": 40},
                       "hourly": [{"hour": h, "temp_c": 21 - (h - 14) // 2, "sky": "sunny" if h < 19 else "clear",
                                   "rain_mm": 0} for h in range(14, 22)]})
TOP_LOGPROBS = 20
# the connector's load line (``connector.start_load_kv``) in vLLM's output
LOAD_LINE = re.compile(r"request \S+: (\d+) tokens claimed, (\d+) loaded, (\d+) computed")


@pytest.fixture(scope="module")
def server(vllm_server_factory):
    return vllm_server_factory(CONNECTOR, extra_args=TOOL_ARGS)


def _call(server, messages: list[dict], salt: str, max_tokens: int, **tool_params) -> dict:
    """One greedy call: its message, cached tokens, generated ids and first-token top logprobs (by token id)."""
    reply = server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True,
        top_logprobs=TOP_LOGPROBS, extra_body={"cache_salt": salt, "return_tokens_as_token_ids": True},
        **tool_params)
    choice = reply.choices[0]
    tokens = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    details = reply.usage.prompt_tokens_details
    return {"message": choice.message, "finish_reason": choice.finish_reason, "usage": reply.usage,
            "cached_tokens": (details.cached_tokens if details else 0) or 0,
            "ids": [int(t.token.removeprefix("token_id:")) for t in tokens],
            "first_logprobs": {t.token: t.logprob for t in (tokens[0].top_logprobs if tokens else [])}}


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _num_loaded(server) -> list[int]:
    return [int(m.group(2)) for m in LOAD_LINE.finditer(server.log_path.read_text(errors="replace"))]


@pytest.fixture(scope="module")
def flow(server):
    """A's two steps and B's call under one salt: {name: (messages, call)}."""
    salt, tools = uuid.uuid4().hex, {"tools": [WEATHER]}
    a1 = [{"role": "system", "content": "You answer weather questions with the get_weather tool."},
          {"role": "user", "content": "What is the weather in Paris today?"}]
    first = _call(server, a1, salt, 40, **tools, tool_choice="required", parallel_tool_calls=False)
    call = first["message"].tool_calls[0] if first["message"].tool_calls else None
    assert call is not None, first
    a2 = [*a1, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
          {"role": "tool", "tool_call_id": call.id, "content": FORECAST}]
    second = _call(server, a2, salt, 32, **tools, tool_choice="none")
    b = [{"role": "system", "content": "You write one-line weather reports for travellers."},
         {"role": "user", "content": f"The weather service said: {FORECAST}\nAn assistant said: "
                                     f"{second['message'].content}\nWrite the report."}]
    return {"a1": (a1, first), "a2": (a2, second), "b": (b, _call(server, b, salt, 24))}


def test_vllms_parser_returns_the_forced_call_in_openais_shape(flow):
    _, first = flow["a1"]
    assert first["finish_reason"] == "tool_calls"
    (call,) = first["message"].tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments).get("city"), str)
    _, second = flow["a2"]
    assert second["message"].content and not second["message"].tool_calls


def test_the_tool_step_reuses_the_call_exactly_and_answers_as_plain_vllm(server, flow):
    """A's second step: its first step's prompt and the call it generated are one exact stored prefix (vLLM's
    cache holds whole 128-token blocks, the connector the rest), so the answer is plain prefill's, token for token.
    The prefix ends where vLLM's re-tokenization of the rendered call leaves the ids the constrained decode
    produced (past the argument's value, on SmolLM2), not at the call's start: the template renders the call as
    the grammar made the model write it."""
    a1, first = flow["a1"]
    messages, second = flow["a2"]
    prompt_ids = server.post("/tokenize", {"model": server.model, "messages": messages, "tools": [WEATHER],
                                           "add_generation_prompt": True})["tokens"]
    first_ids = server.post("/tokenize", {"model": server.model, "messages": a1, "tools": [WEATHER],
                                          "add_generation_prompt": True})["tokens"]
    num_exact = _common_prefix_len(prompt_ids, first_ids + first["ids"])
    assert num_exact - len(first_ids) >= 16, (num_exact, len(first_ids))  # the call's name and arguments' head
    assert second["cached_tokens"] == num_exact
    print(f"A's tool step: {second['cached_tokens']} of {second['usage'].prompt_tokens} prompt tokens cached "
          f"(step 1: {len(first_ids)} prompt, {len(first['ids'])} generated)")
    plain = _call(server, messages, uuid.uuid4().hex, 32, tools=[WEATHER], tool_choice="none")
    assert plain["cached_tokens"] == 0 and plain["usage"].prompt_tokens == second["usage"].prompt_tokens
    assert second["message"].content == plain["message"].content


def test_another_agent_quoting_the_tool_flow_reuses_its_kv_within_epics_fidelity(server, flow):
    from benchmarks.vllm_chain import first_token_fidelity

    messages, b = flow["b"]
    assert b["cached_tokens"] >= 16  # the connector's claim: nothing of B's prompt is in vLLM's own cache
    assert max(_num_loaded(server)) > 0  # spans loaded, not only computed
    plain = _call(server, messages, uuid.uuid4().hex, 24)
    assert plain["cached_tokens"] == 0 and plain["usage"].prompt_tokens == b["usage"].prompt_tokens
    _, kl = first_token_fidelity(plain["first_logprobs"], b["first_logprobs"])
    print(f"B: {b['cached_tokens']} of {b['usage'].prompt_tokens} prompt tokens cached, first-token KL {kl:.4f}; "
          f"text equal to plain vLLM's: {b['message'].content == plain['message'].content}")
    assert kl <= MAX_KL_FIRST_TOKEN
