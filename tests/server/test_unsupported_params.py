"""OpenAI parameters this server cannot honour are refused by name through the official client (a
``BadRequestError`` with ``code: "unsupported"``), never dropped so that the answer silently differs; their no-op
values are served. A route the server lacks is a 404 that names it and what is served."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL

MESSAGES = [{"role": "user", "content": "hi"}]

# (what, create call's name, its arguments, the param named)
REFUSED = [
    ("web search", "chat", {"web_search_options": {}}, "web_search_options"),
    ("moderation", "chat", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("verbosity low", "chat", {"verbosity": "low"}, "verbosity"),
    ("insertion", "completions", {"suffix": " and that was all."}, "suffix"),
    ("best of two", "completions", {"best_of": 2}, "best_of"),
    ("moderation", "responses", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("compaction", "responses", {"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
     "context_management"),
    ("verbosity high", "responses", {"text": {"verbosity": "high"}}, "text.verbosity"),
]

# the same fields at the values that change nothing: served
SERVED = [
    ("chat", {"verbosity": "medium", "web_search_options": None, "moderation": None}),
    ("completions", {"best_of": 1, "suffix": ""}),
    ("responses", {"text": {"verbosity": "medium"}, "context_management": []}),
]


def _create(client: openai.OpenAI, api: str, extra: dict):
    if api == "chat":
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **extra)
    if api == "completions":
        return client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)
    return client.responses.create(model=MODEL, input="hi", max_output_tokens=2, **extra)


@pytest.mark.parametrize(("what", "api", "extra", "param"), REFUSED, ids=[f"{r[1]}-{r[0]}" for r in REFUSED])
def test_a_parameter_that_would_change_the_answer_is_refused_by_name(server, what, api, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        _create(server.client(), api, extra)
    body = err.value.body
    assert body["param"] == param and body["code"] == "unsupported", body
    assert param in body["message"], body


@pytest.mark.parametrize(("api", "extra"), SERVED, ids=[s[0] for s in SERVED])
def test_the_no_op_values_of_those_parameters_are_served(server, api, extra):
    reply = _create(server.client(), api, extra)
    assert reply.usage is not None and reply.id


def test_a_route_the_server_lacks_is_a_404_naming_it_and_what_is_served(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model=MODEL, input="hi")
    message = err.value.body["message"]
    assert message.startswith("POST /v1/embeddings:"), message
    assert "POST /v1/responses" in message and "GET /v1/models" in message, message
    assert err.value.body["code"] == "not_found"
    with pytest.raises(openai.APIStatusError) as err:  # a served path, a method it lacks
        client.post("/models", cast_to=dict, body={})
    assert err.value.status_code == 405 and err.value.body["code"] == "method_not_allowed", err.value.body
    assert err.value.body["message"].startswith("POST /v1/models:"), err.value.body
