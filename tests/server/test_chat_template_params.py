"""vLLM's chat-template parameters through the official openai client's ``extra_body``, on SmolLM2:
``continue_final_message`` ends the prompt inside the final message and the answer continues it (reusing the KV of
an earlier answer it quotes), ``add_generation_prompt`` false closes the turn, ``chat_template_kwargs`` the
template does not read change nothing, and what is refused is a 400 naming the field."""

from __future__ import annotations

import uuid

import openai
import pytest

from kvrelay.weights.loader import load_tokenizer
from tests.server.conftest import SMOL

pytestmark = pytest.mark.slow

QUESTION = {"role": "user", "content": "What is the capital of France?"}
PARTIAL = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SMOL)


def _create(server, messages, **extra):
    body = {"cache_salt": uuid.uuid4().hex, "kvrelay": {"debug": True}, **extra}
    return server.client().chat.completions.create(model=SMOL, messages=messages, max_tokens=8, temperature=0,
                                                   extra_body=body)


def _prompt_ids(reply) -> list[int]:
    return reply.model_extra["kvrelay"]["debug"]["prompt_ids"]


def test_continue_final_message_ends_the_prompt_inside_it_and_the_answer_continues_it(smol, tokenizer):
    messages = [QUESTION, {"role": "assistant", "content": PARTIAL}]
    reply = _create(smol, messages, continue_final_message=True, add_generation_prompt=False)
    expected = tokenizer.apply_chat_template([QUESTION], add_generation_prompt=True) + PARTIAL
    assert _prompt_ids(reply) == tokenizer.encode(expected)
    assert "Paris" in reply.choices[0].message.content  # the sentence goes on, no new turn starts
    opened = _create(smol, messages)  # the defaults: the assistant turn closed, a new one opened after it
    assert tokenizer.decode(_prompt_ids(opened), skip_special_tokens=False).endswith(
        PARTIAL + "<|im_end|>\n<|im_start|>assistant\n")


def test_add_generation_prompt_false_leaves_the_last_turn_closed(smol, tokenizer):
    reply = _create(smol, [QUESTION], add_generation_prompt=False)
    assert _prompt_ids(reply) == tokenizer.encode(tokenizer.apply_chat_template([QUESTION],
                                                                               add_generation_prompt=False))
    assert tokenizer.decode(_prompt_ids(reply), skip_special_tokens=False).endswith(
        QUESTION["content"] + "<|im_end|>\n")


def test_a_continued_answer_reuses_the_kv_of_the_answer_it_quotes(smol):
    salt = uuid.uuid4().hex
    client = smol.client()
    first = client.chat.completions.create(model=SMOL, messages=[QUESTION], max_tokens=12, temperature=0,
                                           extra_body={"cache_salt": salt, "kvrelay": {"debug": True}})
    debug = first.model_extra["kvrelay"]["debug"]
    messages = [QUESTION, {"role": "assistant", "content": first.choices[0].message.content}]
    second = client.chat.completions.create(
        model=SMOL, messages=messages, max_tokens=4, temperature=0,
        extra_body={"cache_salt": salt, "kvrelay": {"debug": True}, "continue_final_message": True,
                    "add_generation_prompt": False})
    ids = _prompt_ids(second)
    output_ids = [t for t in debug["output_ids"] if t not in load_tokenizer(SMOL).stop_ids]
    assert ids[-len(output_ids):] == output_ids  # the prompt ends with the quoted answer's own ids
    refs = second.model_extra["kvrelay"]["debug"]["refs"]
    assert any(r["span_id"] == debug["span_id"] for r in refs), refs  # ... reused from its stored KV


def test_template_kwargs_the_template_does_not_read_change_nothing(smol):
    plain = _create(smol, [QUESTION])
    with_kwargs = _create(smol, [QUESTION], chat_template_kwargs={"enable_thinking": False, "custom": [1, 2]})
    assert _prompt_ids(with_kwargs) == _prompt_ids(plain)
    assert with_kwargs.choices[0].message.content == plain.choices[0].message.content


REFUSED = [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"echo": True}, "echo"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED)
def test_what_is_refused_is_a_400_naming_the_field(smol, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        smol.client().chat.completions.create(model=SMOL, messages=[QUESTION], max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(param), err.value.body


def test_the_kwargs_the_template_reads_are_kept_and_the_rest_dropped():
    from kvrelay.server.chat_template_params import template_params
    from kvrelay.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": SMOL, "messages": [QUESTION], "chat_template_kwargs": {
        "enable_thinking": True, "custom": 1}, "add_generation_prompt": False})
    params = template_params(body, frozenset({"messages", "enable_thinking"}))
    assert params.kwargs == {"enable_thinking": True} and not params.add_generation_prompt
    assert template_params(body, frozenset({"messages"})).kwargs == {}
