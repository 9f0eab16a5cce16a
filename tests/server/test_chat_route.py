"""Chat requests OpenAI refuses are 400s naming the field (they were served as if the field were absent), and an
assistant's refusal part, which OpenAI takes back, is served (it was a 400)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tests.server.inproc import MODEL, make_app

USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("fields", [{"top_logprobs": 2}, {"top_logprobs": 0, "logprobs": False}])
def test_top_logprobs_without_logprobs_is_a_400(client, fields):
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 1, **fields})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs", reply.text


def test_top_logprobs_with_logprobs_is_served(client):
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 1,
                                                      "logprobs": True, "top_logprobs": 2})
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize(("route", "prompt"), [("chat/completions", {"messages": [USER]}), ("completions",
                                                                                           {"prompt": "Hi"})])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_a_stream_is_a_400(client, route, prompt, stream):
    body = {"model": MODEL, "max_tokens": 1, "stream_options": {"include_usage": True}, **prompt}
    if stream is not None:
        body["stream"] = stream
    reply = client.post(f"/v1/{route}", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options", reply.text


def test_stream_options_with_a_stream_and_null_without_are_served(client):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json={**body, "stream_options": None}).status_code == 200
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"usage"' in streamed.text


@pytest.mark.parametrize("assistant", [
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Well, "}, {"type": "refusal", "refusal": "no."}]},
    {"role": "assistant", "content": None, "refusal": "I can't help with that."},
])
def test_an_assistants_refusal_is_served_as_its_words(client, assistant):
    messages = [USER, assistant, {"role": "user", "content": "Why not?"}]
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                      "kvrelay": {"debug": True}})
    assert reply.status_code == 200, reply.text
    prompt = client.app.state.context.tokenizer.decode(reply.json()["kvrelay"]["debug"]["prompt_ids"])
    words = "".join(p.get("text") or p.get("refusal") for p in assistant["content"] or []) or assistant["refusal"]
    assert words in prompt


def test_a_refusal_part_in_a_user_message_is_a_400(client):
    messages = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.0.content.0.type", reply.text


@pytest.mark.parametrize(("fields", "param"), [({"modalities": ["text", "audio"]}, "modalities"),
                                               ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                                               ({"modalities": ["audio"], "audio": {"voice": "alloy"}}, "audio")])
def test_audio_output_is_a_400_not_text_served_as_if_asked(client, fields, param):
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 1, **fields})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize("fields", [{"modalities": ["text"]}, {"modalities": None, "audio": None}])
def test_text_modalities_are_served(client, fields):
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 1, **fields})
    assert reply.status_code == 200, reply.text
