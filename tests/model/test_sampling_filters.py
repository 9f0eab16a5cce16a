"""min-p and top-k (vLLM's) in ``Sampler``: on a hand-made distribution, exactly the tokens vLLM keeps can be drawn,
in proportion to their renormalized probabilities; greedy ignores both; the config refuses vLLM's bad values."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.errors import ConfigError
from kvrelay.model.sampling import Sampler, SamplingConfig

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1
PROBS = [0.5, 0.25, 0.125, 0.0625, 0.0625]
LOGITS = torch.tensor([math.log(p) for p in PROBS])
NUM_DRAWS = 4000


def _frequencies(config: SamplingConfig) -> list[float]:
    sampler = Sampler(config)
    counts = torch.bincount(torch.tensor([sampler(LOGITS) for _ in range(NUM_DRAWS)]), minlength=len(PROBS))
    return (counts.float() / NUM_DRAWS).tolist()


@pytest.mark.parametrize(("fields", "kept"), [
    ({"top_k": 2}, [0, 1]),  # the two most likely
    ({"top_k": 4}, [0, 1, 2, 3, 4]),  # the 4th and 5th tie (0.0625): both stay, as vLLM's threshold keeps ties
    ({"min_p": 0.3}, [0, 1]),  # threshold 0.3 * 0.5 = 0.15: 0.125 and below go
    ({"min_p": 0.25}, [0, 1, 2]),  # threshold 0.125: 0.125 is not below it
    ({"min_p": 0.3, "top_k": 1}, [0]),
    ({"min_p": 0.2, "top_k": 2, "top_p": 0.6}, [0]),  # top-p over the renormalized 2/3, 1/3: 2/3 reaches 0.6
    ({"min_p": 0.2, "top_k": 3, "top_p": 0.6}, [0, 1]),  # 4/7 < 0.6: the second stays, the third (1/7) goes
])
def test_only_the_tokens_vllm_keeps_are_drawn_in_their_renormalized_proportions(fields, kept):
    frequencies = _frequencies(SamplingConfig(temperature=1.0, seed=7, **fields))
    total = sum(PROBS[i] for i in kept)
    for token_id, frequency in enumerate(frequencies):
        expected = PROBS[token_id] / total if token_id in kept else 0.0
        # 4000 draws: a standard deviation of at most 0.008; 0.04 is 5 of them
        assert frequency == pytest.approx(expected, abs=0.04), (token_id, frequencies)


def test_min_p_applies_to_the_tempered_distribution():
    # at temperature 0.5 the probabilities are 16/21 (0.76), 4/21, 1/21, ...: min_p 0.2 keeps 0 and 1 only
    frequencies = _frequencies(SamplingConfig(temperature=0.5, seed=3, min_p=0.2))
    assert frequencies[2] == frequencies[3] == frequencies[4] == 0.0
    assert frequencies[1] == pytest.approx(0.2, abs=0.04)


@pytest.mark.parametrize("off", [{"top_k": 0}, {"top_k": -1}, {"top_k": len(PROBS)}, {"min_p": 0.0}])
def test_off_values_draw_exactly_what_plain_sampling_draws(off):
    plain, filtered = Sampler(SamplingConfig(temperature=1.0, seed=5)), Sampler(SamplingConfig(temperature=1.0,
                                                                                                 seed=5, **off))
    assert [plain(LOGITS) for _ in range(200)] == [filtered(LOGITS) for _ in range(200)]


def test_greedy_ignores_top_k_and_min_p():
    assert Sampler(SamplingConfig(temperature=0.0, top_k=3, min_p=0.9))(LOGITS) == 0


@pytest.mark.parametrize("fields", [{"top_k": -2}, {"top_k": 1.5}, {"top_k": True}, {"min_p": -0.1},
                                    {"min_p": 1.01}, {"min_p": float("nan")}])
def test_values_vllm_refuses_are_config_errors(fields):
    with pytest.raises(ConfigError, match=next(iter(fields))):
        SamplingConfig(**fields)
