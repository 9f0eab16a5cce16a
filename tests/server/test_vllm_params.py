"""vLLM's extra parameters through the official ``openai`` client's ``extra_body`` on SmolLM2 (greedy, ``full``):
the served ones change the answer as vLLM defines them, checked token for token against references computed here
from the model's own ``full`` logits; the refused ones are 400s naming the parameter; their defaults are served."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.server.vllm_params import REFUSED, SERVED
from tests.server.conftest import SMOL

MESSAGES = [{"role": "user", "content": "Answer with one word: what color is the sky on a clear day?"}]
LONG_MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]
DEBUG = {"debug": True, "cache_output": False, "method": "full"}


@pytest.fixture(scope="module")
def lm():
    from kvrelay.weights.loader import load_model

    return load_model(SMOL, progress=False)


def _chat(smol, messages=MESSAGES, max_tokens: int = 24, temperature: float = 0.0, **extra):
    return smol.client().chat.completions.create(model=SMOL, messages=messages, max_tokens=max_tokens,
                                                  temperature=temperature, extra_body={"kvrelay": DEBUG, **extra})


def _ids(reply) -> tuple[list[int], list[int]]:
    debug = reply.model_extra["kvrelay"]["debug"]
    return debug["prompt_ids"], debug["output_ids"]


def _logits(lm, ids: list[int]) -> torch.Tensor:
    out = Engine(lm).generate(ids, "full", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    return out.first_logits.float().clone()


def _reference(lm, prompt_ids: list[int], max_tokens: int, repetition_penalty: float = 1.0, min_tokens: int = 0,
               stop_ids: frozenset[int] | None = None) -> tuple[list[int], int | None]:
    """Greedy tokens by hand: the stop ids at -inf before ``min_tokens``, then vLLM's repetition rule (seen in the
    prompt or the output: a positive logit times 1/penalty, a negative one times penalty). Returns the output and
    the stop token sampled (None: max_tokens)."""
    stop_ids = lm.tokenizer.stop_ids if stop_ids is None else stop_ids
    out: list[int] = []
    while len(out) < max_tokens:
        logits = _logits(lm, prompt_ids + out)
        if len(out) < min_tokens:
            logits[sorted(lm.tokenizer.stop_ids | stop_ids)] = float("-inf")
        seen = torch.zeros(logits.numel(), dtype=torch.bool)
        seen[prompt_ids + out] = True
        scale = torch.where(logits > 0, 1.0 / torch.tensor(repetition_penalty), torch.tensor(repetition_penalty))
        token_id = int(torch.where(seen, logits * scale, logits).argmax())
        if token_id in stop_ids:
            return out, token_id
        out.append(token_id)
    return out, None


def test_ignore_eos_generates_exactly_max_tokens(smol):
    plain = _chat(smol, max_tokens=40)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 20  # it ends by itself
    reply = _chat(smol, max_tokens=40, ignore_eos=True)
    assert reply.usage.completion_tokens == len(_ids(reply)[1]) == 40
    assert reply.choices[0].finish_reason == "length"
    assert _ids(reply)[1][:len(_ids(plain)[1])] == _ids(plain)[1]  # the same answer, carried past its end


def test_skip_special_tokens_false_keeps_the_end_of_turn_text(smol, lm):
    shown = _chat(smol, max_tokens=30, ignore_eos=True, skip_special_tokens=False)
    hidden = _chat(smol, max_tokens=30, ignore_eos=True)
    assert _ids(shown)[1] == _ids(hidden)[1] and 2 in _ids(shown)[1]  # <|im_end|> was generated
    assert "<|im_end|>" in shown.choices[0].message.content
    assert "<|im_end|>" not in hidden.choices[0].message.content
    assert shown.choices[0].message.content == lm.tokenizer.decode(_ids(shown)[1], skip_special_tokens=False)


def test_min_tokens_holds_the_end_back_and_matches_the_reference(smol, lm):
    plain = _chat(smol)
    prompt_ids, plain_ids = _ids(plain)
    min_tokens = len(plain_ids) + 1  # the end held back exactly where greedy wanted it: an off-by-one ends there
    reply = _chat(smol, max_tokens=min_tokens + 10, min_tokens=min_tokens)
    output_ids = _ids(reply)[1]
    assert len(output_ids) >= min_tokens > len(plain_ids)
    assert output_ids == _reference(lm, prompt_ids, min_tokens + 10, min_tokens=min_tokens)[0]


def test_a_stop_string_in_the_first_min_tokens_does_not_end_the_answer(smol, lm):
    long = _chat(smol, LONG_MESSAGES, max_tokens=40)
    text, output_ids = long.choices[0].message.content, _ids(long)[1]
    stop = text.split()[1]  # a word of the answer's first few tokens
    cut = _chat(smol, LONG_MESSAGES, max_tokens=40, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    # the first tokens whose text holds that word whole: vLLM ignores a stop string that ends within them
    min_tokens = next(k for k in range(1, len(output_ids)) if stop in lm.tokenizer.decode(output_ids[:k]))
    floor = len(lm.tokenizer.decode(output_ids[:min_tokens]))
    later = text.find(stop, floor - len(stop) + 1)
    held = _chat(smol, LONG_MESSAGES, max_tokens=40, stop=[stop], min_tokens=min_tokens)
    assert held.choices[0].message.content == (text[:later] if later >= 0 else text)
    assert len(held.choices[0].message.content) > len(cut.choices[0].message.content)


def test_stop_token_ids_end_on_that_token(smol, lm):
    long = _chat(smol, LONG_MESSAGES, max_tokens=30)
    output_ids = _ids(long)[1]
    position = next(i for i, t in enumerate(output_ids) if i >= 3 and t not in output_ids[:i])
    stop_id = output_ids[position]
    reply = _chat(smol, LONG_MESSAGES, max_tokens=30, stop_token_ids=[stop_id])
    assert _ids(reply)[1] == output_ids[:position]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == lm.tokenizer.decode(output_ids[:position])
    kept = _chat(smol, LONG_MESSAGES, max_tokens=30, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == lm.tokenizer.decode(output_ids[:position + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(smol):
    long = _chat(smol, LONG_MESSAGES, max_tokens=30)
    text = long.choices[0].message.content
    stop = text.split()[3]
    kept = _chat(smol, LONG_MESSAGES, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == text[:text.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def test_top_k_1_at_temperature_1_is_greedy(smol):
    greedy = _ids(_chat(smol, LONG_MESSAGES, max_tokens=16))[1]
    for seed in (1, 2, 3):
        assert _ids(_chat(smol, LONG_MESSAGES, max_tokens=16, temperature=1.0, seed=seed, top_k=1))[1] == greedy
    sampled = [_ids(_chat(smol, LONG_MESSAGES, max_tokens=16, temperature=1.0, seed=s))[1] for s in (1, 2, 3)]
    assert any(ids != greedy for ids in sampled)  # without top_k these seeds leave the greedy path


def test_repetition_penalty_changes_the_greedy_answer_as_computed_by_hand(smol, lm):
    plain = _chat(smol, LONG_MESSAGES, max_tokens=16)
    prompt_ids, plain_ids = _ids(plain)
    reply = _chat(smol, LONG_MESSAGES, max_tokens=16, repetition_penalty=1.5)
    assert _ids(reply)[1] != plain_ids
    assert _ids(reply)[1] == _reference(lm, prompt_ids, 16, repetition_penalty=1.5)[0]


def test_completions_and_responses_serve_them_too(smol, lm):
    chat = _chat(smol, LONG_MESSAGES, max_tokens=12, repetition_penalty=1.5)
    prompt_ids, chat_ids = _ids(chat)
    completion = smol.client().completions.create(model=SMOL, prompt=prompt_ids, max_tokens=12, temperature=0.0,
                                                  extra_body={"kvrelay": DEBUG, "repetition_penalty": 1.5})
    assert completion.choices[0].text == chat.choices[0].message.content
    response = smol.client().responses.create(model=SMOL, input=LONG_MESSAGES[0]["content"], max_output_tokens=12,
                                              temperature=0.0, extra_body={"kvrelay": DEBUG,
                                                                           "repetition_penalty": 1.5})
    assert response.output_text == chat.choices[0].message.content
    assert chat_ids == _reference(lm, prompt_ids, 12, repetition_penalty=1.5)[0]


# a value of each refused parameter that would change the answer on vLLM
REFUSED_VALUES = {"use_beam_search": True, "length_penalty": 0.5, "watermarking": True, "truncate_prompt_tokens": 8,
                  "prompt_logprobs": 1, "logprob_token_ids": [5], "allowed_token_ids": [5, 6], "bad_words": ["sky"],
                  "thinking_token_budget": 16, "vllm_xargs": {"k": 1}, "kv_transfer_params": {"do_remote": True},
                  "ec_transfer_params": {"x": 1}, "repetition_detection": {"max_pattern_size": 4},
                  "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}",
                  "mm_processor_kwargs": {"x": 1}, "media_io_kwargs": {"image": {}}, "prompt_embeds": "AAAA",
                  "priority": 1, "return_token_ids": True, "return_tokens_as_token_ids": True,
                  "return_prompt_text": True}


def test_every_refused_parameter_has_a_value_here():
    assert set(REFUSED_VALUES) == {r.name for r in REFUSED}
    assert not set(SERVED) & set(REFUSED_VALUES)


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refused_parameter_is_a_400_naming_it(smol, name):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(smol, **{name: REFUSED_VALUES[name]})
    assert err.value.body["param"] == name and err.value.body["code"] == "unsupported", err.value.body
    assert name in err.value.body["message"]


@pytest.mark.parametrize("api", ["completions", "responses"])
def test_the_other_routes_refuse_by_name_too(smol, api):
    with pytest.raises(openai.BadRequestError) as err:
        if api == "completions":
            smol.client().completions.create(model=SMOL, prompt="hi", max_tokens=2, extra_body={"priority": 3})
        else:
            smol.client().responses.create(model=SMOL, input="hi", max_output_tokens=2, extra_body={"priority": 3})
    assert err.value.body["param"] == "priority" and err.value.body["code"] == "unsupported"


# what vLLM's own clients send when they set nothing: vLLM's defaults, all served
DEFAULTS = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
            "ignore_eos": False, "include_stop_str_in_output": False, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0,
            "watermarking": None, "truncate_prompt_tokens": None, "prompt_logprobs": None, "bad_words": [],
            "allowed_token_ids": None, "priority": 0, "add_special_tokens": False, "return_token_ids": False,
            "vllm_xargs": None, "kv_transfer_params": None, "request_id": "abc", "stream_interval": 1}


def test_vllms_defaults_are_served_and_change_nothing(smol):
    plain = _chat(smol)
    reply = _chat(smol, **DEFAULTS)
    assert _ids(reply) == _ids(plain)
    assert _chat(smol, top_k=0, add_special_tokens=True).choices[0].message.content  # SmolLM2 adds no BOS


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 30}, "min_tokens"),
    ({"stop_token_ids": [49152]}, "stop_token_ids.0"), ({"stop_token_ids": [5, -1]}, "stop_token_ids.1"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids.0"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_out_of_range_values_are_400s_naming_the_parameter(smol, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(smol, **fields)  # max_tokens 24
    assert err.value.body["param"] == param and err.value.body["code"] == "invalid_value", err.value.body


@pytest.mark.parametrize("extra", [
    {"ignore_eos": True},
    {"min_tokens": 20},
    {"min_tokens": 20, "ignore_eos": True},
])
@pytest.mark.parametrize("constraint", [
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"blue": {"type": "boolean"}}, "required": ["blue"],
        "additionalProperties": False}}}},
])
def test_a_grammars_end_ends_the_answer_whatever_ignore_eos_and_min_tokens_say(smol, extra, constraint):
    # the end-of-sequence id held back (min_tokens) or no stop id (ignore_eos) left a complete grammar nothing to
    # sample: a 500 "every token's logit is -inf"
    reply = _chat(smol, max_tokens=40, **extra, **constraint)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 40
    text = choice.message.content
    assert text in ("yes", "no") if "structured_outputs" in constraint else set(json.loads(text)) == {"blue"}


# vLLM's Responses request has these (vLLM 0.32's ResponsesRequest.to_sampling_params): dropped, the answer was the
# unconstrained one with no error
@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"choice": ["maybe"]}}, lambda r: r.output_text == "maybe"),
    ({"logit_bias": {"28": 100}, "max_output_tokens": 3}, lambda r: r.output_text == ",,,"),
    ({"chat_template_kwargs": {"messages": []}}, None),
])
def test_responses_serve_the_constraint_and_penalties_vllms_responses_request_has(smol, lm, extra, check):
    assert lm.tokenizer.decode([28]) == ","
    kwargs = {"model": SMOL, "input": MESSAGES[0]["content"], "max_output_tokens": 8, "temperature": 0.0, **extra}
    body = {k: kwargs.pop(k) for k in list(extra) if k != "max_output_tokens"}
    if check is None:
        with pytest.raises(openai.BadRequestError) as err:
            smol.client().responses.create(**kwargs, extra_body=body)
        assert err.value.body["param"] == "chat_template_kwargs.messages"
    else:
        response = smol.client().responses.create(**kwargs, extra_body=body)
        assert check(response), response.output_text
