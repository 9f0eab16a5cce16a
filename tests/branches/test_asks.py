"""RKSC's approximate ASKS: a verification reusing its branch's output K/V behind a hidden-state gate."""

import pytest
import torch

from kvrelay.branches.asks import BranchSpan, copy_span, layer_cosine, verify_with_branch_span
from kvrelay.branches.prompts import BranchConfig, BranchPrompts
from kvrelay.branches.rksc import RKSCMethod
from kvrelay.branches.runner import BranchRunner
from kvrelay.branches.shared_kv import SharedPrefixKV
from kvrelay.cache.kv import SequenceKV
from tests.helpers import tiny_lm

QUESTION = "Tom has 3 apples and buys 4 more. How many?"


@pytest.fixture(scope="module")
def lm():
    lm = tiny_lm("llama3", yes_no=True)
    lm.model.double()
    return lm


def _prefill(lm, ids, cache, schedule=None):
    return lm.model.prefill(torch.tensor(ids), cache, schedule)


def _root(lm, root_ids):
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(root_ids))
    _prefill(lm, root_ids, cache)
    return cache


def _branch(lm, method, root_cache, root_ids, branch_ids, output_ids):
    """A branch's cache (its prompt + output K/V, root shared) and the hidden state entering the output."""
    cache = SharedPrefixKV(root_cache, len(root_ids), capacity=len(branch_ids) + len(output_ids))
    probe = method.schedule(len(root_ids), lm, record_hidden=True)
    _prefill(lm, branch_ids, cache, probe)
    hidden = torch.stack(probe.hidden)  # [L, hidden]
    _prefill(lm, branch_ids + output_ids, cache, method.schedule(len(branch_ids), lm))  # the output's K/V
    return BranchSpan(cache, len(branch_ids), len(output_ids), hidden)


def test_layer_cosine_and_copy_span_roundtrip(lm):
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert layer_cosine(a, a) == pytest.approx(1.0)
    assert layer_cosine(a, torch.tensor([[0.0, 1.0], [0.0, -1.0]])) == pytest.approx(-0.5)
    ids = list(range(40, 60))
    src = _root(lm, ids)
    mid = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=64)
    back = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=64)
    copy_span(src, 5, mid, 30, 10, lm.model.rope)  # moved by +25 ...
    copy_span(mid, 30, back, 5, 10, lm.model.rope)  # ... and back
    for layer in range(lm.config.num_layers):
        k0, v0 = src.kv(layer, 5, 15)
        k1, v1 = back.kv(layer, 5, 15)
        assert torch.allclose(k0, k1, atol=1e-10) and torch.equal(v0, v1)
        km, _ = mid.kv(layer, 30, 40)
        assert not torch.allclose(km, k0)  # the keys really were rotated


def test_the_verifier_prefix_chunk_never_exits(lm):
    method = RKSCMethod(exit_theta=5.0, exit_min_layer=1)
    method.exiting = True
    first, final = method.schedule(3, lm, record_hidden=True, final=False), method.schedule(3, lm)
    assert not first.exit_enabled and not first.has_layer_hook and first.has_exit_test  # records only
    assert not first.exit_after(2, torch.zeros(lm.config.hidden_size, dtype=torch.float64))
    assert final.exit_enabled and final.has_layer_hook


