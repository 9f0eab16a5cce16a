"""Hypothesis over near-valid request bodies: every field at its boundaries (denormals, 0, +-inf and NaN as
Python's JSON writes them, huge ints, lone surrogates, huge lists, wrong types) sent to the app in process.
Never a 5xx; every 4xx is OpenAI's error JSON. Bounded (examples fixed, derandomized) to run in well under a
minute in CI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.server.inproc import MODEL, make_app

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                derandomize=True)  # the same examples on every run: a failure reproduces

NUMBERS = [0, -0.0, 1, 2, -1, 0.5, 5e-324, 1e-320, 1e-46, 1e-39, 1e-38, 1e-37, 2.0000001, 1.7976931348623157e308,
           float("inf"), float("-inf"), float("nan"), 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
           10**30, 10**300]
STRINGS = ["", " ", "hi", "\udfff", "a\ud800b", "\ud83d\ude00", "\x00", "<|im_start|>system", "x" * 5000,
           "{{ raise_exception('x') }}", "/etc/passwd", "full", "epic", "relay", "prefix[x=1]", "magic[", "42", "yes",
           "true", MODEL]
WRONG = [None, True, False, [], {}, [1, 2], {"a": 1}, ["a"] * 300, [1] * 3000, [[[]]]]
VALUE = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(STRINGS), st.sampled_from(WRONG),
                  st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
                  st.integers(-(2**70), 2**70), st.text(max_size=20))

ROLES = ["system", "developer", "user", "assistant", "tool", "wizard", "", "\udfff"]
CONTENT = st.one_of(st.sampled_from(STRINGS), st.sampled_from(WRONG), st.text(max_size=40),
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "\ud800"]),
                                                    "text": st.one_of(st.sampled_from(STRINGS), VALUE)}),
                             max_size=3))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": CONTENT},
                                optional={"name": VALUE, "tool_call_id": VALUE, "tool_calls": VALUE})
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), st.sampled_from(WRONG), st.sampled_from(STRINGS))

SAMPLING_FIELDS = ["model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options",
                   "cache_salt", "kvrelay", "logprobs", "user", "presence_penalty", "frequency_penalty", "logit_bias"]
CHAT_FIELDS = [*SAMPLING_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
               "response_format", "parallel_tool_calls"]
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "prompt", "echo"]
KVRELAY = st.one_of(VALUE, st.fixed_dictionaries({}, optional={
    "method": st.one_of(st.sampled_from(STRINGS), VALUE), "debug": VALUE, "cache_output": VALUE,
    "first_token_logprobs": VALUE}))
STREAM_OPTIONS = st.one_of(VALUE, st.fixed_dictionaries({}, optional={"include_usage": VALUE}))
PROMPT = st.one_of(st.sampled_from(STRINGS), st.sampled_from(WRONG), st.text(max_size=40),
                   st.lists(st.integers(-5, 2**40), min_size=0, max_size=8), st.lists(st.sampled_from(STRINGS),
                                                                                      max_size=3))
# token-id keys in and out of the vocabulary, other digits ("\u0663" is a digit to str.isdigit), any value
LOGIT_BIAS = st.one_of(VALUE, st.dictionaries(st.one_of(st.integers(-3, 2**20).map(str), st.text(max_size=5)), VALUE,
                                              max_size=3))
SPECIAL = {"kvrelay": KVRELAY, "stream_options": STREAM_OPTIONS, "messages": MESSAGES, "prompt": PROMPT,
           "logit_bias": LOGIT_BIAS,
           "stop": st.one_of(VALUE, st.lists(st.sampled_from(STRINGS), max_size=6))}


def _mutated(base: dict, fields: list[str]) -> st.SearchStrategy[dict]:
    """``base`` with 1-4 of ``fields`` set to a boundary value (or dropped)."""
    def mutate(draw) -> dict:
        body = dict(base)
        for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=4, unique=True)):
            if draw(st.integers(0, 9)) == 0:
                body.pop(name, None)
            else:
                body[name] = draw(SPECIAL.get(name, VALUE))
        return body
    return st.composite(lambda draw: mutate(draw))()


CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 2}
COMPLETION_BASE = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2}
CHAT_BODY = _mutated(CHAT_BASE, CHAT_FIELDS)
COMPLETION_BODY = _mutated(COMPLETION_BASE, COMPLETION_FIELDS)

# one field at a time, the rest valid, so the value under test reaches sampling and tokenizing
BOUNDARY_NUMBER = st.one_of(st.sampled_from(NUMBERS), st.floats(0, 2, allow_subnormal=True),
                            st.floats(0, 1e-30, allow_subnormal=True))
NUMBER_FIELDS = ["temperature", "top_p", "max_tokens", "seed"]
STRING_SLOTS = {  # where a string goes in a body: (path, base, setter)
    "chat content": (CHAT, CHAT_BASE, lambda b, v: b.update(messages=[{"role": "user", "content": v}])),
    "chat part": (CHAT, CHAT_BASE, lambda b, v: b.update(messages=[{"role": "user", "content": [
        {"type": "text", "text": v}]}])),
    "chat system": (CHAT, CHAT_BASE, lambda b, v: b.update(messages=[{"role": "system", "content": v},
                                                                      *CHAT_BASE["messages"]])),
    "chat name": (CHAT, CHAT_BASE, lambda b, v: b.update(messages=[{**CHAT_BASE["messages"][0], "name": v}])),
    "prompt": (COMPLETIONS, COMPLETION_BASE, lambda b, v: b.update(prompt=v)),
    "prompt list": (COMPLETIONS, COMPLETION_BASE, lambda b, v: b.update(prompt=[v])),
    "stop": (CHAT, CHAT_BASE, lambda b, v: b.update(stop=v)),
    "stop list": (COMPLETIONS, COMPLETION_BASE, lambda b, v: b.update(stop=["\n", v])),
    "cache_salt": (CHAT, CHAT_BASE, lambda b, v: b.update(cache_salt=v)),
    "method": (COMPLETIONS, COMPLETION_BASE, lambda b, v: b.update(kvrelay={"method": v})),
    "model": (CHAT, CHAT_BASE, lambda b, v: b.update(model=v)),
}
BOUNDARY_STRING = st.one_of(st.sampled_from(STRINGS), st.text(max_size=30),
                            st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
                            .map(lambda t: "ok " + t))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(default_max_tokens=4), raise_server_exceptions=False) as c:
        yield c


def assert_no_5xx(r, sent: str | bytes) -> bool:
    """``r`` is no 5xx, and an error is OpenAI's error body; whether it was an error."""
    assert r.status_code < 500, (r.status_code, r.text[:500], sent[:500])
    if r.status_code < 400:
        return False
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert "Traceback" not in r.text
    return True


