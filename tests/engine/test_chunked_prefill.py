"""Chunked prefill (``Engine.begin`` -> ``PrefillTask``) gives what one-shot ``Engine.start`` gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrelay.engine import Engine, GenerateOptions, prefill
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput
from tests.helpers import random_ids, relayed_call

CHUNKED = ["full", "prefix", "naive", "epic"]  # their active set is fixed in advance: pieces of tokens
BY_LAYERS = ["cacheblend", "relay[band=1:2:3]", "relay[band=1:1:3]"]  # their band selects as it goes: pieces of
# layers (relay: a selector at L_det, and an admission where L_det == L_start)
ATOL = 1e-5  # a layer run as row chunks: fp32 matmuls over fewer rows and attention over fewer keys round differently


@pytest.fixture(scope="module", params=["llama3", "gemma3"])  # gemma3: sliding windows across chunk edges
def setup(request):
    return relayed_call(request.param)


def _chunked(engine: Engine, call: CallInput, method: str, budget: int, options: GenerateOptions):
    task = engine.begin(call, method, options)
    assert task.num_remaining_tokens == len(call.prompt_ids)  # before it plans: at most the whole prompt
    pieces = [task.advance(budget)]  # plans, loads the reused KV, runs the first piece
    while not task.done:
        remaining = task.num_remaining_tokens
        pieces.append(task.advance(budget))
        if method in CHUNKED:
            assert task.num_remaining_tokens == (0 if task.done else remaining - pieces[-1])
        else:  # the prompt's share of the layers left (a chunk of a layer's rows may move it less than a token)
            assert 0 <= task.num_remaining_tokens <= remaining
    return task.sequence(), pieces


@pytest.mark.parametrize("method", CHUNKED + BY_LAYERS)
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_gives_the_one_shot_logits_kv_and_tokens(setup, method, budget):
    lm, store, call = setup
    engine = Engine(lm, store, capture_layers=(1,))
    options = GenerateOptions(SamplingConfig(max_new_tokens=6), keep_cache=True)
    whole = engine.start(call, method, options)
    seq, pieces = _chunked(engine, call, method, budget, options)
    n = len(call.prompt_ids)
    assert len(pieces) > 1 and seq.stats.num_prefill_chunks == len(pieces)
    # a piece of layers fits the budget too: a layer of more than ``budget`` tokens' work (a 4-layer model: a quarter
    # of the prompt's) runs as chunks of its rows
    assert all(0 < p <= budget for p in pieces)
    torch.testing.assert_close(seq.first_logits, whole.first_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(seq.cache.k[:, :, :n], whole.cache.k[:, :, :n], atol=1e-4, rtol=0)
    torch.testing.assert_close(seq.cache.v[:, :, :n], whole.cache.v[:, :, :n], atol=1e-4, rtol=0)
    for field in ("num_prompt_tokens", "num_reused_tokens", "num_computed_token_layers", "num_shifted_tokens",
                  "fallback"):
        assert getattr(seq.stats, field) == getattr(whole.stats, field), field
    assert seq.prompt_hidden.keys() == whole.prompt_hidden.keys()
    for layer, h in whole.prompt_hidden.items():
        torch.testing.assert_close(seq.prompt_hidden[layer], h, atol=1e-4, rtol=0)
    for s in (seq, whole):  # the decode that follows: token for token
        while not s.done:
            engine.step([s])
    assert seq.output_ids == whole.output_ids
    assert engine.finish(seq).text == engine.finish(whole).text


def test_a_prompt_over_the_context_is_refused_before_any_work(setup):
    from kvrelay.errors import ContextLengthError

    lm, store, _ = setup
    with pytest.raises(ContextLengthError):
        Engine(lm, store).begin(random_ids(lm.config.max_position_embeddings, 0), "full")


def test_ttft_covers_the_wall_time_between_chunks(setup, monkeypatch):
    """``ttft_ms`` runs from the first piece to the last, whatever ran between; the compute time is the pieces'."""
    lm, store, call = setup
    engine = Engine(lm, store)
    task = engine.begin(call, "full", GenerateOptions(SamplingConfig(max_new_tokens=2)))
    clock = iter([10.0, 10.1, 20.0, 20.1, 30.0, 30.1])  # each piece: its start, its end
    monkeypatch.setattr(prefill, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    while not task.done:
        task.advance(len(call.prompt_ids) // 3 + 1)
    seq = task.sequence()
    assert seq.stats.num_prefill_chunks == 3
    assert seq.stats.ttft_ms == pytest.approx(20.1e3)  # 10.0 s -> 30.1 s
    assert task.compute_ms == pytest.approx(300.0)  # three pieces of 0.1 s


@pytest.mark.parametrize("method", CHUNKED + BY_LAYERS)
def test_pieces_of_shrinking_sizes_give_the_one_shot_results(setup, method):
    """The server sizes each piece by its cost (fewer tokens deeper in the prompt), from ``upcoming_positions``:
    the positions it reports are the ones each piece computes, and the sizes change nothing."""
    lm, store, call = setup
    engine = Engine(lm, store)
    options = GenerateOptions(SamplingConfig(max_new_tokens=6), keep_cache=True)
    whole = engine.start(call, method, options)
    task = engine.begin(call, method, options)
    sizes, seen = iter([13, 8, 5, 3, 2] + [1] * len(call.prompt_ids)), []
    while not task.done:
        positions, layer = task.upcoming_positions(64), task.upcoming_layer()
        assert (positions is None) != (layer is None)
        num = task.advance(next(sizes))
        if positions is not None:
            seen += positions[:num]
            assert task.last_piece[:2] == (num, sum(positions[:num]) + num)
        else:  # the layer it announced where that fits, else chunks of its rows that do
            assert 0 < task.last_piece[0] <= max(num, layer[0]) and task.last_piece[0] <= len(call.prompt_ids)
    seq = task.sequence()
    if method in CHUNKED:
        assert seen == sorted(set(seen)) and seen[-1] == len(call.prompt_ids) - 1 and seq.stats.num_prefill_chunks > 5
    else:
        assert seen == [] and seq.stats.num_prefill_chunks > 1
    torch.testing.assert_close(seq.first_logits, whole.first_logits, atol=1e-4, rtol=0)
    for s in (seq, whole):
        while not s.done:
            engine.step([s])
    assert seq.output_ids == whole.output_ids


@pytest.mark.parametrize("method", ["cacheblend"])
def test_a_band_with_nothing_to_reuse_chunks_and_gives_the_one_shot_results(setup, method):
    """A fresh prompt (no span matched): the band has no token to select, so it prefills in pieces like ``full``."""
    lm, store, _ = setup
    engine = Engine(lm, store)
    call = CallInput(random_ids(40, 11))
    options = GenerateOptions(SamplingConfig(max_new_tokens=6), keep_cache=True)
    whole = engine.start(call, method, options)
    seq, pieces = _chunked(engine, call, method, 7, options)
    assert pieces == [7] * 5 + [5] and seq.stats.num_prefill_chunks == 6 and seq.stats.num_reused_tokens == 0
    torch.testing.assert_close(seq.first_logits, whole.first_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(seq.cache.k[:, :, :40], whole.cache.k[:, :, :40], atol=1e-4, rtol=0)
    for s in (seq, whole):
        while not s.done:
            engine.step([s])
    assert seq.output_ids == whole.output_ids


def _layer_pieces(engine: Engine, call: CallInput, method: str, options: GenerateOptions, layers_per_piece: list[int],
                  between=lambda: None):
    """The prefill as pieces of ``layers_per_piece`` layers each (cycled), ``between()`` run after each piece but the
    last (while the forward is paused), decoded to the end."""
    task = engine.begin(call, method, options)
    sizes = iter(layers_per_piece * engine.lm.model.config.num_layers)
    while not task.done:
        task.advance(0, fits=_layers(next(sizes)))
        if not task.done:
            between()
    seq = task.sequence()
    while not seq.done:
        engine.step([seq])
    return seq


def _layers(num: int):
    """A ``fits`` that lets a piece run ``num`` layers."""
    asked = iter(range(num))
    return lambda tokens, keys: next(asked, None) is not None


def _decoded(engine: Engine, seq):
    while not seq.done:
        engine.step([seq])
    return seq


def _assert_identical(seq, alone, n: int) -> None:
    assert torch.equal(seq.first_logits, alone.first_logits)
    assert torch.equal(seq.cache.k[:, :, :n], alone.cache.k[:, :, :n])
    assert torch.equal(seq.cache.v[:, :, :n], alone.cache.v[:, :, :n])
    assert seq.output_ids == alone.output_ids


@pytest.mark.parametrize("method", BY_LAYERS)
@pytest.mark.parametrize("layers_per_piece", [[1], [2, 1], [3]])
def test_a_selecting_band_in_pieces_of_layers_is_bit_identical_to_one_forward(setup, method, layers_per_piece):
    """Relay's and CacheBlend's band with span tokens (they select at a layer from every token's deviation): run as
    pieces of layers while, between the pieces, another stream decodes and a second band (a prompt of another
    length) advances a layer, the logits, every layer's KV, the selection and the tokens of all three are exactly
    those each gives alone (not merely close): a paused forward shares no state with the work run meanwhile."""
    lm, store, call = setup
    engine = Engine(lm, store, capture_layers=(1,))
    options = GenerateOptions(SamplingConfig(max_new_tokens=8), keep_cache=True)
    call2 = CallInput(call.prompt_ids[:37] + random_ids(17, 8), refs=call.refs)  # the same span, a shorter tail
    other_call, other_options = CallInput(random_ids(30, 9)), GenerateOptions(SamplingConfig(max_new_tokens=8),
                                                                           keep_cache=True)
    whole = _decoded(engine, engine.start(call, method, options))
    whole2 = _decoded(engine, engine.start(call2, method, options))
    other_alone = _decoded(engine, engine.start(other_call, "full", other_options))
    assert whole.stats.num_reused_tokens > 0 and whole.plan.schedule.span_idx.numel() > 0  # the band has span tokens
    assert whole2.plan.schedule.span_idx.numel() > 0

    other = engine.start(other_call, "full", other_options)
    band2 = engine.begin(call2, method, options)
    num_paused = []

    def between():  # while ``call``'s forward is paused after a piece
        num_paused.append(1)
        if not other.done:
            engine.step([other])
        if not band2.done:
            band2.advance(0, fits=_layers(1))

    seq = _layer_pieces(engine, call, method, options, layers_per_piece, between)
    assert seq.stats.num_prefill_chunks > 1 and len(num_paused) == seq.stats.num_prefill_chunks - 1
    while not band2.done:
        band2.advance(0, fits=_layers(1))
    seq2, other = _decoded(engine, band2.sequence()), _decoded(engine, other)
    _assert_identical(seq, whole, len(call.prompt_ids) + len(seq.output_ids) - 1)
    _assert_identical(seq2, whole2, len(call2.prompt_ids) + len(seq2.output_ids) - 1)
    _assert_identical(other, other_alone, len(other_call.prompt_ids) + len(other.output_ids) - 1)
    assert seq.plan.schedule.num_selected == whole.plan.schedule.num_selected
    assert seq2.plan.schedule.num_selected == whole2.plan.schedule.num_selected
    assert seq.stats.num_computed_token_layers == whole.stats.num_computed_token_layers
    for layer, h in whole.prompt_hidden.items():
        assert torch.equal(seq.prompt_hidden[layer], h)


def _rows_within(num_tokens: float):
    """A ``fits`` that lets a piece run ``num_tokens`` tokens of a whole forward: a layer of more runs as row chunks."""
    return lambda tokens, keys: tokens <= num_tokens


@pytest.mark.parametrize("method", BY_LAYERS)
def test_a_band_in_row_chunks_interleaved_with_other_work_gives_what_it_gives_alone(setup, method):
    """Relay's and CacheBlend's band, each layer of it split into chunks of its rows (a piece of 2 tokens of a whole
    forward: 8 rows of a 4-layer model): while, between the chunks, another stream decodes and a second band advances
    a chunk of its own, the logits, every layer's KV and the selection of both bands are one forward's (up to float
    rounding: ``ATOL``), their tokens the same, and the other stream's exactly what it decodes alone."""
    lm, store, call = setup
    engine = Engine(lm, store, capture_layers=(1,))
    options = GenerateOptions(SamplingConfig(max_new_tokens=8), keep_cache=True)
    call2 = CallInput(call.prompt_ids[:37] + random_ids(17, 8), refs=call.refs)
    other_call = CallInput(random_ids(30, 9))
    whole, whole2 = (_decoded(engine, engine.start(c, method, options)) for c in (call, call2))
    other_alone = _decoded(engine, engine.start(other_call, "full", options))
    other, band2 = engine.start(other_call, "full", options), engine.begin(call2, method, options)
    task, mid_layer = engine.begin(call, method, options), []
    while not task.done:
        task.advance(0, fits=_rows_within(2))
        if task.done:
            break
        mid_layer.append(task._forward.partial is not None)
        if not other.done:
            engine.step([other])
        if not band2.done:
            band2.advance(0, fits=_rows_within(2))
    while not band2.done:
        band2.advance(0, fits=_rows_within(2))
    seq, seq2, other = (_decoded(engine, s) for s in (task.sequence(), band2.sequence(), other))
    assert sum(mid_layer) > lm.config.num_layers and seq.stats.num_prefill_chunks > 2 * lm.config.num_layers
    for mine, alone, c in ((seq, whole, call), (seq2, whole2, call2)):
        n = len(c.prompt_ids) + len(mine.output_ids) - 1
        torch.testing.assert_close(mine.first_logits, alone.first_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.cache.k[:, :, :n], alone.cache.k[:, :, :n], atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.cache.v[:, :, :n], alone.cache.v[:, :, :n], atol=ATOL, rtol=0)
        assert mine.output_ids == alone.output_ids
        assert mine.plan.schedule.num_selected == alone.plan.schedule.num_selected
        assert mine.stats.num_computed_token_layers == alone.stats.num_computed_token_layers
    _assert_identical(other, other_alone, len(other_call.prompt_ids) + len(other.output_ids) - 1)


def test_a_band_cancelled_between_row_chunks_drops_its_kv_and_computes_nothing_more(setup):
    lm, store, call = setup
    task = Engine(lm, store).begin(call, "cacheblend", GenerateOptions(SamplingConfig(max_new_tokens=2)))
    task.advance(0, fits=_rows_within(2))
    assert task._forward.partial is not None and task.cache is not None  # between two chunks of a layer's rows
    task.cancel()
    assert task.cache is None and task._forward is None and task.done and task.advance(0, fits=_rows_within(2)) == 0


def test_an_admissions_pieces_report_their_projections_and_mass_scores(setup):
    """Relay's admission at layer 1 in pieces of a few rows: a piece within its projecting phase reports what those
    rows cost, in tokens of a whole forward: the projection's share of a token each, and the scores its new tokens
    computed against the keys up to the piece's last row (the fit learns what the choice costs)."""
    lm, store, call = setup
    engine = Engine(lm, store)
    task = engine.begin(call, "relay[band=1:1:3]", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    num_layers, checked = lm.config.num_layers, 0
    while not task.done:
        part = task._forward.partial if task._forward is not None else None
        before = (part.num_done, part.positions, part.num_mass_before) if part is not None and part.admitting else None
        task.advance(0, fits=_rows_within(0.5))
        after = task._forward.partial if task._forward is not None else None
        if before is None or after is not part:  # not a piece within the admission
            continue
        start, positions, num_mass_before = before
        num_rows, num_mass = part.num_done - start, num_mass_before[part.num_done] - num_mass_before[start]
        tokens, keys = task.last_piece[:2]
        assert tokens == pytest.approx(num_rows * part.projection_share / num_layers)
        assert num_mass > 0 and keys == pytest.approx(num_mass * (positions[part.num_done - 1] + 1) / num_layers)
        checked += 1
    assert checked >= 2
