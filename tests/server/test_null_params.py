"""OpenAI types many optional request fields "... or null" (and the official client, like agent frameworks, may send
null for a parameter left unset): null is served as the field not given, with the same answer, through the official
client against a real server (random:tiny). A non-null value is still checked strictly."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.server.conftest import MODEL

# each API's fields OpenAI documents as nullable (or vLLM's, on chat and completions)
CHAT = ["temperature", "top_p", "n", "stream", "logprobs", "max_tokens", "max_completion_tokens", "seed", "stop",
        "presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs", "user", "tools", "tool_choice",
        "response_format", "parallel_tool_calls", "stream_options", "metadata", "store", "service_tier",
        "modalities", "audio", "prediction", "reasoning_effort", "web_search_options", "verbosity",
        "prompt_cache_key", "safety_identifier", "echo"]
COMPLETIONS = ["temperature", "top_p", "n", "stream", "logprobs", "max_tokens", "seed", "stop", "presence_penalty",
               "frequency_penalty", "logit_bias", "user", "stream_options", "echo", "suffix", "best_of"]
RESPONSES = ["stream", "temperature", "top_p", "max_output_tokens", "instructions", "previous_response_id", "store",
             "tools", "tool_choice", "text", "parallel_tool_calls", "metadata", "truncation", "include",
             "top_logprobs", "background", "conversation", "prompt", "max_tool_calls", "user", "service_tier",
             "reasoning", "prompt_cache_key", "safety_identifier", "stream_options"]

# a request that decodes a few sampled tokens; a field under test is left out of it (the seed's stand-in keeps the
# answer repeatable, max_completion_tokens' keeps it short)
BASE = {"chat": {"seed": 7, "max_completion_tokens": 4, "temperature": 0.8},
        "completions": {"seed": 7, "max_tokens": 4, "temperature": 0.8},
        "responses": {"extra_body": {"seed": 7}, "max_output_tokens": 4, "temperature": 0.8}}
STAND_INS = {"seed": {"temperature": 0.0}, "max_completion_tokens": {"max_tokens": 4}}
SAMPLING = {"temperature", "top_p", "n", "best_of", "seed"}  # fields whose null a greedy answer would not show


def _answer(server, api: str, field: str, null: bool) -> tuple:
    # greedy where the field under test is not a sampling one: the answer then shows a wrong default as surely,
    # and no float-level difference between two prefills (their pieces are sized by measured time) can move a draw
    greedy = {} if field in SAMPLING else {"temperature": 0.0}
    kw = {**BASE[api], **greedy, **STAND_INS.get(field, {})}
    kw.pop(field, None)
    extra = {**kw.pop("extra_body", {}), "cache_salt": uuid.uuid4().hex}
    if null:
        extra[field] = None  # sent as JSON null, whatever the client does with a None argument
    client = server.client()
    if api == "chat":
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           extra_body=extra, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, len(r.choices)
    if api == "completions":
        r = client.completions.create(model=MODEL, prompt="Say hi.", extra_body=extra, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, len(r.choices)
    r = client.responses.create(model=MODEL, input="Say hi.", extra_body=extra, **kw)
    return r.output_text, r.status, len(r.output)


@pytest.mark.parametrize(("api", "field"), [("chat", f) for f in CHAT] + [("completions", f) for f in COMPLETIONS]
                         + [("responses", f) for f in RESPONSES])
def test_null_is_the_field_not_given(server, api, field):
    assert _answer(server, api, field, null=True) == _answer(server, api, field, null=False)


@pytest.mark.parametrize(("api", "kw"), [("chat", {"temperature": "0.5"}), ("chat", {"stream": "true"}),
                                          ("chat", {"n": 1.0}), ("chat", {"logprobs": 1}),
                                          ("responses", {"stream": 1})])
def test_a_value_that_is_not_null_is_still_strict(server, api, kw):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        if api == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=kw)
        else:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=kw)
    assert err.value.body["param"] == next(iter(kw))
