"""vLLM serving kvrelay's exported SmolLM2 through ``kvrelay.vllm.launch``, driven by the official ``openai``
client: it serves chat, renders the chat template to kvrelay's prompt ids, and its first-token distribution on
the same ids is kvrelay ``full``'s (the baseline every connector fidelity number is measured against). Beside it,
``kvrelay serve`` on the same weights answers vLLM's ``structured_outputs`` as vLLM does (both decode with
xgrammar), and renders ``continue_final_message`` / ``add_generation_prompt`` to vLLM's prompt ids."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvrelay.eval.fidelity import first_token_agrees, kl_first_token

# the same fp32 weights on both sides: only the order of fp32 sums differs (kvrelay's packed oneDNN matmuls,
# vLLM's CPU kernels), so the distributions agree to ~1e-11 nats (measured); a wrong weight, norm, RoPE base or
# template moves the KL by orders of magnitude more than this bound
MAX_KL = 1e-6
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did she sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
    "she earn?",
    "Write one sentence about the sea.",
]


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a careful math solver. Solve the problem step by step."},
            {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def lm():
    from kvrelay.weights.loader import load_model

    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def server(vllm_server_factory, lm):
    # every token's logprob comes back, so the KL is over the whole vocabulary, not a top-k
    return vllm_server_factory(max_logprobs=lm.config.vocab_size)


def _prompt_ids(lm, question: str) -> list[int]:
    from kvrelay.pipeline.prompt import chat_prompt_ids

    return chat_prompt_ids(lm.tokenizer, _messages(question)).ids


def _vllm_first_logprobs(server, ids: list[int], vocab_size: int) -> tuple[torch.Tensor, int]:
    """vLLM's first-token log-probabilities over the whole vocabulary [vocab] and its greedy token."""
    out = server.client().completions.create(
        model=server.model, prompt=ids, max_tokens=1, temperature=0.0, logprobs=vocab_size,
        extra_body={"return_tokens_as_token_ids": True})
    choice = out.choices[0]
    top = choice.logprobs.top_logprobs[0]  # {"token_id:123": logprob}
    logprobs = torch.full((vocab_size,), float("-inf"), dtype=torch.float64)
    for key, value in top.items():
        logprobs[int(key.removeprefix("token_id:"))] = value
    assert torch.isfinite(logprobs).sum() >= vocab_size - 1  # the whole distribution came back
    return logprobs, int(choice.logprobs.tokens[0].removeprefix("token_id:"))


def _kvrelay_full_first_logits(lm, ids: list[int]) -> torch.Tensor:
    from kvrelay.engine import Engine, GenerateOptions
    from kvrelay.model.sampling import SamplingConfig

    return Engine(lm).generate(ids, "full", GenerateOptions(SamplingConfig(max_new_tokens=1))).first_logits


def test_serves_chat_with_kvrelays_prompt_ids(server, lm):
    messages = _messages(QUESTIONS[0])
    ids = _prompt_ids(lm, QUESTIONS[0])
    tokenized = server.post("/tokenize", {"model": server.model, "messages": messages,
                                          "add_generation_prompt": True})
    assert tokenized["tokens"] == ids  # vLLM's chat template and tokenizer give kvrelay's ids
    reply = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                                    temperature=0.0)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens >= 1


def test_first_token_matches_kvrelay_full(server, lm, record_property):
    kls = []
    for question in QUESTIONS:
        ids = _prompt_ids(lm, question)
        vllm_logprobs, vllm_token = _vllm_first_logprobs(server, ids, lm.config.vocab_size)
        full = _kvrelay_full_first_logits(lm, ids)
        assert first_token_agrees(full, vllm_logprobs)
        assert vllm_token == int(full.argmax())
        kls.append(kl_first_token(full, vllm_logprobs))
    record_property("first_token_kl", kls)
    print(f"first-token KL(kvrelay full || vLLM) per prompt: {', '.join(f'{kl:.2e}' for kl in kls)}")
    assert max(kls) < MAX_KL, kls


# ---------------------------------------------------------------------- kvrelay serve beside vLLM
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
COLOURS = ["red", "green", "blue"]
STRUCTURED = [("What is 12 times 12?", {"regex": r"[0-9]{1,5}"}),
              ("Which colour is the sky on a clear day?", {"choice": COLOURS}),
              ("Describe a person.", {"json": PERSON}),
              ("Is the sky blue?", {"grammar": 'root ::= "Answer: " ("yes" | "no") "."'})]


@pytest.fixture(scope="module")
def kvrelay_serve():
    from tests.server.conftest import SMOL, Server

    srv = Server("--model", SMOL, "--kv-budget-gb", "0.25")
    try:
        yield srv
    finally:
        srv.stop()


def _follows(structured: dict, text: str) -> bool:
    if "regex" in structured:
        return re.fullmatch(structured["regex"], text) is not None
    if "choice" in structured:
        return text in structured["choice"]
    if "json" in structured:
        from jsonschema import Draft202012Validator

        return Draft202012Validator(structured["json"]).is_valid(json.loads(text))
    return text in ("Answer: yes.", "Answer: no.")


def test_structured_outputs_decode_as_on_vllm(server, kvrelay_serve):
    from tests.server.conftest import SMOL

    for question, structured in STRUCTURED:
        messages = [{"role": "user", "content": question}]
        answers = [srv.client().chat.completions.create(model=model, messages=messages, max_tokens=60,
                                                        temperature=0.0,
                                                        extra_body={"structured_outputs": structured}
                                                        ).choices[0].message.content
                   for srv, model in ((server, server.model), (kvrelay_serve, SMOL))]
        assert answers[0] == answers[1], (structured, answers)
        assert _follows(structured, answers[1]), (structured, answers)  # constrained on both, not free on both
    prompt = "My phone number is"
    texts = [srv.client().completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0.0,
                                             extra_body={"structured_outputs": {"regex": r"[0-9]{3,8}"}}
                                             ).choices[0].text
             for srv, model in ((server, server.model), (kvrelay_serve, SMOL))]
    assert texts[0] == texts[1] and re.fullmatch(r"[0-9]{3,8}", texts[1]), texts


@pytest.mark.parametrize(("messages", "flags"), [
    (_messages(QUESTIONS[0]) + [{"role": "assistant", "content": "Let me think. In April she sold"}],
     {"continue_final_message": True, "add_generation_prompt": False}),
    (_messages(QUESTIONS[2]), {"add_generation_prompt": False}),
    (_messages(QUESTIONS[2]), {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}}),
])
def test_template_flags_give_vllms_prompt_ids(server, kvrelay_serve, messages, flags):
    from tests.server.conftest import SMOL

    vllm_ids = server.post("/tokenize", {"model": server.model, "messages": messages, **flags})["tokens"]
    reply = kvrelay_serve.client().chat.completions.create(model=SMOL, messages=messages, max_tokens=1,
                                                           extra_body={**flags, "kvrelay": {"debug": True}})
    assert reply.model_extra["kvrelay"]["debug"]["prompt_ids"] == vllm_ids
