"""The band's detection step: selection from the select layer's Q/K/V, before its attention and MLP."""

import functools

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.rope import apply_rotary
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import Entry, LayerView
from kvrelay.reuse.band import BandSchedule
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.relay_select import value_cos_deviation
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
    return _make_setup("llama3")


@functools.cache
def _make_setup(family: str):
    lm = tiny_lm(family)
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


def _prefill(setup, schedule_cls, hooked: int = SELECT):
    lm, store, call = setup
    reuse = collect_reuse(call, store, lm.fingerprint)
    schedule = schedule_cls(reuse.new_idx(len(call.prompt_ids)), {0: Entry(reuse.approx_idx())}, SELECT, END,
                            _top_half)
    cache = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=len(call.prompt_ids) + 1)
    for load in reuse.loads:
        cache.load_span(store.get(load.span_id), load.dst_start, lm.model.rope, load.src_start, load.src_end)
    rows_in_mlp: list[int] = []
    hook = lm.model.model.layers[hooked].mlp.register_forward_hook(
        lambda module, args, out: rows_in_mlp.append(args[0].shape[0]))
    try:
        result = lm.model.prefill(torch.tensor(call.prompt_ids), cache, schedule)
    finally:
        hook.remove()
    return result, schedule, cache, rows_in_mlp


@pytest.mark.parametrize("family", ["llama3", "gemma3"])  # gemma3: sliding windows, the kept tokens' own mask
def test_selection_before_attention_keeps_the_same_tokens_and_output(family):
    setup = _make_setup(family)
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


def test_span_tokens_skip_the_band_tops_attention_and_mlp(setup):
    """At the band's top a span token's output feeds nothing: its fresh K/V are written (the whole-layer reference
    gives the same cache and logits, above), and only the new tokens run that layer's MLP."""
    lm, _, call = setup
    num_new = len(call.prompt_ids) - 20
    cheap, _, cheap_cache, cheap_rows = _prefill(setup, BandSchedule, hooked=END)
    whole, _, _, whole_rows = _prefill(setup, _SelectAfterLayer, hooked=END)
    assert whole_rows == [num_new + 10] and cheap_rows == [num_new]
    assert cheap.num_computed_token_layers == whole.num_computed_token_layers  # their K/V there count as computed
    reuse = collect_reuse(call, setup[1], lm.fingerprint)
    loaded = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=len(call.prompt_ids) + 1)
    for load in reuse.loads:
        loaded.load_span(setup[1].get(load.span_id), load.dst_start, lm.model.rope, load.src_start, load.src_end)
    span = reuse.approx_idx()
    fresh = (cheap_cache.v[END, :, span] != loaded.v[END, :, span]).any(dim=(0, 2))  # [20]: written at the top
    assert int(fresh.sum()) == 10


# ---------------------------------------------------------------- gradual filtering and admission
PRUNE_END = 3  # a band [SELECT, 3] whose layers above SELECT prune


def _drop_first_kept(dropped: dict[int, int]):
    """Prune: drop the kept span token with the lowest prompt index at each layer (noted in ``dropped``)."""
    def prune(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(span_rows.numel(), dtype=torch.bool)
        keep[0] = False
        dropped[view.layer] = int(view.active_idx[span_rows[0]])
        return keep
    return prune


def _keep_all(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
    return torch.ones(span_rows.numel(), dtype=torch.bool)


def _run_band(setup, prune=None, admit=None, carried: bool = False, end: int = PRUNE_END, capture: tuple = (),
              drift=None):
    """The setup's call under a band [SELECT, PRUNE_END]: span tokens enter at layer 0 (or, with ``carried``, at
    SELECT from this prompt's own layer-SELECT inputs); returns the result, schedule, cache, loaded cache and
    the rows that reached each layer's MLP."""
    lm, store, call = setup
    reuse = collect_reuse(call, store, lm.fingerprint)
    n = len(call.prompt_ids)

    def loaded() -> SequenceKV:
        cache = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=n + 1)
        for load in reuse.loads:
            cache.load_span(store.get(load.span_id), load.dst_start, lm.model.rope, load.src_start, load.src_end)
        return cache

    span = reuse.approx_idx()
    if carried:
        scratch = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=n + 1)
        own = BandSchedule(torch.arange(n), {}, SELECT, PRUNE_END, _keep_all)
        own.capture_layers = (SELECT,)
        active, hidden = lm.model.prefill(torch.tensor(call.prompt_ids), scratch, own).captured[SELECT]
        entries = {SELECT: Entry(span, hidden[torch.isin(active, span)])}
    else:
        entries = {0: Entry(span)}
    schedule = BandSchedule(reuse.new_idx(n), entries, SELECT, end, None if admit else _top_half, prune, admit,
                            drift)
    schedule.capture_layers = capture
    cache, reference = loaded(), loaded()
    rows_in_mlp: dict[int, int] = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out, li=li: rows_in_mlp.__setitem__(li, args[0].shape[0]))
             for li, layer in enumerate(lm.model.model.layers)]
    try:
        result = lm.model.prefill(torch.tensor(call.prompt_ids), cache, schedule)
    finally:
        for hook in hooks:
            hook.remove()
    return result, schedule, cache, reference, rows_in_mlp


