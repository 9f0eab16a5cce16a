"""Running estimates of one setting's fidelity against ``full``, with confidence bounds.

Per (namespace, role, setting) the guard keeps the last ``window`` shadow samples: a window rather than a
decaying average so that the bounds count real samples (a decayed weight has no sample size to put in a bound),
and so that a rung's estimate is made of recent traffic only.

**Top-1 agreement** is a share of calls: Wilson's score interval.

**First-token KL** (and the continuation's) is nonnegative and heavy-tailed: most calls sit near zero and a few
spike. A t-interval trusts the sample variance, which stays tiny until the first spike arrives, so it would
certify a rung after a handful of lucky calls. We bound instead the mean of ``min(KL, kl_cap) / kl_cap``, a variable
in [0, 1], by betting (``kvrelay.quality.betting``): valid for every law on [0, 1], per check (a capital
process and Markov's inequality, no normal approximation), and it uses the window's variance, so a window of
near-constant KL is bounded close to its mean. It never trusts the variance of the values it has not seen: n calls
at zero KL still bound the mean by about kl_cap x (1 - delta^(1/n)), which no valid bound can go under, since
"zero, or a spike to the cap with probability p" shows n zeros with probability (1 - p)^n. (Wilson's score interval
on the clipped mean is an approximation that goes under that floor near zero: it covers less than
its confidence there.) The price is the clip: a call above ``kl_cap`` counts as ``kl_cap``. The guard's default cap
is a few times the target, where such a call is already a clear failure that also flips the top-1 token on most
calls, and the agreement bound sees that.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist

from kvrelay.quality.betting import betting_bounds


def wilson_bounds(mean: float, num_samples: int, z: float) -> tuple[float, float]:
    """Wilson's score interval (lower, upper) for the mean of ``num_samples`` values in [0, 1]; (0, 1) with none."""
    if num_samples <= 0:
        return 0.0, 1.0
    mean = min(max(mean, 0.0), 1.0)
    z2_n = z * z / num_samples
    center = (mean + z2_n / 2) / (1 + z2_n)
    half = z / (1 + z2_n) * math.sqrt(mean * (1 - mean) / num_samples + z2_n / (4 * num_samples))
    return max(center - half, 0.0), min(center + half, 1.0)


def z_for(confidence: float) -> float:
    """The one-sided normal quantile of ``confidence`` (0.9 -> 1.28)."""
    return NormalDist().inv_cdf(confidence)


@dataclass(frozen=True)
class Sample:
    first_token_kl: float
    top1_agree: bool
    continuation_kl: float | None


