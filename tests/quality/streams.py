"""Synthetic quality streams for the guard's tests: per rung, what a shadow comparison of a call would measure.

A stream is a function (call index, rung name) -> (first-token KL, top-1 agree), deterministic: noise comes from a
``random.Random`` seeded by the call and the rung, never from global state.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvrelay.quality import QualityGuard

Stream = Callable[[int, str], tuple[float, bool]]


def constant(per_rung: dict[str, tuple[float, bool]]) -> Stream:
    return lambda i, rung: per_rung[rung]


def noisy(per_rung: dict[str, tuple[float, float]], seed: int = 0) -> Stream:
    """Per rung (mean KL, agreement rate): KL exponential around its mean (a heavy right tail), agreement a coin."""
    def draw(i: int, rung: str) -> tuple[float, bool]:
        rng = random.Random(f"{seed}/{i}/{rung}")
        kl_mean, agree_rate = per_rung[rung]
        return rng.expovariate(1 / kl_mean) if kl_mean > 0 else 0.0, rng.random() < agree_rate
    return draw


def drive(guard: QualityGuard, stream: Stream, num_calls: int, namespace: str = "ns", role: str = "agent"
          ) -> list[tuple[str, bool]]:
    """``num_calls`` calls of one role as the server makes them: pick the rung, ask whether to shadow, record the
    shadow's comparison. Returns (rung, shadowed) per call."""
    out = []
    for i in range(num_calls):
        rung = guard.rung_for(namespace, role)
        shadow = guard.should_shadow(namespace, role)
        if shadow:
            kl, agree = stream(i, rung.name)
            guard.record(namespace, role, rung.name, kl, agree, None, 1.0)
        out.append((rung.name, shadow))
    return out
