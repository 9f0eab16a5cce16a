import pytest
import torch

from kvrelay.eval.fidelity import first_token_agrees, greedy_match, kl_first_token
from kvrelay.eval.stats import median, median_ratio


def test_speedup_is_the_median_of_per_call_ratios():
    full, method = [100.0, 10.0, 50.0], [10.0, 10.0, 25.0]
    assert median_ratio(full, method) == 2.0  # ratios 10, 1, 2 -> 2 (the ratio of medians would be 5)
    assert median(full) / median(method) == 5.0
    with pytest.raises(ValueError, match="pairs"):
        median_ratio([1.0], [1.0, 2.0])


def test_fidelity_metrics():
    p = torch.tensor([2.0, 1.0, 0.0])
    assert kl_first_token(p, p) == 0.0
    q = torch.tensor([0.0, 1.0, 2.0])
    expected = (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum().item()
    assert kl_first_token(p, q) == pytest.approx(expected)
    assert first_token_agrees(p, p) and not first_token_agrees(p, q)
    assert greedy_match([1, 2, 3], [1, 2, 3, 4], num_tokens=3)
    assert not greedy_match([1, 2], [1, 2, 3], num_tokens=3)
