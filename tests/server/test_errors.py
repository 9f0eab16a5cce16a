"""Every bad request gets OpenAI's error JSON with the right status, and the server keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.live import LiveServer

CHAT = "/v1/chat/completions"
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD = [  # (what, path, body or raw text, status, code or None)
    ("unknown model", CHAT, {**OK, "model": "gpt-9"}, 404, "model_not_found"),
    ("malformed JSON", CHAT, '{"model": "x", "messages": [', 400, "invalid_value"),
    ("body not an object", CHAT, "[1, 2]", 400, "invalid_value"),
    ("bad role", CHAT, {**OK, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),
    ("empty messages", CHAT, {**OK, "messages": []}, 400, "empty_messages"),
    ("no content", CHAT, {**OK, "messages": [{"role": "user"}]}, 400, "invalid_value"),
    ("negative max_tokens", CHAT, {**OK, "max_tokens": -3}, 400, "invalid_value"),
    ("zero max_completion_tokens", CHAT, {**OK, "max_completion_tokens": 0}, 400, "invalid_value"),
    ("bad temperature type", CHAT, {**OK, "temperature": "hot"}, 400, "invalid_value"),
    ("temperature out of range", CHAT, {**OK, "temperature": 7}, 400, "invalid_value"),
    ("messages not a list", CHAT, {**OK, "messages": "hi"}, 400, "invalid_value"),
    ("missing model", CHAT, {"messages": OK["messages"]}, 400, "invalid_value"),
    ("n > 1", CHAT, {**OK, "n": 2}, 400, "unsupported"),
    ("seed past a generator's range", CHAT, {**OK, "seed": 1 << 64}, 400, "invalid_value"),
    ("negative seed past the range", CHAT, {**OK, "seed": -(1 << 63) - 1}, 400, "invalid_value"),
    ("seed of 5,000 digits", CHAT, json.dumps(OK)[:-1] + ', "seed": ' + "9" * 5000 + "}", 400, "invalid_value"),
    ("five stops", CHAT, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("unknown method", CHAT, {**OK, "kvrelay": {"method": "magic"}}, 400, "invalid_value"),
    ("branch method", CHAT, {**OK, "kvrelay": {"method": "rksc"}}, 400, "invalid_value"),
    ("prompt over the context", CHAT, {**OK, "messages": [{"role": "user", "content": "word " * 9000}]}, 400,
     "context_length_exceeded"),
    ("max_tokens over the context", CHAT, {**OK, "max_tokens": 100000}, 400, "context_length_exceeded"),
    ("several prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "unsupported"),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "invalid_value"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "invalid_value"),
    ("unknown route", "/v1/nothing", {}, 404, "not_found"),
]


@pytest.mark.parametrize("what,path,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_error(server, what, path, body, status, code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{server.url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err
    assert "Traceback" not in r.text
    assert server.alive()


def test_seeds_at_both_ends_of_the_range_are_served_and_one_past_names_the_seed(server):
    for seed in ((1 << 64) - 1, -(1 << 63)):
        r = httpx.post(f"{server.url}{CHAT}", json={**OK, "seed": seed, "temperature": 1.0}, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}{CHAT}", json={**OK, "seed": 1 << 64}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_body_over_the_limit_is_413(server):
    r = httpx.post(f"{server.url}{CHAT}", content=b"x" * (9 << 20), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_openai_client_raises_typed_errors_and_server_keeps_serving(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2).usage.completion_tokens == 2


def test_api_keys_401_and_namespaces_per_key(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client("wrong").models.list()
    r = httpx.post(f"{keyed_server.url}{CHAT}", json=OK, timeout=30)  # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    messages = [{"role": "system", "content": "A shared system prompt long enough to cover a few token blocks."},
                {"role": "user", "content": "What is six times seven?"}]

    def cached(key: str) -> int:
        r = keyed_server.client(key).chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("key-a") == 0
    assert cached("key-b") == 0  # the same prompt under another key: nothing of key-a's is visible
    assert cached("key-a") > 0


def test_full_queue_is_429_with_retry_after():
    """--max-running 1 --max-queue 1: with the worker paused, one request waits for sure and the next is refused;
    once the worker runs again the waiting one is served."""
    srv = LiveServer(max_queue=1, max_running=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 5}
    url = f"{srv.url}{CHAT}"
    try:
        srv.worker.pause()
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=120)
            srv.wait_until(lambda: srv.num_waiting() == 1, "one request waiting")
            refused = httpx.post(url, json=body, timeout=30)
            assert refused.status_code == 429 and refused.headers.get("retry-after") == "1", refused.text
            assert refused.json()["error"]["code"] == "queue_full"
            srv.worker.resume()
            assert first.result().status_code == 200
        assert httpx.post(url, json=body, timeout=60).status_code == 200  # the queue drained: served again
    finally:
        srv.stop()
