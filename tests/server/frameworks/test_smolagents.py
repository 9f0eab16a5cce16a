"""smolagents' ToolCallingAgent with OpenAIServerModel, unchanged, against ``kvrelay serve`` (SmolLM2-135M).

What smolagents sends on every step: ``tool_choice: "required"``, ``stop: ["Observation:", "Calling tools:"]``,
its tools plus ``final_answer``, and the history as plain text (an assistant turn "Calling tools: [...]", a user
turn "Observation: ..."), not as OpenAI tool-call messages. Under "required" each step is a schema-valid call.
``parallel_tool_calls=False`` (an OpenAI parameter the model passes through) keeps a small model from writing
the same call again and again until max_tokens.

On SmolLM2 the agent does not end through ``final_answer``: greedy, the second step calls ``get_weather`` again
(the tool name's first token: "get" about 0.85, "final" about 0.15), so the flow runs to max_steps; that is the
model's choice, not the grammar's. The test holds what the server owes: the tool is called with schema-valid
arguments, its result comes back in the next step's prompt, and that step reports reuse.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from jsonschema import Draft202012Validator
from smolagents import ActionStep, OpenAIServerModel, ToolCallingAgent, tool

from tests.server.frameworks.conftest import CITY_WEATHER, SMOL, WEATHER_MARK


@pytest.mark.slow
def test_tool_calling_agent_tool_loop(smol):
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
            city: the city's name
        """
        calls.append(city)
        return CITY_WEATHER.format(city=city)

    replies: list[dict] = []

    def keep(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            replies.append(json.loads(response.content))

    http = httpx.Client(event_hooks={"response": [keep]}, timeout=300)
    model = OpenAIServerModel(model_id=SMOL, api_base=f"{smol.url}/v1", api_key="none",
                              client_kwargs={"http_client": http, "max_retries": 0}, temperature=0, max_tokens=60,
                              parallel_tool_calls=False, extra_body={"cache_salt": uuid.uuid4().hex})
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=2, verbosity_level=0)
    run = agent.run("What is the weather in Paris?", stream=True)
    try:
        num_steps = 0
        for event in run:
            num_steps += isinstance(event, ActionStep)
            if num_steps == 2:
                break
    finally:
        run.close()
        http.close()

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
    made = [c for s in steps for c in (s.tool_calls or [])]
    assert calls and made, [s.model_output for s in steps]
    for call in made:
        assert call.name in ("get_weather", "final_answer")
        if call.name == "get_weather":
            Draft202012Validator(schema).validate(call.arguments)
    assert WEATHER_MARK in (steps[0].observations or "")  # the tool's result, as the next step reads it
    tool_steps = [r for r in replies if r["choices"][0]["finish_reason"] == "tool_calls"]
    assert len(tool_steps) >= 2
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in tool_steps[1:]), \
        [r["usage"] for r in replies]
