"""kvrelay's connector running ``relay`` in vLLM's own OpenAI server: a gsm8k-chain3 problem as plain chat requests
(the chain of ``test_connector_server``), its downstream calls served from the upstream calls' K/V, repaired in
relay's band. The fidelity reference is kvrelay's ``full`` prefill on the prompt ids vLLM's /tokenize gives (vLLM
without the connector computes the same first-token distribution: test_serve_fidelity.py).

Slow (a vLLM server starts; minutes on a loaded 2-core machine): ``make vllm-test``, not CI.
"""

from __future__ import annotations

import re

import pytest

from tests.vllm.test_connector_server import MAX_KL_FIRST_TOKEN, chain, reference_logprobs  # noqa: F401 - fixture

# no "profile": the folder was exported from the embedded SmolLM2 (its kvrelay.json), whose relay profile ships
CONNECTOR = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"method": "relay"}}
# the connector's load line (``connector.start_load_kv``) in vLLM's output
LOAD_LINE = re.compile(r"request \S+: (\d+) tokens claimed, (\d+) loaded, (\d+) computed \(\d+ spans missing; "
                       r"(\d+) token-layers\)")


@pytest.fixture(scope="module")
def server(vllm_server_factory):
    return vllm_server_factory(CONNECTOR, extra_args=("--enable-prompt-tokens-details",))


def test_downstream_agents_reuse_upstream_kv_within_relays_fidelity(server, chain):  # noqa: F811 - imported fixture
    """relay on SmolLM2 through kvrelay serve (BENCHMARKS.md, gsm8k-chain3): mean first-token KL 0.0036-0.0048 against
    full, below epic's; the bound is epic's connector test's (one call runs to several times the mean, over the
    reference's top 20). Every downstream prompt token but the last is claimed: vLLM reports them cached."""
    from benchmarks.vllm_chain import first_token_fidelity
    from kvrelay.weights.loader import load_model

    lm = load_model("smollm2-135m")
    _, calls = chain
    (_, _, _, solver), *downstream = calls
    assert solver["cached_tokens"] == 0
    for name, _, ids, out in downstream:
        assert out["cached_tokens"] == len(ids) - 1, (name, out)  # relay's claim: all but the last token
        _, kl = first_token_fidelity(reference_logprobs(lm, ids), out["first_logprobs"])
        assert kl <= MAX_KL_FIRST_TOKEN, (name, kl)
    # relay repaired span tokens in its band: each load computed more token-layers than its gaps and new tokens at
    # every layer, plus the last prompt token (the forward runs over the whole prompt): exactly what naive computes
    loads = [tuple(map(int, m.groups())) for m in LOAD_LINE.finditer(server.log_path.read_text(errors="replace"))]
    assert len(loads) == len(downstream), loads
    for (name, _, ids, _), load in zip(downstream, loads, strict=True):
        num_claimed, num_loaded, num_computed, num_token_layers = load
        assert num_claimed == len(ids) - 1 and num_loaded > num_computed, (name, num_claimed, num_loaded)
        assert num_token_layers > (num_computed + 1) * lm.config.num_layers, (name, num_computed, num_token_layers)