def _check(client: TestClient, path: str, content: str | bytes) -> None:
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    if assert_no_5xx(r, content):
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") or '"error"' in r.text, r.text[-500:]
    else:
        assert "choices" in r.json()


@FUZZ
@given(path=st.sampled_from([CHAT, COMPLETIONS]), values=st.dictionaries(st.sampled_from(NUMBER_FIELDS),
                                                                          BOUNDARY_NUMBER, min_size=1))
def test_fuzz_sampling_numbers(client, path, values):
    _check(client, path, json.dumps({**(CHAT_BASE if path == CHAT else COMPLETION_BASE), "max_tokens": 3, **values}))


@FUZZ
@given(slot=st.sampled_from(sorted(STRING_SLOTS)), value=BOUNDARY_STRING)
def test_fuzz_strings_in_every_slot(client, slot, value):
    path, base, put = STRING_SLOTS[slot]
    body = json.loads(json.dumps(base))
    put(body, value)
    _check(client, path, json.dumps(body))


@FUZZ
@given(body=CHAT_BODY)
def test_fuzz_chat_bodies(client, body):
    _check(client, CHAT, json.dumps(body))


@FUZZ
@given(body=COMPLETION_BODY)
def test_fuzz_completion_bodies(client, body):
    _check(client, COMPLETIONS, json.dumps(body))


RAW = ['{"model": "random:tiny", "prompt": "hi", "max_tokens": 2', '{"model": NaN}', "[" * 100_000 + "]" * 100_000,
       '{"model": "random:tiny", "prompt": "hi", "seed": ' + "9" * 5000 + "}", '{"prompt": "\\udfff"}',
       b'{"model": "random:tiny", "prompt": "\xed\xbf\xbf"}', b'{"model": "random:tiny", "prompt": "\xff"}', "",
       "null", '"text"', "1e999"]  # the bytes: a surrogate UTF-8-encoded (invalid UTF-8), a byte no UTF-8 has


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("raw", RAW, ids=range(len(RAW)))
def test_bodies_json_cannot_read_are_400s(client, path, raw):
    _check(client, path, raw)
