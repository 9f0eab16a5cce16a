"""The routes pass the model's context to the tokenizer: a prompt over it is a 400 ``context_length_exceeded``
refused from its encoding's length, before its ids become Python objects (``tests/model/test_tokenizer_limit.py``;
for a body of megabytes, seconds holding the GIL while the engine thread waits)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tests.server.inproc import MODEL, make_app


class _Guarded:
    """An encoding over the limit: its length reads, its ids and offsets count as a read (and raise)."""

    def __init__(self, inner, reads: list[str]) -> None:
        self.inner, self.reads = inner, reads

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def ids(self):
        self.reads.append("ids")
        raise AssertionError("read the ids of a prompt over the context")

    @property
    def offsets(self):
        self.reads.append("offsets")
        raise AssertionError("read the offsets of a prompt over the context")


class _GuardedBackend:
    def __init__(self, inner, limit: int) -> None:
        self.inner, self.limit, self.reads = inner, limit, []

    def encode_batch(self, texts, add_special_tokens=False):
        encodings = self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [_Guarded(e, self.reads) if len(e) > self.limit else e for e in encodings]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def served():
    app = make_app()
    with TestClient(app) as client:  # its lifespan starts the worker (once per app)
        yield app, client


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_prompt_over_the_context_is_refused_before_its_ids_are_read(served, monkeypatch, route):
    app, client = served
    ctx = app.state.context
    limit = ctx.worker.context_tokens
    backend = _GuardedBackend(ctx.tokenizer.backend, limit)
    monkeypatch.setattr(ctx.tokenizer, "backend", backend)
    text = "word " * (limit + 100)
    body = ({"messages": [{"role": "user", "content": text}]} if "chat" in route else {"prompt": text})
    over = client.post(route, json={"model": MODEL, "max_tokens": 2, **body})
    within = client.post(route, json={"model": MODEL, "max_tokens": 2, **(
        {"messages": [{"role": "user", "content": "a short one"}]} if "chat" in route else {"prompt": "a short"})})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "context_length_exceeded"
    assert f"over the model's context of {limit}" in over.json()["error"]["message"]
    assert backend.reads == []  # refused from the encoding's length alone
    assert within.status_code == 200, within.text  # the guard lets a prompt within the context through


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 10**6}, "prompt"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, "input"),
])
def test_a_prompt_and_its_max_tokens_over_the_context_name_the_route_s_prompt_field(served, route, body, param):
    # the limit checked at admission named "messages" on every route: a field completions and Responses have not
    r = served[1].post(route, json={"model": MODEL, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, error
