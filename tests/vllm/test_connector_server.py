"""kvrelay's connector in vLLM's own OpenAI server, driven by the ``openai`` client: a gsm8k-chain3 problem as
plain chat requests. The fidelity reference is kvrelay's ``full`` prefill on the prompt ids vLLM's /tokenize gives:
vLLM without the connector computes the same first-token distribution (test_serve_fidelity.py), and one server
is what the test machine's memory holds.

Slow (a vLLM server starts; minutes on a loaded 2-core machine): ``make vllm-test``, not CI.
"""

from __future__ import annotations

import uuid

import pytest
import torch

# epic on SmolLM2 through kvrelay serve (BENCHMARKS.md "Serving", gsm8k-chain3): mean first-token KL 0.0081 against
# full; one call's KL runs to several times the mean, and here it is taken over the reference's top 20 tokens
MAX_KL_FIRST_TOKEN = 0.1
CONNECTOR = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"method": "epic"}}
MAX_TOKENS = {"solver": 48, "critic": 32, "finalizer": 16}


@pytest.fixture(scope="module")
def server(vllm_server_factory):
    return vllm_server_factory(CONNECTOR, extra_args=("--enable-prompt-tokens-details",))


def reference_logprobs(lm, ids: list[int]) -> dict[str, float]:
    from kvrelay.cache.kv import SequenceKV

    cache = SequenceKV(lm.config, torch.float32, "cpu", capacity=len(ids) + 1)
    top = torch.log_softmax(lm.model.prefill(torch.tensor(ids), cache).logits.double(), -1).topk(20)
    return {lm.tokenizer.decode([int(i)]): float(v) for v, i in zip(top.values, top.indices, strict=True)}


@pytest.fixture(scope="module")
def chain(server):
    """One problem through the chain: (salt, [(agent, messages, prompt ids, call)])."""
    from benchmarks.vllm_chain import chat
    from kvrelay.pipeline.workloads import gsm8k_chain3

    workload = gsm8k_chain3()
    values = {"question": workload.problems(None, 1)[0].inputs["question"]}
    salt, calls = uuid.uuid4().hex, []
    for name in workload.spec.order:
        agent = workload.spec.agent(name)
        messages = [{"role": "system", "content": agent.system},
                    {"role": "user", "content": agent.user.format(**values)}]
        out = chat(server.client(), server.model, messages, MAX_TOKENS[name], salt)
        values[name] = out["text"]
        ids = server.post("/tokenize", {"model": server.model, "messages": messages,
                                        "add_generation_prompt": True})["tokens"]
        calls.append((name, messages, ids, out))
    return salt, calls


def test_downstream_agents_reuse_upstream_kv_within_epics_fidelity(chain):
    from benchmarks.vllm_chain import first_token_fidelity
    from kvrelay.weights.loader import load_model

    lm = load_model("smollm2-135m")
    _, calls = chain
    (_, _, solver_ids, solver), *downstream = calls
    assert solver["cached_tokens"] == 0  # nothing stored yet, and no earlier request of this salt
    _, kl = first_token_fidelity(reference_logprobs(lm, solver_ids), solver["first_logprobs"])
    assert kl < 1e-3  # the reference is vLLM's own computation where nothing is reused
    for name, _, ids, out in downstream:
        assert out["cached_tokens"] >= 16, (name, out)  # the connector's claim (no local hit in a new salt)
        _, kl = first_token_fidelity(reference_logprobs(lm, ids), out["first_logprobs"])
        assert kl <= MAX_KL_FIRST_TOKEN, (name, kl)


def test_a_span_of_one_cache_salt_is_never_reused_for_another(server, chain):
    from benchmarks.vllm_chain import chat

    salt, calls = chain
    name, messages, _, out = calls[1]
    assert out["cached_tokens"] >= 16
    # the critic's very messages under a new salt: nothing of the chain's spans is found, and vLLM has no local
    # hit in a salt that has seen no request
    assert chat(server.client(), server.model, messages, 1, uuid.uuid4().hex)["cached_tokens"] == 0