def test_same_context_reuse_is_exact_and_a_closed_gate_equals_full(lm):
    method = RKSCMethod(exit_theta=0.0, probe_attention=False)
    root_ids, prefix_ids = list(range(60, 80)), list(range(90, 97))
    output_ids, question_ids = list(range(100, 112)), list(range(120, 126))
    root = _root(lm, root_ids)
    branch = _branch(lm, method, root, root_ids, root_ids + prefix_ids, output_ids)
    ids = root_ids + prefix_ids + output_ids + question_ids
    full_logits = _prefill(lm, ids, SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(ids))).logits
    span_start = len(root_ids) + len(prefix_ids)

    def make(start, first):
        return method.schedule(start, lm, record_hidden=first, final=not first)

    # the same prefix before the output: the gate sees cosine 1, the K/V is the one full computes
    same = verify_with_branch_span(lm, root, len(root_ids), ids, span_start, branch, 0.99, make)
    assert same.cosine == pytest.approx(1.0, abs=1e-12) and same.num_reused_tokens == len(output_ids)
    assert same.computed_tokens == len(prefix_ids) + len(question_ids)
    assert torch.allclose(same.logits, full_logits, atol=1e-10)
    # a different prefix, shorter: the keys move; gate closed (tau above any cosine) -> exactly full
    other_ids = root_ids + prefix_ids[:3] + output_ids + question_ids
    other_full = _prefill(lm, other_ids, SequenceKV(lm.config, lm.model.dtype, lm.model.device,
                                                    capacity=len(other_ids))).logits
    closed = verify_with_branch_span(lm, root, len(root_ids), other_ids, len(root_ids) + 3, branch, 1.01, make)
    assert closed.num_reused_tokens == 0 and closed.cosine < 1.0
    assert closed.computed_tokens == 3 + len(output_ids) + len(question_ids)
    assert torch.allclose(closed.logits, other_full, atol=1e-10)
    # gate open on the different prefix: approximate (not full's logits), fewer tokens computed
    opened = verify_with_branch_span(lm, root, len(root_ids), other_ids, len(root_ids) + 3, branch, -1.0, make)
    assert opened.num_reused_tokens == len(output_ids) and opened.cosine == pytest.approx(closed.cosine)
    assert opened.computed_tokens == 3 + len(question_ids)
    assert not torch.allclose(opened.logits, other_full, atol=1e-6)
    with pytest.raises(ValueError, match="must start after the shared root"):
        verify_with_branch_span(lm, root, len(root_ids), ids, len(root_ids), branch, 0.5, make)


def test_branch_runner_asks_counts_and_keeps_approximate_kv_out_of_the_block_cache(lm):
    cfg = BranchConfig(num_branches=3, branch_tokens=6)
    exact = RKSCMethod(skip_top=1.0, skip_gap=1.0, exit_theta=0.0)
    base = BranchRunner(lm, cfg, exact).run(QUESTION, "rksc")
    always = RKSCMethod(skip_top=1.0, skip_gap=1.0, exit_theta=0.0, asks_approx=True, asks_tau=-1.0)
    runner = BranchRunner(lm, cfg, always)
    run = runner.run(QUESTION, "rksc")
    assert run.output_ids == base.output_ids  # branches are exact; only the verifications approximate
    prompts = BranchPrompts.build(lm.tokenizer, QUESTION, cfg)
    # a branch stopped by length never fed its last token, so that one has no K/V to reuse
    assert run.asks_reused_tokens == [len(o) - (len(o) == cfg.branch_tokens) for o in base.output_ids]
    assert len(run.asks_cosines) == 3 and all(-1 <= c <= 1 for c in run.asks_cosines)
    assert run.num_computed_tokens == base.num_computed_tokens - sum(run.asks_reused_tokens)
    assert run.ref_scores == pytest.approx(base.scores, abs=1e-9)  # the reference never reuses
    # no block of the verifier prompts past the branch output's start was inserted
    for o in base.output_ids:
        ids, span_start = prompts.verifier_prompt(o)
        keys = runner.blocks.keys(ids)
        assert keys[span_start // runner.blocks.block_len:]  # there are blocks past the output's start ...
        assert all(k not in runner.blocks.blocks for k in keys[span_start // runner.blocks.block_len:])  # ... none kept
    closed = BranchRunner(lm, cfg, RKSCMethod(skip_top=1.0, skip_gap=1.0, exit_theta=0.0, asks_approx=True,
                                              asks_tau=1.0)).run(QUESTION, "rksc")
    assert closed.asks_reused_tokens == [0, 0, 0] and max(closed.asks_cosines) < 1.0
    assert closed.scores == pytest.approx(base.scores, abs=1e-9)
