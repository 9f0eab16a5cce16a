"""Running estimates and their bounds."""

from __future__ import annotations

import math
import random

import pytest

from kvrelay.quality import RungEstimate, wilson_bounds
from kvrelay.quality.betting import betting_bounds
from kvrelay.quality.estimate import z_for


def test_wilson_matches_the_textbook_values():
    # 95% two-sided (z = 1.96): 0 of 10 -> [0, 0.2775]; 8 of 10 -> [0.4902, 0.9433] (Wilson 1927; Newcombe 1998)
    z = z_for(0.975)
    low, high = wilson_bounds(0.0, 10, z)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_bounds(0.8, 10, z)
    assert (low, high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    assert wilson_bounds(0.5, 0, z) == (0.0, 1.0)


def test_the_kl_bound_is_the_betting_bound_of_the_clipped_window_in_nats():
    est = RungEstimate(window=4, kl_cap=0.25, confidence=0.9)
    kls = [0.01, 0.3, 0.02, 0.0, 0.05]  # the first leaves the window; 0.3 counts as the cap
    for kl in kls:
        est.add(kl, True)
    lower, upper = betting_bounds([min(kl, 0.25) / 0.25 for kl in kls[1:]], 0.9)
    assert est.kl_bounds() == (pytest.approx(lower * 0.25), pytest.approx(upper * 0.25))
    assert est.kl_mean() == pytest.approx(sum(kls[1:]) / 4)


@pytest.mark.parametrize("broken", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_kl_counts_as_the_cap(broken):
    """max(nan, 0.0) is nan: stored as is, it made the betting bound raise; a broken comparison is the worst value."""
    est = RungEstimate(window=8, kl_cap=0.25, confidence=0.9)
    est.add(0.01, True, 0.02)
    est.add(broken, float("nan"), broken)
    capped = RungEstimate(window=8, kl_cap=0.25, confidence=0.9)
    capped.add(0.01, True, 0.02)
    capped.add(0.25, False, 0.25)
    assert est.kl_bounds() == capped.kl_bounds() and est.kl_bounds(continuation=True) == capped.kl_bounds(True)
    assert est.kl_mean() == pytest.approx(0.13) and est.agreement_mean() == 0.5
    assert est.to_dict() == capped.to_dict()


def test_zero_kl_is_bounded_above_the_floor_of_any_valid_bound():
    """n calls at zero KL: the upper bound is at least cap x (1 - delta^(1/n)) (the law "zero, or a spike to the cap
    with probability p" shows n zeros with probability (1 - p)^n), and it falls as the calls add up."""
    uppers = []
    for num in (10, 20, 32):
        est = RungEstimate(window=32, kl_cap=0.25, confidence=0.9)
        for _ in range(num):
            est.add(0.0, True)
        uppers.append(est.kl_bounds()[1])
        assert uppers[-1] >= 0.25 * (1 - 0.1 ** (1 / num))
        assert est.kl_mean() == 0.0
    assert uppers == sorted(uppers, reverse=True)


def test_a_spike_counts_at_most_the_cap_and_the_window_forgets():
    est = RungEstimate(window=4, kl_cap=0.25, confidence=0.9)
    est.add(50.0, False)
    capped = RungEstimate(window=4, kl_cap=0.25, confidence=0.9)
    capped.add(0.25, False)
    assert est.kl_bounds() == capped.kl_bounds()
    assert est.kl_mean() == 50.0  # the reported mean is the real one
    for _ in range(4):
        est.add(0.0, True)
    assert est.num_samples == 4 and est.num_total == 5 and est.kl_mean() == 0.0 and est.agreement_mean() == 1.0


@pytest.mark.parametrize("draw", ["lognormal", "spiky"])
def test_the_kl_bound_covers_the_clipped_mean_of_heavy_tailed_data(draw):
    """90% one-sided: over many windows of 20 calls from a heavy-tailed KL, the upper bound is at or above the
    true (clipped) mean in at least ~90% of them. A bound that trusted the sample variance would not: most windows
    of the spiky law hold no spike at all."""
    cap = 0.25

    def sample(rng: random.Random) -> float:
        if draw == "lognormal":
            return rng.lognormvariate(math.log(0.01), 1.5)
        return 1.0 if rng.random() < 0.05 else 0.002  # a spike on 1 call in 20

    rng = random.Random(11)
    truth = sum(min(sample(rng), cap) for _ in range(50_000)) / 50_000
    num_windows, covered = 1000, 0
    for _ in range(num_windows):
        est = RungEstimate(window=20, kl_cap=cap, confidence=0.9)
        for _ in range(20):
            est.add(sample(rng), True)
        covered += est.kl_bounds()[1] >= truth
    assert covered / num_windows >= 0.88


@pytest.mark.parametrize("num_samples", [16, 32])
def test_the_agreement_upper_bound_covers(num_samples):
    """The bound the guard breaks a rung on (agreement's upper bound under the target) is wrong on at most ~10% of
    windows of a rung exactly at the target. (Wilson's lower bound, which the guard does not act on, under-covers
    near 0.9 at these sizes: the binomial's discreteness.)"""
    rng = random.Random(5)
    covered = 0
    for _ in range(1000):
        est = RungEstimate(window=32, kl_cap=0.25, confidence=0.9)
        for _ in range(num_samples):
            est.add(0.0, rng.random() < 0.9)
        covered += est.agreement_bounds()[1] >= 0.9
    assert covered / 1000 >= 0.88


def test_to_dict_is_json_ready():
    est = RungEstimate(window=8, kl_cap=0.25, confidence=0.9)
    assert est.to_dict()["first_token_kl"]["mean"] is None
    est.add(0.01, True, 0.02)
    d = est.to_dict()
    assert d["continuation_kl"]["num_samples"] == 1 and d["top1_agreement"]["mean"] == 1.0
