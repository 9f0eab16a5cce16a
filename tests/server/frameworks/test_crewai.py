"""CrewAI (crewai==1.6.1, its native OpenAI provider), unchanged, against ``kvrelay serve`` (SmolLM2-135M).

What CrewAI sends: ``LLM(model=..., base_url=...)`` with a bare model name picks CrewAI's own OpenAI client
("openai/<name>" for a name CrewAI does not know routes to LiteLLM instead, which is not installed). An agent's
step is one system and one user message, no ``tools`` and no ``stop``: CrewAI 1.6.1 agents drive tools through
ReAct text ("Action:", "Action Input:") and cut the reply at "\\nObservation:" on the client. SmolLM2-135M never
writes that text (greedy, it answers "I'm ready to help!"), so the tool test calls a tool the way CrewAI's ``LLM``
does natively: ``llm.call(messages, tools=..., available_functions=...)`` runs the called function itself.

``CREWAI_TESTING`` skips CrewAI's first-run prompt (it waits 20 s for an answer on stdin); telemetry is off.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

pytest.importorskip("crewai")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402

from tests.server.frameworks.conftest import CITY_WEATHER, SMOL, WEATHER_MARK  # noqa: E402

DOCUMENT = (
    "kvrelay reuses the KV caches of a multi-agent pipeline. When one agent's prompt holds text another agent "
    "already read, such as a shared document, a system prompt or the first agent's answer, the server takes the "
    "KV it computed before, moves it to its new position, repairs the few tokens the new context changes, and "
    "prefills only what is new. Users judge it by time to first token, the share of the prompt reused, and how "
    "close its answers stay to a full prefill."
)


@pytest.fixture(autouse=True)
def quiet_crewai(monkeypatch) -> None:
    monkeypatch.setenv("CREWAI_TESTING", "true")
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("CREWAI_TRACING_ENABLED", "false")


class Exchanges:
    """Each chat-completions request body with the server's JSON reply to it."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.replies: list[dict] = []

    def on_request(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.requests.append(json.loads(request.content))

    def on_response(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            self.replies.append(json.loads(response.content))

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self.on_request], "response": [self.on_response]}, timeout=300)

    def cached_tokens(self) -> list[int]:
        return [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in self.replies]


def crew_llm(server, http: httpx.Client, **kw) -> LLM:
    return LLM(model=SMOL, base_url=f"{server.url}/v1", api_key="none", temperature=0, max_retries=0,
               client_params={"http_client": http}, **kw)


@pytest.mark.slow
def test_sequential_crew_second_agent_reuses_the_first_agents_kv(smol):
    log = Exchanges()
    with log.client() as http:
        llm = crew_llm(smol, http, max_tokens=40, extra_body={"cache_salt": uuid.uuid4().hex})
        writer = Agent(role="Summarizer", goal="Summarize documents", backstory="You write short summaries.",
                       llm=llm, max_iter=1)
        reviewer = Agent(role="Reviewer", goal="Review summaries", backstory="You check summaries against documents.",
                         llm=llm, max_iter=1)
        summarize = Task(description=f"Summarize this document:\n{DOCUMENT}", expected_output="A short summary.",
                         agent=writer)
        review = Task(description=f"Check the summary against this document:\n{DOCUMENT}",
                      expected_output="A verdict.", agent=reviewer, context=[summarize])
        result = Crew(agents=[writer, reviewer], tasks=[summarize, review], process=Process.sequential).kickoff()

    assert len(log.replies) == 2, log.replies
    assert result.tasks_output[0].raw  # the first agent answered
    second_prompt = json.dumps(log.requests[1]["messages"])
    assert DOCUMENT in second_prompt and json.dumps(result.tasks_output[0].raw)[1:-1] in second_prompt
    # a fresh cache_salt: the first step finds nothing, the second reuses the document and the first answer
    assert log.cached_tokens()[0] == 0 and log.cached_tokens()[1] > 0, [r["usage"] for r in log.replies]
    assert log.replies[1]["kvrelay"]["num_reused_tokens"] == log.cached_tokens()[1]


@pytest.mark.slow
def test_llm_call_runs_the_called_tool_and_the_next_call_reads_its_result(smol):
    calls: list[dict] = []

    def get_weather(city: str) -> str:
        calls.append({"city": city})
        return CITY_WEATHER.format(city=city)

    weather_tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    salt = uuid.uuid4().hex
    log = Exchanges()
    with log.client() as http:
        # CrewAI always sends tool_choice "auto" with tools; extra_body overrides it (a small model picks no tool)
        llm = crew_llm(smol, http, max_tokens=30, parallel_tool_calls=False,
                       extra_body={"cache_salt": salt, "tool_choice": "required"})
        question = [{"role": "system", "content": "You answer weather questions."},
                    {"role": "user", "content": "What is the weather in Paris?"}]
        observation = llm.call(question, tools=[weather_tool], available_functions={"get_weather": get_weather})
        # the answer step keeps the tools under CrewAI's "auto" (the prompt keeps step one's prefix, as "none" would
        # too), and the model answers in text
        answer_llm = crew_llm(smol, http, max_tokens=30, extra_body={"cache_salt": salt})
        answer = answer_llm.call([*question, {"role": "user", "content": f"Observation: {observation}"}],
                                 tools=[weather_tool], available_functions={"get_weather": get_weather})

    assert len(calls) == 1 and calls[0]["city"], calls  # the model's arguments reached the function
    assert observation == CITY_WEATHER.format(city=calls[0]["city"])  # CrewAI returned the tool's result
    assert log.replies[0]["choices"][0]["finish_reason"] == "tool_calls"
    assert WEATHER_MARK in json.dumps(log.requests[1]["messages"])  # the result reached the next model call
    assert log.replies[1]["choices"][0]["finish_reason"] != "tool_calls"
    assert answer and log.cached_tokens()[1] > 0, [r["usage"] for r in log.replies]
