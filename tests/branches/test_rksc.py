"""RKSC: layer exit rule, verifier skip, the verifier's read position, and the branch runner."""

import math

import pytest
import torch

from kvrelay.branches.prompts import BranchConfig, BranchPrompts, answer_ids
from kvrelay.branches.rksc import RKSCMethod, decisive, entropy, exit_min_layer, pick, yes_score
from kvrelay.branches.runner import BranchRunner, pad, verify
from kvrelay.errors import ConfigError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from tests.helpers import generate, tiny_lm

QUESTION = "Tom has 3 apples and buys 4 more. How many?"


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama3", yes_no=True)


def test_layer_exit_is_off_by_default(lm):
    method = RKSCMethod()
    method.exit_eps_nats, method.exit_from_layer = 1e9, 1  # everything else would let it exit
    method.exiting = True
    out = generate(lm, list(range(40, 70)), method, sampling=SamplingConfig(max_new_tokens=1))
    assert out.stats.exit_layer is None and not method.last_schedule.has_exit_test


def test_entropy_matches_a_hand_computation():
    vocab = 300
    assert entropy(torch.zeros(vocab)) == pytest.approx(math.log(vocab), abs=1e-5)  # uniform: log V nats
    assert entropy(torch.full((vocab,), 3.0)) == pytest.approx(math.log(vocab), abs=1e-5)  # shift-invariant
    one_hot = torch.full((vocab,), -1e4)
    one_hot[7] = 0.0
    assert entropy(one_hot) == pytest.approx(0.0, abs=1e-6)
    quarters = torch.full((vocab,), -1e4)
    quarters[[2, 5, 11]] = torch.tensor([0.5, 0.25, 0.25]).log()  # H = -(.5 ln .5 + 2 x .25 ln .25) = 1.5 ln 2
    assert entropy(quarters) == pytest.approx(1.5 * math.log(2), abs=1e-5)
    assert entropy(quarters.double()) == pytest.approx(1.5 * math.log(2), abs=1e-5)


def test_layer_exit_fires_at_the_first_allowed_layer_when_the_rule_holds(lm):
    method = RKSCMethod(exit_entropy_nats=1e9)
    method.exit_eps_nats, method.exit_from_layer = 1e9, 1
    method.exiting = True
    prompt = list(range(40, 70))
    out = generate(lm, prompt, method, sampling=SamplingConfig(max_new_tokens=1))
    assert out.stats.exit_layer == 2  # layer 1 has no previous entropy to compare with
    assert set(method.last_schedule.entropies) == {1, 2}
    # the exit's logits are the final norm + LM head on the last token after that layer
    full = generate(lm, prompt, "full", sampling=SamplingConfig(max_new_tokens=1))
    assert not torch.allclose(out.first_logits, full.first_logits)
    method.exiting = False  # branches (not verifying) never exit
    assert generate(lm, prompt, method, sampling=SamplingConfig(max_new_tokens=1)).stats.exit_layer is None


def test_layer_exit_is_tested_in_the_last_sixth_of_the_layers(lm):
    """The first tested layer follows the model's depth: 25 of SmolLM2's 30 (the calibrated one), 15 of Gemma 3's
    18, and two layers before the end of a shallow model; on the 4-layer tiny model the rule can first hold at 3."""
    assert [exit_min_layer(n) for n in (30, 18, 12, 4, 2)] == [25, 15, 10, 2, 1]
    method = RKSCMethod(exit_entropy_nats=1e9)
    method.exit_eps_nats = 1e9
    method.exiting = True
    out = generate(lm, list(range(40, 70)), method, sampling=SamplingConfig(max_new_tokens=1))
    assert lm.config.num_layers == 4 and out.stats.exit_layer == 3
    assert set(method.last_schedule.entropies) == {2, 3}


def test_verifier_skip_rule_and_pick():
    assert decisive([0.72, 0.60, 0.65], 0.70, 0.06)
    assert not decisive([0.71, 0.66, 0.1], 0.70, 0.06)  # gap 0.05
    assert not decisive([0.69, 0.1], 0.70, 0.06)  # top too low
    assert decisive([0.9], 0.70, 0.06)
    assert pick(None, [0.2, 0.9, 0.5]) == 1
    assert pick([0.9, 0.5, 0.5], [0.25, 1.0, 0.81]) == 1  # 0.45, 0.50, 0.45
    assert pick([0.9, 0.5, 0.7], [0.25, 1.0, 0.81]) == 2  # 0.45, 0.50, 0.63


def test_yes_score_reads_the_two_answers(lm):
    yes_id, no_id = answer_ids(lm.tokenizer)
    logits = torch.full((lm.config.vocab_size,), -5.0)
    logits[yes_id], logits[no_id] = 2.0, 2.0 - torch.log(torch.tensor(3.0))
    assert yes_score(logits, yes_id, no_id) == pytest.approx(0.75)


def test_verifier_reads_yes_at_the_last_real_token_whatever_the_padding(lm):
    rows = [list(range(30, 30 + n)) for n in (9, 14, 11)]
    alone = [verify(lm, *pad([r], 0), "full")[0].score for r in rows]
    for pad_id in (0, 7, 255):
        for extra in (0, 5):
            ids, lengths = pad(rows, pad_id)
            ids = torch.cat([ids, torch.full((3, extra), pad_id)], dim=1)
            scores = [r.score for r in verify(lm, ids, lengths, "full")]
            assert scores == pytest.approx(alone, abs=1e-6)
    # reading the padded row's end instead (the public code's bug) gives other numbers
    ids, lengths = pad(rows, 7)
    wrong = [r.score for r in verify(lm, ids, [ids.shape[1]] * 3, "full")]
    assert wrong[0] != pytest.approx(alone[0], abs=1e-4)
    with pytest.raises(ConfigError, match="length"):
        verify(lm, ids, [0, 3, 3], "full")


