"""Confidence bounds on the mean of values in [0, 1] by betting (Waudby-Smith & Ramdas, JRSS-B 2024, "Estimating
means of bounded random variables by betting": the predictable plug-in hedged capital, one side at a time).

For a candidate mean m, a gambler starts with capital 1 and, before seeing each value x_i, bets a share lambda_i on
"the mean is below m" (for the upper bound): the capital becomes K_n(m) = prod_i (1 - lambda_i (x_i - m)). If the
values' (conditional) mean is m, every factor has expectation 1, so K_n(m) is a nonnegative martingale started at
1 and, by Markov's inequality, reaches 1/delta with probability at most delta. The upper bound is the largest m the
gambler has not yet refuted (K_n(m) < 1/delta), so the true mean is above it with probability at most delta: valid
for any distribution on [0, 1], with no normal approximation, at any given sample size.

Valid **per check**: the bets are tuned for the window's size n (the fixed-n variant, not the time-uniform one), and
the guard checks a sliding window after every sample, so each check is wrong with probability at most delta but a
role's whole life, many checks, holds a wrong move with a higher chance. That is acceptable because no move is
final: the hold and the back-off, and the shadow samples that keep coming, re-check a rung after it moves.

The bet is where the sample variance comes in: lambda_i = sqrt(2 log(1/delta) / (n var_{i-1})), from the values
*before* x_i only (a bet may not peek at the value it is on), so a window of near-constant values bets big and
refutes every m a little above its mean, while a spread-out one bets small. It is truncated at c / (1 - m) (c / m
for the lower bound), so no factor drops below 1 - c: the gambler is never ruined. That truncation is also what
keeps a near-zero window honest: a spike to 1 that has not been seen yet is still possible, and no bound valid for
every law on [0, 1] can put the upper bound of n values at a below a + (1 - a)(1 - delta^(1/n)) (the law
"a, or 1 with probability p" shows n values at a with probability (1 - p)^n); betting c = 0.9 gets close to that.

Both truncated bets make every factor increasing in m (upper) or decreasing in m (lower), so the capital is
monotone in m and each bound is found by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: the largest bet, as a share of the most a factor can lose: every factor stays >= 1 - BET_CAP > 0
BET_CAP = 0.9
_BISECT_STEPS = 48  # 2^-48 of [0, 1]: far below any KL that matters


def predictable_bets(values: Sequence[float], confidence: float) -> list[float]:
    """lambda_i for each value, from the values before it (WSR's regularised running mean and variance: a prior
    of mean 1/2 and variance 1/4 worth one sample), tuned for a bound at ``len(values)`` samples."""
    num = len(values)
    log_inv_delta = math.log(1 / (1 - confidence))
    bets = []
    total, sq_dev, count = 0.5, 0.25, 1  # prior sample: mean 1/2, variance 1/4
    for x in values:
        variance = sq_dev / count
        bets.append(math.sqrt(2 * log_inv_delta / (num * variance)))
        total += x
        count += 1
        sq_dev += (x - total / count) ** 2
    return bets


def _log_capital(values: Sequence[float], bets: Sequence[float], m: float, upper: bool) -> float:
    """log K_n(m): betting that the mean is below m (``upper``) or above it."""
    log_k = 0.0
    if upper:
        cap = BET_CAP / (1 - m) if m < 1 else math.inf
        for x, bet in zip(values, bets, strict=True):
            log_k += math.log1p(-min(bet, cap) * (x - m))
    else:
        cap = BET_CAP / m if m > 0 else math.inf
        for x, bet in zip(values, bets, strict=True):
            log_k += math.log1p(min(bet, cap) * (x - m))
    return log_k


def betting_bounds(values: Sequence[float], confidence: float) -> tuple[float, float]:
    """(lower, upper) bounds of the mean of ``values`` (each in [0, 1], in the order they came), each one-sided at
    ``confidence``; (0, 1) with no value."""
    if not values:
        return 0.0, 1.0
    if not all(0.0 <= x <= 1.0 for x in values):
        raise ValueError("betting_bounds needs values in [0, 1]")
    bets = predictable_bets(values, confidence)
    threshold = math.log(1 / (1 - confidence))
    return _edge(values, bets, threshold, upper=False), _edge(values, bets, threshold, upper=True)


def upper_bound_floor(mean: float, num_samples: int, confidence: float) -> float:
    """The least upper bound any bound valid for every law on [0, 1] can put on ``num_samples`` values at ``mean``:
    mean + (1 - mean)(1 - delta^(1/n)), the law "mean, or 1 with probability p" showing them with probability
    (1 - p)^n. A window whose mean stays where it is cannot be certified under a level below this at that size."""
    if num_samples <= 0:
        return 1.0
    mean = min(max(mean, 0.0), 1.0)
    return mean + (1 - mean) * (1 - (1 - confidence) ** (1 / num_samples))


def _edge(values: Sequence[float], bets: Sequence[float], threshold: float, upper: bool) -> float:
    """The bound on one side: where the capital crosses 1/delta. For the upper bound the capital grows with m and
    the bisection keeps its hi end; for the lower it shrinks as m grows and keeps its lo end (the safe side each)."""
    end = 1.0 if upper else 0.0
    if _log_capital(values, bets, end, upper=upper) < threshold:
        return end  # no mean on this side is rejected
    lo, hi = 0.0, 1.0
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        rejected = _log_capital(values, bets, mid, upper=upper) >= threshold
        if rejected == upper:
            hi = mid
        else:
            lo = mid
    return hi if upper else lo
