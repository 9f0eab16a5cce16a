"""AutoGen AgentChat's AssistantAgent with OpenAIChatCompletionClient, unchanged, against ``kvrelay serve``.

AssistantAgent sends ``tool_choice: "auto"`` whenever it has tools and offers no setting for it; SmolLM2-135M
does not choose to call by itself, so the flow forces the call through the client's ``extra_body`` (a create
argument AutoGen exposes) and runs two tool iterations without the reflection step (which would send no tools,
and "required" needs tools). The tool's result reaches the answer as AutoGen's tool-call summary.

AutoGen's usage object has no cached-tokens field, so the per-step reuse is read where kvrelay reports it on
every reply: ``usage.prompt_tokens_details.cached_tokens`` and the ``kvrelay`` object (an httpx response hook
on the client AutoGen builds)."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import ToolCallExecutionEvent, ToolCallRequestEvent, ToolCallSummaryMessage
from autogen_core.models import ModelFamily
from autogen_ext.models.openai import OpenAIChatCompletionClient

from tests.server.frameworks.conftest import CITY_WEATHER, SMOL, WEATHER_MARK, ReplyLog

# what AutoGen would otherwise look up by model name (and refuse an unknown one)
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": True, "family": ModelFamily.UNKNOWN,
              "structured_output": True, "multiple_system_messages": False}


@pytest.mark.slow
def test_assistant_agent_tool_loop(smol):
    calls: list[str] = []

    async def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return CITY_WEATHER.format(city=city)

    replies = ReplyLog()

    async def run():
        client = OpenAIChatCompletionClient(
            model=SMOL, base_url=f"{smol.url}/v1", api_key="none", model_info=MODEL_INFO, temperature=0,
            max_tokens=40, parallel_tool_calls=False, http_client=replies.client(),
            extra_body={"tool_choice": "required", "cache_salt": uuid.uuid4().hex})
        agent = AssistantAgent("weather", model_client=client, tools=[get_weather], max_tool_iterations=2,
                               reflect_on_tool_use=False, system_message="You answer weather questions.")
        try:
            return await agent.run(task="What is the weather in Paris?")
        finally:
            await client.close()

    result = asyncio.run(run())
    requested = [m for m in result.messages if isinstance(m, ToolCallRequestEvent)]
    executed = [m for m in result.messages if isinstance(m, ToolCallExecutionEvent)]
    assert len(calls) == 2 and len(requested) == 2 and len(executed) == 2
    for event, city in zip(requested, calls, strict=True):
        assert json.loads(event.content[0].arguments) == {"city": city}
    final = result.messages[-1]
    assert isinstance(final, ToolCallSummaryMessage) and WEATHER_MARK in final.content
    assert len(replies.cached_tokens) == 2 and replies.cached_tokens[1] > 0, replies.cached_tokens
    assert replies.bodies[1]["kvrelay"]["num_reused_tokens"] == replies.cached_tokens[1]
