"""LangGraph's prebuilt ReAct agent with langchain-openai's ChatOpenAI, unchanged, against ``kvrelay serve``."""

from __future__ import annotations

import uuid

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from tests.server.frameworks.conftest import CITY_WEATHER, SMOL, WEATHER_MARK


def chat_model(server, model_id: str, **kw) -> ChatOpenAI:
    return ChatOpenAI(model=model_id, base_url=f"{server.url}/v1", api_key="none", temperature=0, max_retries=0,
                      timeout=120, extra_body={"cache_salt": uuid.uuid4().hex}, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True])
def test_react_agent_tool_loop(smol, streaming):
    calls: list[dict] = []

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append({"city": city})
        return CITY_WEATHER.format(city=city)

    # stream_usage: a streamed step reports usage (cached tokens included) only when asked to, as on OpenAI
    llm = chat_model(smol, SMOL, max_tokens=40, streaming=streaming, stream_usage=True)

    def pick_model(state, runtime):
        """The first step must call the tool, the step after its result must answer (LangGraph's dynamic model)."""
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return llm.bind_tools([get_weather], tool_choice="none" if answered else "required",
                              parallel_tool_calls=False)  # as docs/agents.md: one call, not a repeated one

    agent = create_react_agent(pick_model, [get_weather],
                               prompt="Answer weather questions with the get_weather tool.")
    messages = agent.invoke({"messages": [("user", "What is the weather in Paris?")]},
                            {"recursion_limit": 6})["messages"]
    steps = [m for m in messages if isinstance(m, AIMessage)]
    assert len(calls) == 1 and calls[0]["city"]
    call = steps[0].tool_calls[0]
    # langchain parsed the arguments' JSON (invalid JSON would land in invalid_tool_calls)
    assert call["name"] == "get_weather" and call["args"] == calls[0] and not steps[0].invalid_tool_calls
    assert len(steps) == 2 and WEATHER_MARK in steps[1].content
    cached = [m.usage_metadata["input_token_details"].get("cache_read", 0) for m in steps]
    assert cached[1] > 0, cached
