"""Summary statistics over calls (pure Python)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median of per-call ratios (not the ratio of medians): speedup = median(t_ref / t_method)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} vs {len(denominators)} calls: ratios need pairs")
    return median([n / d for n, d in zip(numerators, denominators, strict=True)])


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return float(sum(values) / len(values))


def timed_median_ms(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (after ``warmup`` untimed ones), in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)
