"""``PenalizedLogits``: OpenAI's formula on one call's logits, around the call's own constraint."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.constrained import TokenRefused, sample_masked
from kvrelay.engine.penalties import Penalties
from kvrelay.model.sampling import Sampler, SamplingConfig


class _Refuses:
    """A constraint that masks token 0 and refuses token ``refused`` when taken."""

    def __init__(self, refused: int) -> None:
        self.refused, self.taken = refused, []

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[0] = float("-inf")
        return out

    def advance(self, token_id: int) -> None:
        if token_id == self.refused:
            raise TokenRefused(str(token_id))
        self.taken.append(token_id)


def test_bias_and_penalties_follow_openais_formula():
    mask = Penalties(((1, 2.0),), frequency_penalty=0.5, presence_penalty=0.25).new_mask()
    logits = torch.zeros(4)
    assert mask.apply(logits).tolist() == [0, 2, 0, 0]
    for token_id in (3, 3, 2):
        mask.advance(token_id)
    # token 3: twice (2 * 0.5 + 0.25), token 2: once (0.5 + 0.25)
    assert mask.apply(logits).tolist() == pytest.approx([0, 2, -0.75, -1.25])
    assert mask.logprob_logits(logits) is mask.unadjusted  # logprobs: before the bias


def test_the_constraints_mask_stays_and_a_refused_token_is_not_counted():
    inner = _Refuses(refused=2)
    mask = Penalties(((0, 100.0),), frequency_penalty=2.0).new_mask(inner)
    logits = torch.tensor([0.0, 0.0, 5.0, 1.0])
    sampler = Sampler(SamplingConfig(temperature=0.0))
    assert sample_masked(sampler, mask, logits) == 3  # 0 masked (-inf + 100), 2 refused: the next best
    assert inner.taken == [3] and mask.counts.tolist() == [0, 0, 0, 1]
    assert mask.apply(logits)[0] == float("-inf")


def test_zeros_are_inactive():
    assert not Penalties(((5, 0.0),), 0.0, 0.0).active
    assert Penalties((), 0.0, -0.1).active


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # vLLM's (CTRL's) rule on tokens seen in the prompt (1) or the output (3); 0 and 2 were never seen
    mask = Penalties(repetition_penalty=2.0).new_mask(prompt_ids=[1])
    logits = torch.tensor([4.0, 4.0, -3.0, -3.0])
    assert mask.apply(logits).tolist() == [4.0, 2.0, -3.0, -3.0]
    mask.advance(3)
    assert mask.apply(logits).tolist() == [4.0, 2.0, -3.0, -6.0]
    # below 1 it rewards repeats: 4 / 0.5 = 8, -3 * 0.5 = -1.5
    reward = Penalties(repetition_penalty=0.5).new_mask(prompt_ids=[1, 2])
    assert reward.apply(logits).tolist() == [4.0, 8.0, -1.5, -3.0]


def test_repetition_comes_after_the_bias_and_before_frequency_and_presence():
    # token 1: (1 + 3) / 2 - 1 * 0.5 - 0.25 = 1.25 (vLLM's order: bias, repetition, then OpenAI's penalties)
    mask = Penalties(((1, 3.0),), frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0).new_mask()
    logits = torch.tensor([0.0, 1.0, 0.0])
    mask.apply(logits)
    mask.advance(1)
    assert mask.apply(logits).tolist() == pytest.approx([0.0, 1.25, 0.0])


def test_min_tokens_holds_the_stop_ids_back_until_that_many_tokens():
    mask = Penalties(min_tokens=2, min_tokens_stop_ids=(0, 2)).new_mask()
    logits = torch.tensor([9.0, 1.0, 8.0])
    sampler = Sampler(SamplingConfig(temperature=0.0))
    taken = [sample_masked(sampler, mask, logits) for _ in range(3)]
    assert taken == [1, 1, 0]  # 0 and 2 at -inf for the first two tokens, then the greedy stop id again


@pytest.mark.parametrize("fields", [{"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
                                    {"repetition_penalty": float("nan")}, {"min_tokens": -1}])
def test_values_vllm_refuses_are_errors(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        Penalties(**fields)


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e-38, 1e39, 1e308])
def test_a_penalty_past_float32s_range_leaves_the_logits_finite_and_a_constraints_ban_in_place(penalty):
    # any float > 0 is a valid repetition_penalty; in float32 1e-300 is 0 (x / 0 = inf) and 1e308 is inf
    # (0 * inf = NaN): the sampler then failed the request ("non-finite logits"), a 500
    mask = Penalties(repetition_penalty=penalty).new_mask(prompt_ids=[0, 1, 2, 3])
    logits = torch.tensor([50.0, 0.0, -50.0, float("-inf"), 1.0])
    adjusted = mask.apply(logits)
    assert adjusted[3] == float("-inf")
    assert torch.isfinite(adjusted[:3]).all()
    expected = 0 if penalty < 1 else 4  # below 1 it rewards the seen token with the largest logit
    assert Sampler(SamplingConfig(temperature=0.0))(logits=adjusted) == expected
