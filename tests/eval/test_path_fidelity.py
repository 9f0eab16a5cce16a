"""Fidelity along full's greedy continuation, teacher-forced, on a tiny model."""

from dataclasses import replace

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.fidelity import greedy_match, kl_first_token
from kvrelay.eval.path_fidelity import PathReference, forced_logits, path_reference, score_path
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, publish, tiny_lm

N = 12  # continuation tokens scored


@pytest.fixture(scope="module")
def setup():
    """An upstream output spliced after a different prefix, so that ``naive``'s re-rotated KV is approximate."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    gen = torch.Generator().manual_seed(3)
    up = generate(lm, torch.randint(0, 256, (20,), generator=gen).tolist(), "full", store,
                  SamplingConfig(max_new_tokens=24), keep_cache=True)
    publish(store, "up", up, lm)
    head = torch.randint(0, 256, (7,), generator=gen).tolist()
    tail = torch.randint(0, 256, (5,), generator=gen).tolist()
    call = CallInput(head + up.output_ids + tail, [SpanRef(7, 31, "up", 20, "output")])
    return lm, store, call


def test_forced_rows_are_the_logits_decoding_the_same_tokens_gives(setup):
    lm, store, call = setup
    engine = Engine(lm, store)
    fed = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    rows, stats = forced_logits(engine, call, "naive", fed)
    assert rows.shape == (7, lm.config.vocab_size) and stats.num_reused_tokens == 24
    seq = engine.start(call, "naive", GenerateOptions(SamplingConfig(max_new_tokens=8), learn=False))
    stepped = [seq.first_logits] + [lm.model.decode_step(t, seq.cache) for t in fed]
    torch.testing.assert_close(rows, torch.stack(stepped).float(), atol=1e-4, rtol=0)


def test_teacher_forced_greedy_is_free_running_greedy(setup):
    lm, store, call = setup
    engine = Engine(lm, store)
    ref = path_reference(engine, call, N)
    assert ref.num_positions == N and len(ref.fed_ids) == N
    full = generate(lm, call, "full", store, SamplingConfig(max_new_tokens=N))
    assert ref.fed_ids == full.output_ids
    assert ref.logits.argmax(-1).tolist() == ref.fed_ids  # the forced rows lead to the tokens full emitted
    own = score_path(engine, call, "full", ref)
    assert own.greedy_match and own.path_kl < 1e-8 and own.reuse == 0.0
    naive = score_path(engine, call, "naive", ref)
    free = generate(lm, call, "naive", store, SamplingConfig(max_new_tokens=N))
    assert naive.greedy_match == greedy_match(full.output_ids, free.output_ids, N)
    assert naive.path_kl > 0 and naive.reuse > 0


def test_a_later_position_that_disagrees_breaks_the_match_and_raises_the_path_kl(setup):
    lm, store, call = setup
    engine = Engine(lm, store)
    ref = path_reference(engine, call, N)
    logits = ref.logits.clone()
    logits[5] = -logits[5]  # full's top token at position 5 is now its least likely
    s = score_path(engine, call, "full", PathReference(ref.fed_ids, logits))
    other = list(ref.fed_ids)
    other[5] = (other[5] + 1) % lm.config.vocab_size  # full "emitted" another token at position 5
    assert s.greedy_match and not score_path(engine, call, "full", PathReference(other, ref.logits)).greedy_match
    # the mean over the scored positions: only position 5 differs from full's own rows
    assert s.first_kl < 1e-8 and s.path_kl == pytest.approx(kl_first_token(logits[5], ref.logits[5]) / N, rel=1e-3)


def test_a_stopped_continuation_scores_the_stop_position(setup, monkeypatch):
    lm, store, call = setup
    engine = Engine(lm, store)
    ids = path_reference(engine, call, N).fed_ids
    cut = max(i for i, t in enumerate(ids) if t not in ids[:i])  # the last token seen for the first time
    monkeypatch.setattr(lm.tokenizer, "stop_ids", frozenset({ids[cut]}))
    ref = path_reference(engine, call, N)
    assert ref.fed_ids == ids[:cut] and ref.num_positions == cut + 1
    assert int(ref.logits[cut].argmax()) == ids[cut]  # the last scored position predicts the stop token
    assert ref.stop_ids == frozenset({ids[cut]}) and score_path(engine, call, "full", ref).greedy_match
    # a method that does not stop there (here: full held to a reference whose stop ids exclude its token) fails
    assert not score_path(engine, call, "full", PathReference(ref.fed_ids, ref.logits, frozenset({-1}))).greedy_match


def test_a_call_near_the_context_end_is_scored_on_the_continuation_that_fits(setup):
    lm, store, call = setup
    room = 5
    short = replace(lm, config=replace(lm.config, max_position_embeddings=len(call.prompt_ids) + room))
    engine = Engine(short, store)
    ref = path_reference(engine, call, N)  # N tokens would not fit: fewer are scored, not a ContextLengthError
    assert len(ref.fed_ids) == room and ref.num_positions == room  # as many as fit (this continuation never stops)
    assert ref.fed_ids == path_reference(Engine(lm, store), call, N).fed_ids[:len(ref.fed_ids)]
    assert score_path(engine, call, "full", ref).greedy_match
