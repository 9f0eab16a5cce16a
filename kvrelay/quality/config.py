"""The quality guard's settings: a target and how the guard samples and moves, validated at construction.

Defaults hold without per-model or per-workload tuning:

- **target** ``kl=0.05,agreement=0.9``: a mean first-token KL(full || method) of 0.05 nats and top-1 agreement with
  ``full`` on 9 calls in 10. Every shipped table (BENCHMARKS.md) has ``relay`` at 0.004-0.023 nats and 0.93-1.00
  agreement, on both models and every workload; ``naive`` ranges from 0.04 to 0.50 nats. The target accepts the
  repair kvrelay ships as its best and refuses unrepaired reuse where it visibly changes answers, on any model,
  without knowing which.
- **sample_rate** 0.05 after each rung's first ``first_calls_per_role`` (16) calls, which are all shadowed: a
  reference prefill costs about one ``full`` prefill, a few percent of a call that decodes a hundred tokens.
- **shadow_share** 0.05: a tenant whose roles die before their warm-up (a namespace per conversation: every call
  a role's first, kvrelay.quality.turnover) has its shadows held to this share of the live compute
  (kvrelay.server.shadow_pacer); without it every such call would be shadowed.
- **confidence** 0.9 one-sided, ``window`` 32 samples, judged from ``min_samples`` 16 on, ``hold_calls`` 16 before
  trying a cheaper rung, ``margin`` 0.8 of the KL target to count as well inside, ``kl_cap_factor`` 5 (see
  ``kvrelay.quality.estimate``): with these a rung at zero KL is certified well inside once it is judged, at
  ``min_samples`` (16; its bound alone would get there at 15), and the start rung is held to its mean
  (``trust_start``), so a role can settle within its first few dozen calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.errors import ConfigError
from kvrelay.quality.ladder import DEFAULT_LADDER, Rung, check_ladder


@dataclass(frozen=True)
class QualityTarget:
    """What a role's setting must meet: mean first-token KL(full || method) <= ``kl_max`` nats and top-1 agreement
    with ``full`` >= ``agreement_min``."""

    kl_max: float = field(default=0.05, metadata={"help": "mean first-token KL(full || method) allowed, in nats"})
    agreement_min: float = field(default=0.9, metadata={"help": "share of calls whose first token's top-1 must "
                                                                "equal full's"})

    def __post_init__(self) -> None:
        if not (isinstance(self.kl_max, (int, float)) and math.isfinite(self.kl_max) and self.kl_max > 0):
            raise ConfigError(f"quality target kl must be a finite number > 0 (nats), got {self.kl_max!r}")
        if not (isinstance(self.agreement_min, (int, float)) and 0 <= self.agreement_min <= 1):
            raise ConfigError(f"quality target agreement must be in [0, 1], got {self.agreement_min!r}")

    def __str__(self) -> str:
        return f"kl={self.kl_max:g},agreement={self.agreement_min:g}"


DEFAULT_TARGET = QualityTarget()
DEFAULT_START = "relay"


def check_shadow_share(share: object) -> float:
    """``share`` as a float in (0, 1], or a ConfigError naming the setting."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0 < share <= 1):
        raise ConfigError(f"quality shadow share must be in (0, 1], got {share!r}")
    return float(share)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"quality {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class QualityConfig:
    """The guard's settings; ``target`` None turns the guard off (no shadow references, the server's method)."""

    target: QualityTarget | None = field(default=DEFAULT_TARGET, metadata={
        "help": "quality target 'kl=K,agreement=A' (nats, share), or 'off' to disable the guard"})
    sample_rate: float = field(default=0.05, metadata={
        "help": "share of a role's calls also run with full as a shadow reference, after the first calls of "
                "each rung it moves to (all shadowed); 0: only those"})
    shadow_share: float = field(default=0.05, metadata={
        "help": "the most of the live compute the shadow references of a tenant whose roles die before their "
                "warm-up (a namespace per conversation) take, in (0, 1]"})
    first_calls_per_role: int = field(default=16, metadata={
        "help": "calls of a role shadowed one by one after it arrives at a rung (and at its first)"})
    ladder: tuple[Rung, ...] = field(default=DEFAULT_LADDER, metadata={"help": "rungs, cheapest to safest"})
    # relay, not the safest rung: every shipped table (both models, every workload) has relay inside the default
    # target, so a new role gets relay's reuse from its first call and the guard moves it to prefix if its own
    # traffic says otherwise; starting at prefix cost 0.6-0.8x of the best static rung's reuse over 50-call runs
    start: str | None = field(default=DEFAULT_START, metadata={
        "help": f"rung a new role starts at (None: the safest; the default {DEFAULT_START!r} on a ladder without it: "
                "the safest)"})
    # the start rung has every shipped table's evidence behind it; at 16-32 samples no bound valid for every law of
    # the clipped KL can certify a mean above ~0.02-0.035 nats under 0.05 (see kvrelay.quality.betting), so asking
    # the start rung for a certificate moves roles whose relay sits at 0.015-0.035 nats to prefix for nothing
    trust_start: bool = field(default=True, metadata={
        "help": "the start rung breaks on its window's mean KL (each call counted whole) over the target, not on "
                "its upper bound, "
                "until it broke for the role; a rung the guard moves a role to (the start rung too, after it "
                "broke) must keep its KL upper bound under the target"})
    confidence: float = field(default=0.9, metadata={"help": "one-sided confidence of the bounds, in (0.5, 1)"})
    window: int = field(default=32, metadata={"help": "most recent samples per role and rung that estimate it"})
    min_samples: int = field(default=16, metadata={"help": "samples a rung needs before it is judged"})
    early_break_samples: int = field(default=3, metadata={
        "help": "samples after which a rung whose KL lower bound is already over the target breaks"})
    hold_calls: int = field(default=16, metadata={
        "help": "calls a role stays at a rung before trying a cheaper one; x2 per break of that cheaper rung"})
    margin: float = field(default=0.8, metadata={
        "help": "well inside the target: KL upper bound <= margin x the KL target (in (0, 1])"})
    kl_cap_factor: float = field(default=5.0, metadata={
        "help": "a call's KL counts at most this x the KL target in the bound (>= 1)"})

    def __post_init__(self) -> None:
        if self.target is not None and not isinstance(self.target, QualityTarget):
            raise ConfigError(f"quality target must be a QualityTarget or None, got {self.target!r}")
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 <= rate <= 1):
            raise ConfigError(f"quality sample rate must be a share in [0, 1], got {rate!r}")
        check_shadow_share(self.shadow_share)
        for name in ("first_calls_per_role", "window", "min_samples", "early_break_samples", "hold_calls"):
            _positive_int(name, getattr(self, name))
        if not self.early_break_samples <= self.min_samples <= self.window:
            raise ConfigError(f"quality needs early_break_samples ({self.early_break_samples}) <= min_samples "
                              f"({self.min_samples}) <= window ({self.window})")
        if not isinstance(self.trust_start, bool):
            raise ConfigError(f"quality trust_start must be true or false, got {self.trust_start!r}")
        if not (isinstance(self.confidence, float) and 0.5 < self.confidence < 1):
            raise ConfigError(f"quality confidence must be in (0.5, 1), got {self.confidence!r}")
        if not (isinstance(self.margin, (int, float)) and 0 < self.margin <= 1):
            raise ConfigError(f"quality margin must be in (0, 1], got {self.margin!r}")
        if not (isinstance(self.kl_cap_factor, (int, float)) and math.isfinite(self.kl_cap_factor)
                and self.kl_cap_factor >= 1):
            raise ConfigError(f"quality kl_cap_factor must be a finite number >= 1, got {self.kl_cap_factor!r}")
        object.__setattr__(self, "ladder", check_ladder(self.ladder))
        if self.start not in (None, DEFAULT_START) and self.start not in {r.name for r in self.ladder}:
            raise ConfigError(f"quality start rung {self.start!r} is not on the ladder "
                              f"({', '.join(r.name for r in self.ladder)})")

    @property
    def start_index(self) -> int:
        if self.start is None or self.start not in {r.name for r in self.ladder}:
            return len(self.ladder) - 1  # only the default start can be off the ladder (checked at construction)
        return [r.name for r in self.ladder].index(self.start)

    @property
    def kl_cap(self) -> float:
        """The clip of one call's KL in the bound, in nats (the target's ``kl_cap_factor`` x; 1 nat when off)."""
        return self.kl_cap_factor * (self.target.kl_max if self.target is not None else 0.2)

    @property
    def sample_every(self) -> int:
        """After the first calls at a rung, one call in this many is shadowed (0: none)."""
        return 0 if self.sample_rate <= 0 else max(1, round(1 / self.sample_rate))

    @staticmethod
    def parse_target(text: str) -> QualityTarget | None:
        """``"kl=0.05,agreement=0.9"`` (either part may be left out: its default), or ``"off"`` (None)."""
        text = (text or "").strip()
        if text.lower() == "off":
            return None
        if not text:
            raise ConfigError("quality target is empty; give 'kl=K,agreement=A' or 'off'")
        values: dict[str, float] = {}
        keys = {"kl": "kl_max", "agreement": "agreement_min"}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in keys:
                raise ConfigError(f"quality target {text!r}: expected 'kl=K,agreement=A' or 'off', got {item!r}")
            if keys[key] in values:
                raise ConfigError(f"quality target {text!r}: {key} given twice")
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"quality target {text!r}: {key}={value.strip()!r} is not a number") from None
            if not math.isfinite(number):
                raise ConfigError(f"quality target {text!r}: {key} must be finite")
            values[keys[key]] = number
        return QualityTarget(**values)
