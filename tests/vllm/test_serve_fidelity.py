"""vLLM serving kvrelay's exported SmolLM2 through ``kvrelay.vllm.launch``, driven by the official ``openai``
client: it serves chat, renders the chat template to kvrelay's prompt ids, and its first-token distribution on
the same ids is kvrelay ``full``'s (the baseline every connector fidelity number is measured against)."""

from __future__ import annotations

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