def test_pruning_drops_tokens_before_each_band_layers_attention(setup):
    lm, _, call = setup
    num_new = len(call.prompt_ids) - 20
    dropped = {}
    result, schedule, cache, reference, rows = _run_band(setup, prune=_drop_first_kept(dropped))
    assert schedule.num_selected == 10 and schedule.num_pruned == 2
    # the top half of 20 span tokens runs layer 1's MLP, one fewer layer 2's; at the band's top (3) none does: the
    # 9 there need only their K/V
    assert rows == {0: num_new + 20, 1: num_new + 10, 2: num_new + 9, 3: num_new}
    # every active token counts at a layer: all 20 span tokens' Q/K/V at 1, the 10 kept at 2, the 9 at 3
    assert result.num_computed_token_layers == 4 * num_new + 20 + 20 + 10 + 9
    # the token pruned at layer 2: its K/V there are fresh, above it the reused ones
    pos = dropped[2]
    assert 6 <= pos < 26 and not torch.equal(cache.v[2, :, pos], reference.v[2, :, pos])
    assert torch.equal(cache.k[3, :, pos], reference.k[3, :, pos])
    assert torch.equal(cache.v[3, :, pos], reference.v[3, :, pos])


@pytest.mark.parametrize("end", [2, PRUNE_END])  # a band ending below the top, and at it
def test_pruning_that_keeps_everything_changes_nothing(setup, end):
    plain, _, plain_cache, _, plain_rows = _run_band(setup, end=end)
    kept, schedule, kept_cache, _, kept_rows = _run_band(setup, prune=_keep_all, end=end)
    assert schedule.num_pruned == 0
    assert kept_rows == plain_rows  # above the band's end the span tokens leave, pruned or not
    assert kept.num_computed_token_layers == plain.num_computed_token_layers
    torch.testing.assert_close(kept.logits, plain.logits, atol=1e-10, rtol=0)
    n = plain_cache.length
    torch.testing.assert_close(kept_cache.kv_all(0, n), plain_cache.kv_all(0, n), atol=1e-10, rtol=0)


def test_admission_computes_only_the_admitted_span_tokens(setup):
    lm, _, call = setup
    num_new = len(call.prompt_ids) - 20
    seen = {}

    def admit_even(view: LayerView, entering_idx: torch.Tensor) -> torch.Tensor:
        seen["active"], seen["probs"] = view.active_idx.clone(), view.attention_probs(torch.arange(2))
        return (entering_idx % 2) == 0

    result, schedule, cache, reference, rows = _run_band(setup, admit=admit_even, carried=True, capture=(SELECT,))
    span = torch.arange(6, 26)
    # the layer's captured inputs hold every token, refused ones included (their entry state)
    captured_idx, _ = result.captured[SELECT]
    assert torch.equal(captured_idx, torch.arange(len(call.prompt_ids)))
    assert schedule.num_selected == 10
    assert torch.equal(seen["active"], torch.tensor([i for i in range(len(call.prompt_ids)) if not 6 <= i < 26]))
    assert seen["probs"].shape[-1] == len(call.prompt_ids)  # the new tokens over every key, reused ones included
    # layers 0 and SELECT-1: new tokens only; from SELECT below the band's end: they and the 10 admitted; at the end
    # the admitted need only their K/V
    assert rows == {0: num_new, 1: num_new + 10, 2: num_new + 10, 3: num_new}
    assert result.num_computed_token_layers == 4 * num_new + 3 * 10
    refused = span[span % 2 == 1]
    for layer in range(4):  # a refused token is never written: the reused K/V at every layer
        assert torch.equal(cache.k[layer, :, refused], reference.k[layer, :, refused])
    admitted = span[span % 2 == 0]
    assert not torch.equal(cache.v[2, :, admitted], reference.v[2, :, admitted])


