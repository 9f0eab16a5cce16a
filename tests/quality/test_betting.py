"""Betting bounds on a mean in [0, 1]: coverage on synthetic streams over many seeds, the use of the variance,
and the floor no valid bound can go under."""

from __future__ import annotations

import math
import random

import pytest

from kvrelay.quality.betting import betting_bounds, predictable_bets, upper_bound_floor
from kvrelay.quality.estimate import wilson_bounds, z_for

CONFIDENCE = 0.9
DELTA = 1 - CONFIDENCE


def allowed_misses(num_windows: int) -> float:
    """Misses a bound at one-sided CONFIDENCE may show over ``num_windows`` independent windows: delta, plus three
    binomial standard errors of the count (a valid bound fails this about once in a thousand runs)."""
    return DELTA + 3 * math.sqrt(DELTA * (1 - DELTA) / num_windows)


# laws of the clipped KL (already divided by the cap, so in [0, 1]), each with its exact mean
def rare_spike(rng: random.Random) -> float:  # zero, or the cap on 11% of calls: the law that breaks Wilson at n=16
    return 1.0 if rng.random() < 0.11 else 0.0


def near_constant(rng: random.Random) -> float:  # 0.12 +- 0.02: a repair that barely varies
    return 0.12 + rng.uniform(-0.02, 0.02)


def skewed(rng: random.Random) -> float:  # exponential around 0.1, clipped at 1: most calls small, a long tail
    return min(rng.expovariate(10.0), 1.0)


def spiky(rng: random.Random) -> float:  # 0.008 on most calls, the cap on 1 in 20
    return 1.0 if rng.random() < 0.05 else 0.008


LAWS = {"rare_spike": (rare_spike, 0.11), "near_constant": (near_constant, 0.12),
        "skewed": (skewed, 0.1 * (1 - math.exp(-10.0))), "spiky": (spiky, 0.05 + 0.95 * 0.008)}


@pytest.mark.parametrize("law", sorted(LAWS))
@pytest.mark.parametrize("num_samples", [16, 32])
def test_both_bounds_cover_the_true_mean(law, num_samples):
    """Over 600 seeded windows, the true mean is above the upper bound (and, separately, under the lower bound) no
    more often than the confidence allows."""
    draw, truth = LAWS[law]
    num_windows, over_upper, under_lower = 600, 0, 0
    for seed in range(num_windows):
        rng = random.Random(f"{law}/{num_samples}/{seed}")
        lower, upper = betting_bounds([draw(rng) for _ in range(num_samples)], CONFIDENCE)
        over_upper += truth > upper
        under_lower += truth < lower
    assert over_upper / num_windows <= allowed_misses(num_windows)
    assert under_lower / num_windows <= allowed_misses(num_windows)


def test_wilson_on_the_clipped_mean_under_covers_rare_spikes():
    """Why the KL bound is not Wilson's: on the rare-spike law at 16 samples, a window without a spike (most of
    them: 0.89^16 = 0.155) gets a Wilson upper bound of z^2/(16 + z^2) = 0.093, under the true 0.11."""
    draw, truth = LAWS["rare_spike"]
    z = z_for(CONFIDENCE)
    num_windows, misses = 1000, 0
    for seed in range(num_windows):
        rng = random.Random(f"wilson/{seed}")
        values = [draw(rng) for _ in range(16)]
        misses += truth > wilson_bounds(sum(values) / 16, 16, z)[1]
    assert misses / num_windows > allowed_misses(num_windows)


@pytest.mark.parametrize("num_samples", [8, 16, 32])
def test_zeros_stay_above_the_floor_of_any_valid_bound(num_samples):
    """n values at 0 are what the law "0, or 1 with probability p" shows with probability (1 - p)^n: a bound valid
    for every law must stay >= 1 - delta^(1/n) there. This one does, and not by much."""
    floor = 1 - DELTA ** (1 / num_samples)
    lower, upper = betting_bounds([0.0] * num_samples, CONFIDENCE)
    assert lower == 0.0 and floor <= upper <= 1.5 * floor


@pytest.mark.parametrize("mean", [0.0, 0.02, 0.1, 0.19])
@pytest.mark.parametrize("num_samples", [16, 32])
def test_constant_values_stay_above_the_floor_at_their_mean(mean, num_samples):
    """The floor at any mean a: n values at a are what "a, or 1 with probability p" shows with probability
    (1 - p)^n, so a valid bound stays >= a + (1 - a)(1 - delta^(1/n)) (``upper_bound_floor``), which the guard reads
    to know whether a window can still certify a rung."""
    floor = upper_bound_floor(mean, num_samples, CONFIDENCE)
    assert floor == pytest.approx(mean + (1 - mean) * (1 - DELTA ** (1 / num_samples)))
    upper = betting_bounds([mean] * num_samples, CONFIDENCE)[1]
    assert floor <= upper <= floor + 0.25 * (floor - mean)


@pytest.mark.parametrize("level", [0.08, 0.12, 0.2, 0.4])
def test_the_variance_is_used(level):
    """At the same mean, a window of constant values is bounded tighter than one spread over two values, and
    tighter than Wilson's interval (which assumes the largest variance a [0, 1] variable with that mean can have)."""
    num = 32
    constant = [level] * num
    spread = [level * 0.25, level * 1.75] * (num // 2)
    low_c, up_c = betting_bounds(constant, CONFIDENCE)
    low_s, up_s = betting_bounds(spread, CONFIDENCE)
    assert up_c < up_s and low_c > low_s
    wilson_low, wilson_up = wilson_bounds(level, num, z_for(CONFIDENCE))
    assert up_c < wilson_up and low_c > wilson_low
    assert low_c <= level <= up_c


def test_a_bet_never_sees_the_value_it_is_on():
    values = [0.1, 0.3, 0.0, 0.9, 0.2, 0.05]
    bets = predictable_bets(values, CONFIDENCE)
    for i in range(len(values)):
        changed = values[:i] + [1.0 - values[i]] + values[i + 1:]
        assert predictable_bets(changed, CONFIDENCE)[:i + 1] == bets[:i + 1]


def test_edges_and_bad_values():
    assert betting_bounds([], CONFIDENCE) == (0.0, 1.0)
    lower, upper = betting_bounds([1.0] * 20, CONFIDENCE)
    assert upper == 1.0 and 1 - (1 - DELTA ** (1 / 20)) * 1.5 <= lower < 1.0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        betting_bounds([0.2, 1.5], CONFIDENCE)
