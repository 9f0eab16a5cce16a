"""kvrelay's connector in vLLM's own OpenAI server, driven by the ``openai`` client: a gsm8k-chain3 problem
as plain chat requests, against a plain vLLM (its prefix cache alone) on the very same messages.

Slow (two vLLM servers start; minutes on a loaded 2-core machine): ``make vllm-test``, not CI.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

# the connector's fidelity bounds on these calls: epic on SmolLM2 (kvrelay serve, gsm8k-chain3, BENCHMARKS.md
# "Serving") agrees with full on 0.95 of downstream first tokens at mean KL 0.0081; one call's KL runs up to
# ~10x the mean, and here it is measured over the top 20 tokens only
MAX_KL_FIRST_TOKEN = 0.1
CONNECTOR = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"method": "epic"}}
MAX_TOKENS = {"solver": 48, "critic": 32, "finalizer": 16}
DETAILS = ("--enable-prompt-tokens-details",)


@pytest.fixture(scope="module")
def servers(vllm_server_factory):
    """(connector server, plain server), started side by side."""
    with ThreadPoolExecutor(2) as pool:
        connector = pool.submit(vllm_server_factory, CONNECTOR, extra_args=DETAILS)
        plain = pool.submit(vllm_server_factory, None, extra_args=DETAILS)
        return connector.result(), plain.result()


@pytest.fixture(scope="module")
def chain(servers):
    """One problem through the chain on the connector's server, then the same calls on the plain one."""
    from benchmarks.vllm_chain import run_chain
    from kvrelay.pipeline.workloads import gsm8k_chain3

    connector, plain = servers
    question = gsm8k_chain3().problems(None, 1)[0].inputs["question"]
    salt = uuid.uuid4().hex
    return salt, run_chain(connector.client(), plain.client(), connector.model, question, salt, MAX_TOKENS)


def test_downstream_agents_reuse_upstream_kv_within_epics_fidelity(chain):
    _, rows = chain
    solver, *downstream = rows
    assert solver["connector"]["cached_tokens"] == solver["plain"]["cached_tokens"]  # nothing stored yet
    for row in downstream:
        # the connector's claim comes on top of vLLM's own prefix-cache hits on the same messages
        assert row["connector"]["cached_tokens"] >= row["plain"]["cached_tokens"] + 16, row
        assert row["first_token_agree"], row
        assert row["kl_first_token_top"] <= MAX_KL_FIRST_TOKEN, row


def test_a_span_of_one_cache_salt_is_never_reused_for_another(servers, chain):
    from benchmarks.vllm_chain import chat
    from kvrelay.pipeline.workloads import gsm8k_chain3

    connector, plain = servers
    salt, rows = chain
    spec = gsm8k_chain3().spec
    question = gsm8k_chain3().problems(None, 1)[0].inputs["question"]
    critic = spec.agent("critic")
    # the critic's prompt quotes a solver answer the connector stored under ``salt``; under another salt nothing
    # of it is found, and the call gets vLLM's own prefix hits only, as the plain server gives
    text = "Janet's ducks lay 16 eggs per day. She eats three and bakes with four, so she sells 9 eggs for $18."
    messages = [{"role": "system", "content": critic.system},
                {"role": "user", "content": critic.user.format(question=question, solver=text)}]
    other = uuid.uuid4().hex
    assert chat(connector.client(), connector.model, messages, 1, other)["cached_tokens"] == \
        chat(plain.client(), plain.model, messages, 1, other)["cached_tokens"]
    # the same messages under ``salt`` do find the question the solver call stored there
    again = uuid.uuid4().hex
    assert chat(connector.client(), connector.model, messages, 1, salt)["cached_tokens"] > \
        chat(plain.client(), plain.model, messages, 1, again)["cached_tokens"]
