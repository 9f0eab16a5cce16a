"""The official ``openai`` client's helpers beyond ``create``, as users' own code calls them: the parse helpers
(a Pydantic model as the format, strict ``pydantic_function_tool``s), the streaming context managers with their
typed events and final objects, and the client's own retries (a full queue's 429 retried, a 400 not)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL, SMOL
from tests.server.live import LiveServer

ASK = "Name one city and the country it is in."


class City(BaseModel):
    city: str
    country: str


class GetWeather(BaseModel):
    city: str


def _salt(name: str) -> dict:
    return {"cache_salt": f"sdk-helpers-{name}"}


def test_chat_parse_returns_the_pydantic_model(smol):
    reply = smol.client().chat.completions.parse(
        model=SMOL, messages=[{"role": "user", "content": ASK}], response_format=City, max_tokens=60,
        temperature=0, extra_body=_salt("chat-parse"))
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city, reply


def test_responses_parse_returns_the_pydantic_model(smol):
    reply = smol.client().responses.parse(model=SMOL, input=ASK, text_format=City, max_output_tokens=60,
                                          temperature=0, extra_body=_salt("responses-parse"))
    assert isinstance(reply.output_parsed, City) and reply.output_parsed.city, reply


def test_a_strict_pydantic_tool_comes_back_parsed(smol):
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["strict"] is True
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = smol.client().chat.completions.parse(
        model=SMOL, messages=messages, tools=[tool], tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0, extra_body=_salt("tool"))
    assert reply.choices[0].finish_reason == "tool_calls", reply
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather), call


def test_chat_stream_helper_gives_content_events_and_the_parsed_final_completion(smol):
    with smol.client().chat.completions.stream(
            model=SMOL, messages=[{"role": "user", "content": ASK}], response_format=City, max_tokens=60,
            temperature=0, stream_options={"include_usage": True}, extra_body=_salt("chat-stream")) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    kinds = {e.type for e in events}
    assert {"chunk", "content.delta", "content.done"} <= kinds, kinds
    done = next(e for e in events if e.type == "content.done")
    deltas = "".join(e.delta for e in events if e.type == "content.delta")
    assert done.content == deltas == final.choices[0].message.content
    assert isinstance(done.parsed, City) and final.choices[0].message.parsed == done.parsed
    assert final.usage is not None and final.usage.completion_tokens > 0


def test_responses_stream_helper_gives_text_events_and_the_parsed_final_response(smol):
    with smol.client().responses.stream(model=SMOL, input=ASK, text_format=City, max_output_tokens=60,
                                        temperature=0, extra_body=_salt("responses-stream")) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds, kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and isinstance(final.output_parsed, City), final


@pytest.fixture
def queue_of_one():
    srv = LiveServer(max_queue=1, max_running=1)
    try:
        yield srv
    finally:
        srv.stop()


def test_the_client_retries_a_full_queue_and_not_a_bad_request(queue_of_one):
    """The worker paused with one request waiting: every attempt of a client with ``max_retries=2`` finds the queue
    full, so the server answers exactly 3 (one call, two retries, each after its ``Retry-After``); a 400 is
    answered once."""
    srv = queue_of_one
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    retrying = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=2, timeout=60)
    srv.worker.pause()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(srv.client().chat.completions.create, **body)
        srv.wait_until(lambda: srv.num_waiting() == 1, "one request waiting")
        num_429 = _num_errors(srv, 429)
        with pytest.raises(openai.RateLimitError) as err:
            retrying.chat.completions.create(**body)
        assert err.value.body["code"] == "queue_full"
        assert _num_errors(srv, 429) - num_429 == 3
        srv.worker.resume()
        assert waiting.result().choices[0].finish_reason in ("length", "stop")
    num_400 = _num_errors(srv, 400)
    with pytest.raises(openai.BadRequestError):
        retrying.chat.completions.create(**{**body, "temperature": 7})
    assert _num_errors(srv, 400) - num_400 == 1


def _num_errors(srv: LiveServer, status: int) -> float:
    """Chat requests the server answered with ``status`` so far (its error counter; absent before the first)."""
    try:
        return srv.metric(f'kvrelay_errors_total{{endpoint="chat",status="{status}"}}')
    except KeyError:
        return 0.0