class RungEstimate:
    """The last ``window`` samples of one setting for one role, and their bounds at one-sided ``confidence``."""

    def __init__(self, window: int, kl_cap: float, confidence: float) -> None:
        self.kl_cap, self.confidence, self.z = kl_cap, confidence, z_for(confidence)
        self.samples: deque[Sample] = deque(maxlen=window)
        self.num_total = 0  # every sample ever recorded, the window's and older ones
        self._kl_bounds_cache: dict[bool, tuple[int, tuple[float, float]]] = {}  # continuation? -> (num_total, b)

    def add(self, first_token_kl: float, top1_agree: bool, continuation_kl: float | None = None) -> None:
        """One shadow comparison. A comparison that broke counts as the worst value, never as an error: a non-finite
        KL (nan from nan logits, or inf) as ``kl_cap``, a non-finite agreement as a disagreement (``max(nan, 0)`` is
        nan, and ``bool(nan)`` is True, so neither may reach the window as is)."""
        broken_agree = isinstance(top1_agree, float) and not math.isfinite(top1_agree)
        agree = bool(top1_agree) and not broken_agree
        self.samples.append(Sample(self._kl_value(first_token_kl), agree,
                                   None if continuation_kl is None else self._kl_value(continuation_kl)))
        self.num_total += 1

    def _kl_value(self, kl: float) -> float:
        kl = float(kl)
        return max(kl, 0.0) if math.isfinite(kl) else self.kl_cap

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def _kl_values(self, continuation: bool) -> list[float]:
        if continuation:
            return [s.continuation_kl for s in self.samples if s.continuation_kl is not None]
        return [s.first_token_kl for s in self.samples]

    def kl_mean(self, continuation: bool = False) -> float:
        """The window's mean KL, unclipped (nan with no sample)."""
        values = self._kl_values(continuation)
        return sum(values) / len(values) if values else math.nan

    def kl_clipped_mean(self) -> float:
        """The window's mean of min(KL, kl_cap), in nats: the quantity the bounds bound (nan with no sample)."""
        values = self._kl_values(False)
        return sum(min(v, self.kl_cap) for v in values) / len(values) if values else math.nan

    def kl_bounds(self, continuation: bool = False) -> tuple[float, float]:
        """(lower, upper) bound of the mean of min(KL, kl_cap), in nats (betting bounds on the window's clipped KL,
        in the order the samples came)."""
        cached = self._kl_bounds_cache.get(continuation)
        if cached is not None and cached[0] == self.num_total:
            return cached[1]
        clipped = [min(v, self.kl_cap) / self.kl_cap for v in self._kl_values(continuation)]
        lower, upper = betting_bounds(clipped, self.confidence)
        bounds = (lower * self.kl_cap, upper * self.kl_cap)
        self._kl_bounds_cache[continuation] = (self.num_total, bounds)
        return bounds

    def kl_upper(self) -> float:
        return self.kl_bounds()[1]

    def kl_upper_steady(self, num_samples: int) -> float:
        """The KL upper bound, in nats, that the guard's bound gives ``num_samples`` samples all at this window's
        clipped mean: a window with no spread, whose bets are the largest, the best a window that stays at that mean
        can expect (3-5% over ``kvrelay.quality.betting.upper_bound_floor``, the least any valid bound could give,
        at 0.02-0.04 nats); the cap with no sample."""
        if not self.samples:
            return self.kl_cap
        steady = [min(self.kl_clipped_mean() / self.kl_cap, 1.0)] * num_samples
        return betting_bounds(steady, self.confidence)[1] * self.kl_cap

    def agreement_mean(self) -> float:
        return sum(s.top1_agree for s in self.samples) / len(self.samples) if self.samples else math.nan

    def agreement_bounds(self) -> tuple[float, float]:
        mean = self.agreement_mean() if self.samples else 0.0
        return wilson_bounds(mean, len(self.samples), self.z)

    def agreement_upper(self) -> float:
        return self.agreement_bounds()[1]

    def agreement_lower_at(self, num_samples: int) -> float:
        """The agreement's lower bound that ``num_samples`` samples at this window's agreement rate would have
        (0 with no sample)."""
        return wilson_bounds(self.agreement_mean(), num_samples, self.z)[0] if self.samples else 0.0

    def to_dict(self) -> dict:
        """The window's estimates and bounds (JSON-ready: no nan, None where there is no sample)."""
        def num(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 6)

        kl_low, kl_high = self.kl_bounds()
        agree_low, agree_high = self.agreement_bounds()
        cont = self._kl_values(True)
        out = {"num_samples": self.num_samples, "num_samples_total": self.num_total,
               "first_token_kl": {"mean": num(self.kl_mean()), "lower": round(kl_low, 6), "upper": round(kl_high, 6)},
               "top1_agreement": {"mean": num(self.agreement_mean()), "lower": round(agree_low, 6),
                                  "upper": round(agree_high, 6)}}
        if cont:
            c_low, c_high = self.kl_bounds(continuation=True)
            out["continuation_kl"] = {"mean": num(self.kl_mean(True)), "lower": round(c_low, 6),
                                      "upper": round(c_high, 6), "num_samples": len(cont)}
        return out
