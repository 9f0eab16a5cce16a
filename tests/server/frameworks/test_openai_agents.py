"""The OpenAI Agents SDK, unchanged, against ``kvrelay serve``: its chat-completions model and its default
Responses model, a function tool loop, structured output (``output_type``) and a handoff."""

from __future__ import annotations

import asyncio
import uuid
from typing import Literal

import pytest
from agents import (
    Agent,
    HandoffOutputItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL
from tests.server.frameworks.conftest import CITY_WEATHER, SMOL, WEATHER_MARK

MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


def run(server, flow):
    """``flow(make_model)`` in a fresh event loop; ``make_model(kind, model_id)`` gives an Agents SDK model on a
    client of ``server`` made and closed in that loop."""

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await flow(lambda kind, model_id=MODEL: MODELS[kind](model=model_id, openai_client=client))
        finally:
            await client.close()

    return asyncio.run(main())


def settings(**kw) -> ModelSettings:
    # a fresh namespace per test: reuse within the flow only
    return ModelSettings(temperature=0, extra_body={"cache_salt": uuid.uuid4().hex}, **kw)


class CityFacts(BaseModel):
    # a Literal and a bounded integer: random weights never end a free string, a constrained one ends
    city: Literal["Lisbon", "Porto"]
    population: int = Field(ge=0, le=9999)
    coastal: bool


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_function_tool_loop(smol, kind):
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return CITY_WEATHER.format(city=city)

    async def flow(make_model):
        # "required" on the first step; the SDK resets it to "auto" once the tool ran (reset_tool_choice)
        agent = Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                      tools=[get_weather], model=make_model(kind, SMOL),
                      model_settings=settings(tool_choice="required", parallel_tool_calls=False, max_tokens=120))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = run(smol, flow)
    assert len(calls) == 1 and calls[0]  # called once, with arguments the SDK validated against its schema
    assert WEATHER_MARK in result.final_output
    cached = [r.usage.input_tokens_details.cached_tokens for r in result.raw_responses]
    assert len(cached) == 2 and cached[1] > 0, cached


class Weather(BaseModel):
    city: str
    temperature_c: int


@pytest.mark.slow
def test_function_tool_with_output_type_ends_with_a_parsed_object(smol):
    # tools and output_type on one agent, the SDK's defaults (tool_choice auto, parallel calls): every step
    # may be calls or the typed answer; SmolLM2 answers with the typed JSON once the prompt says that form
    # (without it, it called get_weather on every step until max_turns)
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return CITY_WEATHER.format(city=city)

    async def flow(make_model):
        agent = Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                      tools=[get_weather], output_type=Weather, model=make_model("chat", SMOL),
                      model_settings=settings(max_tokens=120))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = run(smol, flow)
    assert isinstance(result.final_output, Weather) and result.final_output.city


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_output_type_returns_a_parsed_object(server, kind):
    async def flow(make_model):
        agent = Agent(name="facts", instructions="Give facts about the city as JSON.", output_type=CityFacts,
                      model=make_model(kind), model_settings=settings(max_tokens=80))
        return await Runner.run(agent, "Lisbon")

    assert isinstance(run(server, flow).final_output, CityFacts)


def test_handoff_happens(server):
    async def flow(make_model):
        # random weights never end a free text; a JSON answer ends when its grammar does (the Responses API
        # reports a cut answer as incomplete, and the SDK raises on that)
        billing = Agent(name="billing", instructions="You answer billing questions.", output_type=CityFacts,
                        model=make_model("responses"), model_settings=settings(max_tokens=80))
        triage = Agent(name="triage", instructions="Route the user to the right agent.", handoffs=[billing],
                       model=make_model("responses"),
                       model_settings=settings(tool_choice="required", parallel_tool_calls=False, max_tokens=40))
        return billing, await Runner.run(triage, "I was charged twice.", max_turns=3)

    billing, result = run(server, flow)
    assert result.last_agent is billing and isinstance(result.final_output, CityFacts)
    handoffs = [i for i in result.new_items if isinstance(i, HandoffOutputItem)]
    assert len(handoffs) == 1 and handoffs[0].target_agent is billing
    assert len(result.raw_responses) == 2


def test_streamed_run_on_the_responses_model(server):
    calls: list[str] = []

    @function_tool
    def lookup(term: Literal["Rhine", "Danube"]) -> str:
        """Look a river up."""
        calls.append(term)
        return f"{term} is a river."

    async def flow(make_model):
        # the tool's result is the answer (random weights write no text that ends)
        agent = Agent(name="s", instructions="Use lookup.", tools=[lookup], model=make_model("responses"),
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=settings(tool_choice="required", parallel_tool_calls=False, max_tokens=60))
        streamed = Runner.run_streamed(agent, "What is the Rhine?", max_turns=2)
        return [e async for e in streamed.stream_events()], streamed

    events, streamed = run(server, flow)
    raw = [e.data.type for e in events if e.type == "raw_response_event"]
    assert raw[0] == "response.created" and raw[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in raw
    assert len(calls) == 1 and streamed.final_output == f"{calls[0]} is a river."
