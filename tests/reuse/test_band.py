"""The band's detection step: selection from the select layer's Q/K/V, before its attention and MLP."""

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import Entry, LayerView
from kvrelay.reuse.band import BandSchedule
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.relay import value_cos_deviation
from kvrelay.reuse.spans import collect_reuse
from tests.helpers import tiny_lm

SELECT, END = 1, 2  # of 4 layers


class _SelectAfterLayer(BandSchedule):
    """The detection step run as a whole layer: every span token through the select layer's attention
    and MLP, the selection applied after it (the reference the cheaper step must agree with)."""

    def selects_before_attention(self, layer: int) -> bool:
        return False

    def after_layer(self, view: LayerView) -> torch.Tensor | None:
        if view.layer == self.select_layer:
            return self.before_attention(view)
        return super().after_layer(view)


def _top_half(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
    dev = value_cos_deviation(view, span_rows)
    keep = torch.zeros(span_rows.numel(), dtype=torch.bool)
    keep[dev.topk(span_rows.numel() // 2).indices] = True
    return keep


@pytest.fixture(scope="module")
def setup():
    lm = tiny_lm("llama3")
    lm.model.double()
    engine = Engine(lm, KVStore(1 << 28))
    gen = torch.Generator().manual_seed(3)
    up_prompt = torch.randint(0, 256, (18,), generator=gen).tolist()
    up = engine.generate(up_prompt, "full", GenerateOptions(SamplingConfig(max_new_tokens=20), keep_cache=True))
    engine.publish("up", up)
    head, tail = torch.randint(0, 256, (6,), generator=gen).tolist(), torch.randint(0, 256, (4,), generator=gen)
    ids = head + up.output_ids + tail.tolist()
    call = CallInput(ids, [SpanRef(6, 6 + len(up.output_ids), "up", 18)])
    return lm, engine.store, call


def _prefill(setup, schedule_cls):
    lm, store, call = setup
    reuse = collect_reuse(call, store, lm.fingerprint)
    schedule = schedule_cls(reuse.new_idx(len(call.prompt_ids)), {0: Entry(reuse.approx_idx())}, SELECT, END,
                            _top_half)
    cache = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=len(call.prompt_ids) + 1)
    for load in reuse.loads:
        cache.load_span(store.get(load.span_id), load.dst_start, lm.model.rope, load.src_start, load.src_end)
    rows_in_mlp: list[int] = []
    hook = lm.model.model.layers[SELECT].mlp.register_forward_hook(
        lambda module, args, out: rows_in_mlp.append(args[0].shape[0]))
    try:
        result = lm.model.prefill(torch.tensor(call.prompt_ids), cache, schedule)
    finally:
        hook.remove()
    return result, schedule, cache, rows_in_mlp


def test_selection_before_attention_keeps_the_same_tokens_and_output(setup):
    cheap, cheap_sched, cheap_cache, _ = _prefill(setup, BandSchedule)
    whole, whole_sched, whole_cache, _ = _prefill(setup, _SelectAfterLayer)
    assert cheap_sched.num_selected == whole_sched.num_selected == 10  # the top half of 20 span tokens
    torch.testing.assert_close(cheap.logits, whole.logits, atol=1e-10, rtol=0)
    n = cheap_cache.length  # the same K/V at every position and layer
    torch.testing.assert_close(cheap_cache.kv_all(0, n), whole_cache.kv_all(0, n), atol=1e-10, rtol=0)
    # every span token's K/V at the select layer is fresh in both, so both count it as computed there
    assert cheap.num_computed_token_layers == whole.num_computed_token_layers


def test_dropped_tokens_skip_the_select_layers_attention_and_mlp(setup):
    lm, _, call = setup
    num_new = len(call.prompt_ids) - 20
    _, _, _, cheap_rows = _prefill(setup, BandSchedule)
    _, _, _, whole_rows = _prefill(setup, _SelectAfterLayer)
    assert whole_rows == [num_new + 20]  # the whole layer for every active token
    assert cheap_rows == [num_new + 10]  # only the new tokens and the 10 kept span tokens
