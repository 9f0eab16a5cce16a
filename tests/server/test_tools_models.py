"""A tool loop on each embedded model (SmolLM2-135M, Gemma 3 270M) through the official client: the forced call
parses with schema-valid arguments, the tool's result goes back, and the next step reuses the call's decode KV."""

from __future__ import annotations

import importlib.util
import json
import uuid

import pytest
from jsonschema import Draft202012Validator

from kvrelay.weights.loader import ALIASES
from tests.server import conftest
from tests.server.conftest import Server

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real(request):
    if importlib.util.find_spec(ALIASES[request.param][0]) is None:
        pytest.skip(f"{request.param} is not installed")
    if request.param == conftest.SMOL:  # the session's SmolLM2 server (the same flags): one start, not two
        yield request.getfixturevalue("smol"), request.param
        return
    saved, conftest.START_TIMEOUT_S = conftest.START_TIMEOUT_S, 300  # a 262K-vocabulary model loads slower
    try:
        srv = Server("--model", request.param, "--kv-budget-gb", "0.5")
    finally:
        conftest.START_TIMEOUT_S = saved
    try:
        yield srv, request.param
    finally:
        srv.stop()


def test_a_tool_loop_on_the_embedded_model(real):
    server, model = real
    client = server.client()
    extra = {"cache_salt": uuid.uuid4().hex, "kvrelay": {"debug": True}}
    messages = [{"role": "system", "content": "You answer weather questions with the get_weather tool."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80,
                                           extra_body=extra)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    Draft202012Validator(WEATHER).validate(json.loads(call.function.arguments))

    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Paris: 21 degrees Celsius, sunny."}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=40, extra_body=extra)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    spliced = [r for r in second.model_extra["kvrelay"]["debug"]["refs"] if r["kind"] == "output"]
    assert spliced and spliced[0]["end"] - spliced[0]["start"] == first.usage.completion_tokens
    answer = second.choices[0]
    if answer.finish_reason == "tool_calls":  # "auto": another call is a valid next step of the loop
        for c in answer.message.tool_calls:
            Draft202012Validator(WEATHER).validate(json.loads(c.function.arguments))
    else:
        assert answer.message.content and answer.message.tool_calls is None