def test_admission_needs_every_span_token_entering_at_the_select_layer(setup):
    lm, store, call = setup
    reuse = collect_reuse(call, store, lm.fingerprint)
    with pytest.raises(ValueError, match="admission"):
        BandSchedule(reuse.new_idx(len(call.prompt_ids)), {0: Entry(reuse.approx_idx())}, SELECT, PRUNE_END,
                     None, admit=lambda view, idx: torch.ones(idx.numel(), dtype=torch.bool))


@pytest.mark.parametrize("family", ["llama3", "gemma3"])  # gemma3: local layers rotate by their own base
def test_drift_moves_the_span_tokens_a_pruning_layer_does_not_compute(family):
    """At each pruning layer the span tokens not active there get the drift's K (rotated to their positions)
    and V added before that layer's attention; active tokens and the layers below keep their values."""
    setup = _make_setup(family)
    lm, _, call = setup
    gen = torch.Generator().manual_seed(5)
    shape = (lm.config.num_kv_heads, 1, lm.config.head_dim)
    dk, dv = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))
    seen, dropped = {}, {}
    prune = _drop_first_kept(dropped)

    def drift(view: LayerView, span_rows: torch.Tensor):
        seen[view.layer] = view.active_idx.clone()
        # unrotate undoes the forward's rotation at each row's own position
        rope = lm.model.rope_of(view.layer)
        cos, sin = rope.cos_sin(view.active_idx, view.k.dtype, len(call.prompt_ids))
        raw = view.unrotate(view.k.index_select(1, span_rows), span_rows)
        torch.testing.assert_close(apply_rotary(raw, cos.index_select(0, span_rows), sin.index_select(0, span_rows)),
                                   view.k.index_select(1, span_rows), atol=1e-6, rtol=0)  # fp32 tables
        return dk, dv

    plain, _, plain_cache, reference, _ = _run_band(setup, prune=_drop_first_kept({}))
    result, schedule, cache, reference, _ = _run_band(setup, prune=prune, drift=drift)
    assert sorted(seen) == [2, 3]  # the pruning layers (above the select layer, through the band's end)
    span = torch.arange(6, 26)
    for layer in (2, 3):
        moved = span[~torch.isin(span, seen[layer])]
        assert moved.numel() == 10 + (layer == 3)  # refused at layer 1, and the token pruned at 2
        cos, sin = lm.model.rope_of(layer).cos_sin(moved, torch.float64, len(call.prompt_ids))
        # (the token pruned at 2 is computed there, and moved from its reused K/V above)
        rotated = apply_rotary(dk.expand(-1, moved.numel(), -1), cos, sin)  # [Hkv, m, hd]
        torch.testing.assert_close(cache.k[layer, :, moved], reference.k[layer, :, moved] + rotated, atol=1e-6, rtol=0)
        torch.testing.assert_close(cache.v[layer, :, moved], reference.v[layer, :, moved] + dv, atol=1e-12, rtol=0)
    for layer in (0, 1):  # below the pruning layers nothing moves
        n = len(call.prompt_ids)
        assert torch.equal(cache.k[layer, :, :n], plain_cache.k[layer, :, :n])
        assert torch.equal(cache.v[layer, :, :n], plain_cache.v[layer, :, :n])
    # the moved keys are what the layer's attention read: the output differs from the same band without drift
    assert not torch.allclose(result.logits, plain.logits)
    assert result.num_computed_token_layers == plain.num_computed_token_layers  # a drift computes no token
