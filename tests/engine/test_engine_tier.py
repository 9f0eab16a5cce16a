"""The engine on a shared tier: a downstream engine in a fresh store fetches the upstream's span, and the
call's stats carry the fetch decision with its inputs (the engine's measured compute rate among them)."""

import torch

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import CallInput, SpanRef
from kvrelay.tier.tiered import open_store
from tests.helpers import tiny_lm


def test_a_second_engine_fetches_the_span_and_records_why(tmp_path):
    lm = tiny_lm("llama2")
    url = f"disk:{tmp_path / 'tier'}"
    up_engine = Engine(lm, open_store(url, 1 << 26))
    up_ids = list(range(10, 70))
    up = up_engine.generate(up_ids, "full", GenerateOptions(SamplingConfig(max_new_tokens=8), keep_cache=True))
    up_engine.publish("up", up)

    down = Engine(lm, open_store(url, 1 << 26))  # another process's memory tier: empty
    ids = [5, 6, 7] + up.output_ids + [8, 9]
    call = CallInput(ids, [SpanRef(3, 3 + len(up.output_ids), "up", len(up_ids))])
    # a prefill measures this device's rate (before it, a tier has nothing to weigh a fetch against)
    full = down.generate(list(range(100, 140)), "full", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    assert down.compute_token_layers_per_s is not None and down.compute_token_layers_per_s > 0
    out = down.generate(call, "naive", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    assert out.stats.num_reused_tokens == len(up.output_ids)
    decisions = out.stats.tier_decisions
    assert [d["span_id"] for d in decisions] == ["up"] and decisions[0]["action"] == "fetch"
    assert decisions[0]["compute_token_layers_per_s"] == down.compute_token_layers_per_s
    assert decisions[0]["num_tokens"] == len(up_ids) + len(up.output_ids)
    # the fetched K/V is the upstream's: naive on it equals naive in the upstream's own process
    local = up_engine.generate(call, "naive", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    torch.testing.assert_close(out.first_logits, local.first_logits, atol=0, rtol=0)
    assert full.stats.tier_decisions == []  # a call that looks nothing up records nothing
