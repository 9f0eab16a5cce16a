"""The scheduled forward: active sets, entry layers, hooks, exit, and its errors."""

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import ScheduleError
from kvrelay.model.schedule import Entry, Schedule, SuffixSchedule, rows_of
from tests.helpers import tiny_lm

N = 30


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 300, (N,), generator=torch.Generator().manual_seed(7))


def _full(lm, ids, capture=()):
    sched = Schedule()
    sched.capture_layers = capture
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    return lm.model.prefill(ids, cache, sched, all_logits=True), cache


def test_all_reused_tokens_active_from_layer0_reproduce_full(lm, ids):
    ref, _ = _full(lm, ids)
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    cache.k.normal_()  # garbage "reused" KV: every token recomputed from layer 0 must overwrite it
    cache.v.normal_()
    cache.filled[:] = True
    got = lm.model.prefill(ids, cache, Schedule(), all_logits=True)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)


def test_prefix_schedule_reproduces_full_first_token(lm, ids):
    ref, full_cache = _full(lm, ids)
    span = full_cache.export(0, 20, ids[:20].tolist(), lm.fingerprint)
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    cache.load_span(span, 0, lm.model.rope)
    got = lm.model.prefill(ids, cache, SuffixSchedule(20))
    torch.testing.assert_close(got.logits, ref.logits[-1], atol=1e-4, rtol=0)


class _EnterAt(Schedule):
    """Span tokens [a, b) enter at ``layer`` with carried hidden states; the rest from layer 0."""

    def __init__(self, a, b, layer, hidden):
        self.a, self.b, self.layer, self.hidden = a, b, layer, hidden

    def entries(self, n):
        rest = torch.cat([torch.arange(self.a), torch.arange(self.b, n)])
        return {0: Entry(rest), self.layer: Entry(torch.arange(self.a, self.b), self.hidden)}


def test_entry_above_layer0_with_exact_hidden_states_reproduces_full(lm, ids):
    ref, full_cache = _full(lm, ids, capture=(2,))
    idx, hidden = ref.captured[2]
    assert idx.tolist() == list(range(N))
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    span = full_cache.export(0, N, ids.tolist(), lm.fingerprint)
    cache.load_span(span, 0, lm.model.rope)  # layers 0-1 of the span come from here
    got = lm.model.prefill(ids, cache, _EnterAt(5, 15, 2, hidden[5:15]), all_logits=True)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)
    assert got.num_computed_token_layers == N * 4 - 10 * 2


def test_entry_above_layer0_without_hidden_is_refused(lm, ids):
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    with pytest.raises(ScheduleError, match="hidden state"):
        lm.model.prefill(ids, cache, _EnterAt(5, 15, 2, None))


def test_token_never_computed_nor_loaded_is_an_error(lm, ids):
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    with pytest.raises(ScheduleError, match="without K/V"):
        lm.model.prefill(ids, cache, SuffixSchedule(10))


class _DropAfter(Schedule):
    has_layer_hook = True

    def __init__(self, layer, keep_last=True, probe=None):
        self.layer, self.keep_last, self.probe, self.seen = layer, keep_last, probe, []

    def needs_prev_kv(self, layer):
        return True

    def after_layer(self, view):
        self.seen.append((view.layer, view.active_idx.numel(), view.prev_k is not None))
        if self.probe is not None and view.layer == self.probe:
            self.probs = view.attention_probs(torch.tensor([view.active_idx.numel() - 1]))
            self.q, self.k = view.q, view.k
        if view.layer != self.layer:
            return None
        keep = torch.zeros(view.active_idx.numel(), dtype=torch.bool)
        keep[-1] = self.keep_last
        return rows_of(keep, int(self.keep_last))


def _preloaded(lm, ids):
    """A cache holding every token's KV (as a reused span would), so dropped tokens are covered."""
    _, cache = _full(lm, ids)
    return cache


def test_layer_hook_drops_tokens_and_counts(lm, ids):
    sched = _DropAfter(layer=1)
    cache = _preloaded(lm, ids)
    got = lm.model.prefill(ids, cache, sched)
    assert [s[1] for s in sched.seen] == [N, N, 1, 1]
    assert all(s[2] for s in sched.seen)
    assert got.num_computed_token_layers == 2 * N + 2


def test_dropping_tokens_without_cached_kv_is_an_error(lm, ids):
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    with pytest.raises(ScheduleError, match="position 0 without K/V at layer 2"):
        lm.model.prefill(ids, cache, _DropAfter(layer=1))


def test_dropping_the_last_token_is_refused(lm, ids):
    cache = _preloaded(lm, ids)
    with pytest.raises(ScheduleError, match="last prompt token"):
        lm.model.prefill(ids, cache, _DropAfter(layer=1, keep_last=False))


def test_attention_probs_of_a_query_row(lm, ids):
    sched = _DropAfter(layer=99, probe=0)
    lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), sched)
    probs = sched.probs  # [H, 1, N]
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]), atol=1e-5, rtol=0)
    # last row sees every key: plain softmax(q k^T / sqrt(d)) with GQA groups
    group = sched.q.shape[0] // sched.k.shape[0]
    keys = sched.k.repeat_interleave(group, 0)
    manual = (sched.q[:, -1:] @ keys.transpose(1, 2) / sched.q.shape[-1] ** 0.5).softmax(-1)
    torch.testing.assert_close(probs, manual, atol=1e-6, rtol=0)


class _ExitAt(Schedule):
    has_exit_test = True

    def __init__(self, layer):
        self.layer = layer

    def exit_after(self, layer, last_hidden):
        return layer == self.layer


def test_exit_test_stops_early_and_reads_intermediate_logits(lm, ids):
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    got = lm.model.prefill(ids, cache, _ExitAt(1))
    ref, _ = _full(lm, ids, capture=(2,))
    assert got.exit_layer == 1
    assert got.num_computed_token_layers == 2 * N
    expected = lm.model.logits_from_hidden(ref.captured[2][1][-1])  # output of layer 1 = input of 2
    torch.testing.assert_close(got.logits, expected, atol=1e-5, rtol=0)


def test_rows_of_finds_the_kept_rows_and_checks_a_given_count_on_cpu():
    mask = torch.tensor([False, True, True, False, True])
    assert rows_of(mask).tolist() == [1, 2, 4]
    assert rows_of(mask, 3).tolist() == [1, 2, 4]
    assert rows_of(torch.zeros(4, dtype=torch.bool), 0).tolist() == []
    for wrong in (2, 4):  # unchecked, a short count would cut rows and a long one pad them with -1
        with pytest.raises(ScheduleError, match=f"counted {wrong} kept rows where its mask keeps 3"):
            rows_of(mask, wrong)


def test_a_schedule_returning_a_keep_mask_is_refused(lm, ids):
    class _Mask(_DropAfter):
        def after_layer(self, view):
            return torch.ones(view.active_idx.numel(), dtype=torch.bool)  # as long as the rows: would pass unseen

    with pytest.raises(ScheduleError, match="returned a keep mask where the kept rows belong"):
        lm.model.prefill(ids, _preloaded(lm, ids), _Mask(layer=1))
