"""Every bad request gets OpenAI's error JSON with the right status, and the server keeps serving."""

from __future__ import annotations

import json
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, REPO
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

COMPLETIONS = "/v1/completions"
PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
RESPONSES = "/v1/responses"
INPUT = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
# (what, path, body, the param named): each a 400 where OpenAI's is; sent as JSON with \u escapes
NAMED = [
    ("max_tokens true", CHAT, {**OK, "max_tokens": True}, "max_tokens"),
    ("max_tokens 2.0", CHAT, {**OK, "max_tokens": 2.0}, "max_tokens"),
    ("max_completion_tokens '2'", CHAT, {**OK, "max_completion_tokens": "2"}, "max_completion_tokens"),
    ("stream 'yes'", CHAT, {**OK, "stream": "yes"}, "stream"),
    ("stream 1", CHAT, {**OK, "stream": 1}, "stream"),
    ("seed '42'", CHAT, {**OK, "seed": "42"}, "seed"),
    ("logprobs 'yes'", CHAT, {**OK, "logprobs": "yes"}, "logprobs"),
    ("top_logprobs true", CHAT, {**OK, "logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ("n '1'", CHAT, {**OK, "n": "1"}, "n"),
    ("temperature true", CHAT, {**OK, "temperature": True}, "temperature"),
    ("temperature '0.5'", CHAT, {**OK, "temperature": "0.5"}, "temperature"),
    ("top_p '1'", CHAT, {**OK, "top_p": "1"}, "top_p"),
    ("include_usage 1", CHAT, {**OK, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("kvrelay.debug 'yes'", CHAT, {**OK, "kvrelay": {"debug": "yes"}}, "kvrelay.debug"),
    ("completion logprobs true", COMPLETIONS, {**PROMPT, "logprobs": True}, "logprobs"),
    ("echo 'no'", COMPLETIONS, {**PROMPT, "echo": "no"}, "echo"),
    ("max_output_tokens true", RESPONSES, {**INPUT, "max_output_tokens": True}, "max_output_tokens"),
    ("responses stream 'yes'", RESPONSES, {**INPUT, "stream": "yes"}, "stream"),
    ("responses temperature '0.5'", RESPONSES, {**INPUT, "temperature": "0.5"}, "temperature"),
    ("responses parallel_tool_calls 1", RESPONSES, {**INPUT, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("token ids as booleans", COMPLETIONS, {**PROMPT, "prompt": [True, False]}, "prompt.0"),
    ("token ids as floats", COMPLETIONS, {**PROMPT, "prompt": [1.0, 2.0]}, "prompt.0"),
    # a lone surrogate: no Unicode text, wherever it is
    ("surrogate prompt", COMPLETIONS, {**PROMPT, "prompt": "\udfff"}, "prompt"),
    ("surrogate in a prompt list", COMPLETIONS, {**PROMPT, "prompt": ["a\ud800b"]}, "prompt"),
    ("surrogate content", CHAT, {**OK, "messages": [{"role": "user", "content": "x\udfff"}]},
     "messages.0.content"),
    ("surrogate content part", CHAT, {**OK, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud83d"}]}]}, "messages.0.content.0.text"),
    ("surrogate name", CHAT, {**OK, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
     "messages.0.name"),
    ("surrogate role", CHAT, {**OK, "messages": [{"role": "\udfff", "content": "hi"}]}, "messages.0.role"),
    ("surrogate stop", CHAT, {**OK, "stop": "\udfff"}, "stop"),
    ("surrogate in a stop list", CHAT, {**OK, "stop": ["ok", "\udfff"]}, "stop"),
    ("surrogate cache_salt", CHAT, {**OK, "cache_salt": "\ud800"}, "cache_salt"),
    ("surrogate model", CHAT, {**OK, "model": "\ud800"}, "model"),
    ("surrogate method", CHAT, {**OK, "kvrelay": {"method": "\ud800"}}, "kvrelay.method"),
    ("surrogate completion stop", COMPLETIONS, {**PROMPT, "stop": "\udc00"}, "stop"),
]


@pytest.mark.parametrize("what,path,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_error(server, what, path, body, status, code):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err
    assert "Traceback" not in r.text
    assert server.alive()


@pytest.mark.parametrize("content, content_type", [
    ('{"model": "m", "messages": []}', "application/x-www-form-urlencoded"),  # curl -d without -H
    ("[1, 2]", "application/json"), ('"x"', "application/json")])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES])
def test_a_body_that_is_no_json_object_is_told_what_to_send(server, path, content, content_type):
    r = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": content_type}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("the request body must be a JSON object, sent with Content-Type: "
                                            "application/json")


def _post(server, path: str, body: dict | str) -> httpx.Response:
    """``body`` as JSON text (json.dumps escapes a lone surrogate as \\udfff, as a client's JSON encoder does)."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=30)


@pytest.mark.parametrize("what,path,body,param", NAMED, ids=[b[0] for b in NAMED])
def test_wrong_types_and_lone_surrogates_are_400s_naming_the_field(server, what, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert err["message"].startswith(param), err


@pytest.mark.parametrize("field,value", [("temperature", 1e-37), ("temperature", 1e-39), ("temperature", 1e-45),
                                         ("temperature", 5e-324), ("top_p", 1e-46), ("top_p", 5e-324)])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_tiny_sampling_values_are_served(server, path, field, value):
    """Every value the API accepts samples: no 500 from a softmax that overflows float32."""
    body = {**(OK if path == CHAT else PROMPT), "max_tokens": 6, "seed": 3, field: value}
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_an_error_names_no_server_path(server):
    """A method without a profile for this model: the error says so, without the server's directories."""
    r = _post(server, CHAT, {**OK, "kvrelay": {"method": "relay"}})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "profile" in message and ".json" in message, message  # still says what is missing
    for root in {str(REPO), str(Path.home()), "/root/", "/home/", "/tmp/", "/work/"}:
        assert root not in message, message
    assert re.search(r"(?<![\w:/])/[\w.-]+/", message) is None, message


def test_a_malformed_request_line_gets_error_json(server):
    """uvicorn's own 400 (a request h11 cannot parse) is OpenAI's error JSON, and the server keeps serving."""
    for raw in (b"NOT HTTP AT ALL\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(raw)
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].startswith(b"HTTP/1.1 400"), response
        assert b"content-type: application/json" in head.lower(), head
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_http_request", err
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


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


HOSTILE_TEMPERATURE = 1e-37  # the body; on SmolLM2 its float32 softmax overflowed after the first token


def _stream_chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def _plant_nan_row(srv: LiveServer) -> None:
    """The hostile request's logits turn NaN in every decode step (its first token, from the prefill, is fine)."""
    engine = srv.worker.engine
    decode = engine._decode

    def nan_for_the_hostile_row(token_ids, seqs):
        logits = decode(token_ids, seqs).clone()  # [B, vocab]
        for row, seq in enumerate(seqs):
            if seq.options.sampling.temperature == HOSTILE_TEMPERATURE:
                logits[row] = float("nan")
        return logits

    engine._decode = nan_for_the_hostile_row


def _plant_text_bug(srv: LiveServer) -> None:
    """Turning the hostile request's second token into text raises (a bug after the step, in the worker)."""
    worker = srv.worker
    emit_text = worker._emit_text

    def emit_text_with_a_bug(job):
        if job.temperature == HOSTILE_TEMPERATURE and len(job.seq.output_ids) >= 2:
            raise RuntimeError("planted: a bug turning tokens into text")
        emit_text(job)

    worker._emit_text = emit_text_with_a_bug


@pytest.mark.parametrize("plant,message", [(_plant_nan_row, "not affected"), (_plant_text_bug, "internal error")],
                         ids=["nan_logits", "text_bug"])
def test_a_request_that_fails_mid_decode_fails_alone_beside_another_stream(plant, message):
    """Two streams in one decode batch (the worker paused until both wait); the hostile one fails after its first
    token: its row's logits turn NaN (planted: random:tiny's logits are too small to overflow, SmolLM2's were not),
    or the worker meets a bug with its text. It gets an error chunk; the other stream runs to its last token, the
    same text as when it runs alone."""
    srv = LiveServer(max_running=4)
    url = f"{srv.url}{CHAT}"
    plant(srv)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    good = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    hostile = {**good, "temperature": HOSTILE_TEMPERATURE, "messages": [{"role": "user", "content": "Hi there"}]}
    try:
        srv.worker.pause()
        with ThreadPoolExecutor(2) as pool:
            good_chunks = pool.submit(_stream_chunks, url, good)
            srv.wait_until(lambda: srv.num_waiting() == 1, "the good request waiting")
            hostile_chunks = pool.submit(_stream_chunks, url, hostile)
            srv.wait_until(lambda: srv.num_waiting() == 2, "both requests waiting")
            srv.worker.resume()
            good_chunks, hostile_chunks = good_chunks.result(), hostile_chunks.result()
        # stream_options only with a stream, as OpenAI (a 400 otherwise)
        alone = httpx.post(url, json={**good, "stream": False, "stream_options": None}, timeout=60).json()
    finally:
        srv.stop()
    assert not any("error" in c for c in good_chunks), good_chunks[-1]
    assert good_chunks[-1]["usage"]["completion_tokens"] == 24
    assert [c["choices"][0]["finish_reason"] for c in good_chunks if c.get("choices")][-1] == "length"
    assert _text_of(good_chunks) == alone["choices"][0]["message"]["content"]
    assert _text_of(hostile_chunks), hostile_chunks  # its first token came out before its decode step failed
    err = hostile_chunks[-1]["error"]
    assert err["code"] == "internal_error" and message in err["message"] and "planted" not in err["message"], err
