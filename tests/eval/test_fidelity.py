"""Fidelity measures on hand-made logits."""

import math

import pytest
import torch

from kvrelay.eval.fidelity import first_token_agrees, first_token_margin, greedy_match, kl_first_token


def test_first_token_margin_is_top1_minus_top2_probability():
    logits = torch.log(torch.tensor([0.127, 0.117, 0.756]))
    assert first_token_margin(logits) == pytest.approx(0.756 - 0.127)
    assert first_token_margin(torch.zeros(4)) == pytest.approx(0.0)  # an exact tie
    assert first_token_margin(torch.zeros(1)) == 1.0


def test_kl_agreement_and_greedy_match():
    p = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    q = torch.log(torch.tensor([0.25, 0.5, 0.25]))
    assert kl_first_token(p, p) == pytest.approx(0.0, abs=1e-7)
    assert kl_first_token(p, q) == pytest.approx(0.5 * math.log(2) - 0.25 * math.log(2))
    assert first_token_agrees(p, p) and not first_token_agrees(p, q)
    assert greedy_match([1, 2, 3], [1, 2, 4], 2) and not greedy_match([1, 2, 3], [1, 2, 4], 3)
    assert not greedy_match([1, 2], [1, 2, 3], 3)  # a shorter output must match as a whole