def test_branch_runner_rksc_shares_the_root_and_matches_full(lm):
    cfg = BranchConfig(num_branches=3, branch_tokens=6)
    method = RKSCMethod(skip_top=1.0, skip_gap=1.0, block_budget_mb=64)  # always verify (no exit by default)
    runner = BranchRunner(lm, cfg, method)
    full, prefix, rksc = (runner.run(QUESTION, m) for m in ("full", "prefix", "rksc"))
    assert rksc.output_ids == full.output_ids == prefix.output_ids
    assert rksc.scores == pytest.approx(full.scores, abs=1e-5)
    assert rksc.ref_scores == pytest.approx(full.scores, abs=1e-5)
    assert rksc.pick == full.pick == rksc.ref_pick
    prompts = BranchPrompts.build(lm.tokenizer, QUESTION, cfg)
    root_len = len(prompts.root_ids)
    assert all(ids[:root_len] == prompts.root_ids for ids in prompts.branch_ids)
    # full computes the root in all six prompts; rksc once for the branches and, for the verifier,
    # only what the block cache misses of it (its full 16-token blocks are held)
    assert full.num_computed_tokens == full.num_prompt_tokens
    verifier_root = root_len - min(16 * (root_len // 16), root_len - 1)
    assert rksc.num_computed_tokens == full.num_prompt_tokens - 6 * root_len + root_len + verifier_root
    # memory: B branch caches with one shared root vs one full copy each
    assert rksc.branch_kv_bytes <= 1.2 * rksc.root_plus_own_bytes
    row = 2 * 4 * 2 * 16 * 4  # K and V: layers x kv heads x head_dim x fp32
    slots = [len(ids) + cfg.branch_tokens + 1 for ids in prompts.branch_ids]  # each cache's capacity
    assert full.branch_kv_bytes == sum(slots) * row  # a root copy in every branch
    # the root once, plus each branch's own rows (batched decode reads every row's own cache: no padding)
    assert rksc.branch_kv_bytes == (root_len + sum(n - root_len for n in slots)) * row
    one_by_one = BranchRunner(lm, cfg, RKSCMethod(skip_top=1.0, skip_gap=1.0, batch_decode=False))
    unbatched = one_by_one.run(QUESTION, "rksc")
    assert unbatched.output_ids == rksc.output_ids and unbatched.scores == pytest.approx(rksc.scores, abs=1e-6)
    assert unbatched.branch_kv_bytes == (root_len + sum(n - root_len for n in slots)) * row  # own rows, no padding
    # the second problem finds the system-prompt blocks in the block cache
    again = runner.run("A different question about 5 pears?", "rksc")
    assert again.block_hits >= 1 and runner.blocks.stats.num_hit_blocks >= 1
    # a finished problem holds no pins (pinned at lookup/insert, unpinned exactly)
    assert all(block.pins == 0 for block in runner.blocks.blocks.values())
    assert any(e[0] == "lookup" and e[2] for e in runner.blocks.events)


def test_rksc_parameters_are_validated():
    with pytest.raises(ConfigError, match="exit_entropy_nats must be >= 0"):
        get_method("rksc[exit_entropy_nats=-1]")
    with pytest.raises(ConfigError, match="skip_gap must be in"):
        get_method("rksc[skip_gap=1.5]")
    with pytest.raises(ConfigError, match="block_budget_mb must be positive"):
        get_method("rksc[block_budget_mb=0]")
    # fixed internals and what left the method are unknown settings
    for setting in ("policy=lru", "block_len=8", "exit_eps_nats=1", "probe_attention=false", "asks_approx=true"):
        with pytest.raises(ConfigError, match=f"unknown parameter '{setting.split('=')[0]}'"):
            get_method(f"rksc[{setting}]")


def test_few_shot_system_prompt_is_a_prefix_problems_share(lm):
    from kvrelay.branches.prompts import SYSTEM, few_shot_system
    from kvrelay.data.datasets import GSM8KProblem

    assert few_shot_system([]) == SYSTEM
    shots = [GSM8KProblem("Ann has 2 pens and buys 3. How many?", "5", "Ann has 2+3 = 5 pens."),
             GSM8KProblem("A box holds 4 eggs. How many in 3 boxes?", "12", "3 boxes hold 3*4 = 12 eggs.")]
    system = few_shot_system(shots)
    assert system.startswith(SYSTEM) and "Solution:\nAnn has 2+3 = 5 pens.\nAnswer: 5" in system
    cfg = BranchConfig(num_branches=2, branch_tokens=4)
    a = BranchPrompts.build(lm.tokenizer, QUESTION, cfg, system)
    b = BranchPrompts.build(lm.tokenizer, "Sue has 9 cards and gives away 2. How many are left?", cfg, system)
    plain = BranchPrompts.build(lm.tokenizer, QUESTION, cfg)
    shared = next(i for i, (x, y) in enumerate(zip(a.root_ids, b.root_ids, strict=False)) if x != y)
    assert shared > len(lm.tokenizer.encode(system)) - 4  # the whole examples block (chat framing aside)
    assert len(a.root_ids) > len(plain.root_ids) + shared // 2
    ids, out_start = a.verifier_prompt([5, 6, 7])  # raises if it does not start with the root
    assert ids[out_start : out_start + 3] == [5, 6, 7]


def test_gsm8k_solution_drops_calculator_annotations():
    from kvrelay.data.datasets import load_gsm8k

    first = load_gsm8k(split="train", limit=1)[0]
    assert first.answer == "72" and "<<" not in first.solution and first.solution.endswith("in April and May.")
