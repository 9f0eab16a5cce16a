"""Summary statistics over calls (pure Python)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


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
