"""Real agent frameworks against a real ``kvrelay serve`` process, with nothing downloaded at run time.

random:tiny (the ``server`` fixture) follows no prompt: flows it drives force what the model must produce
through the request (tool_choice "required", a handoff as the only tool, output_type's JSON schema), and
constrained decoding makes even random weights produce schema-valid calls and JSON. Flows whose answer must
read a tool's result run on SmolLM2-135M (embedded weights, the ``smol`` fixture of tests/server/conftest.py).

Offline: the Agents SDK's trace export and LangSmith are off; AutoGen is given the model's info (it would
otherwise refuse a model name it does not know); nothing calls tiktoken.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import SMOL

__all__ = ["SMOL"]
CITY_WEATHER = "{city}: 21 degrees Celsius, sunny."  # what the weather tool returns
WEATHER_MARK = "21"  # the tool's result is read when the final answer says it


@pytest.fixture(scope="session", autouse=True)
def offline_frameworks() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("OPENAI_AGENTS_DISABLE_TRACING", "LANGSMITH_TRACING",
                                            "LANGCHAIN_TRACING_V2", "OPENAI_API_KEY")}
    os.environ.update(OPENAI_AGENTS_DISABLE_TRACING="1", LANGSMITH_TRACING="false", LANGCHAIN_TRACING_V2="false",
                      OPENAI_API_KEY="unused")
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class ReplyLog:
    """The server's JSON replies as an httpx client received them (per step: usage and the kvrelay object),
    for frameworks whose own results drop ``cached_tokens`` (AutoGen's usage has no such field)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def hook(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith(("/chat/completions", "/responses")):
            await response.aread()
            if response.headers.get("content-type", "").startswith("application/json"):
                self.bodies.append(json.loads(response.content))

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"response": [self.hook]}, timeout=120)

    @property
    def cached_tokens(self) -> list[int]:
        return [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in self.bodies]
