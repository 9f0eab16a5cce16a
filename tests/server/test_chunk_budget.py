"""ChunkBudget: chunk sizes from synthetic piece costs (no clock): they shrink with context to what the first chunk
costs, stay within their bounds, and come back after outliers."""

from __future__ import annotations

import random

import pytest

from kvrelay.server.chunk_budget import WINDOW_PIECES, ChunkBudget, PieceCost, attended_keys

MAX_TOKENS = 512
TRUE_MS = (5.0, 1.0, 0.0005)  # fixed, per token, per attended key: attention equals the rest at ~2K tokens
CONTEXTS = (0, 1024, 2048, 4096, 8192)


def _cost(num_tokens: int, start: int, coef=TRUE_MS) -> PieceCost:
    keys = attended_keys(list(range(start, start + num_tokens)))
    return PieceCost(num_tokens, keys, coef[0] + coef[1] * num_tokens + coef[2] * keys)


def _best(start: int, coef=TRUE_MS) -> int:
    """The most tokens at ``start`` whose true cost fits the true cost of MAX_TOKENS at position 0."""
    budget = _cost(MAX_TOKENS, 0, coef).ms
    return max(n for n in range(1, MAX_TOKENS + 1) if _cost(n, start, coef).ms <= budget)


def _long_prompt(budget: ChunkBudget, num_tokens: int = 8192, scale: float = 1.0, noise: float = 0.0,
                 seed: int = 0) -> list[int]:
    """Prefill a prompt piece by piece as the worker does (sizes from the budget, true costs observed)."""
    rng, start, sizes = random.Random(seed), 0, []
    while start < num_tokens:
        n = budget.num_tokens(list(range(start, min(start + MAX_TOKENS, num_tokens))))
        piece = _cost(n, start)
        budget.observe(PieceCost(n, piece.num_attended_keys, piece.ms * scale * (1 + noise * rng.uniform(-1, 1))))
        sizes.append(n)
        start += n
    return sizes


def _short_requests(budget: ChunkBudget, count: int = 4) -> None:
    for i in range(count):
        budget.observe(_cost(8 + 4 * i, 0))


def _sizes(budget: ChunkBudget) -> list[int]:
    return [budget.num_tokens(list(range(s, s + MAX_TOKENS))) for s in CONTEXTS]


def test_before_any_measurement_a_chunk_is_max_tokens():
    budget = ChunkBudget(MAX_TOKENS)
    assert _sizes(budget) == [MAX_TOKENS] * len(CONTEXTS)
    assert budget.num_tokens(list(range(100, 140))) == 40  # never more than the prompt has left


def test_learned_chunks_shrink_with_context_to_the_cost_of_the_first_chunk():
    budget = ChunkBudget(MAX_TOKENS)
    _short_requests(budget)
    sizes = _long_prompt(budget)
    assert sizes[0] == MAX_TOKENS and sizes[-2] < MAX_TOKENS // 2  # the last is what was left
    assert budget.coef_ms == pytest.approx(TRUE_MS, rel=1e-6)
    learned = _sizes(budget)
    assert learned == [_best(s) for s in CONTEXTS]
    assert all(a > b for a, b in zip(learned, learned[1:], strict=False))


def test_noisy_and_evenly_slower_pieces_give_about_the_same_chunks():
    """Times 10% noisy, or all 4x slower (a loaded machine): the budget is a ratio, the sizes barely move."""
    for scale, noise in ((1.0, 0.1), (4.0, 0.0)):
        budget = ChunkBudget(MAX_TOKENS)
        _short_requests(budget)
        _long_prompt(budget, scale=scale, noise=noise, seed=3)
        _long_prompt(budget, scale=scale, noise=noise, seed=4)
        for got, best in zip(_sizes(budget), (_best(s) for s in CONTEXTS), strict=True):
            assert abs(got - best) <= 0.1 * best, (scale, noise, got, best)


def test_chunks_stay_within_min_and_max_tokens():
    heavy = (0.0, 1.0, 1.0)  # attention is everything: deep in a prompt one token costs thousands of them
    budget = ChunkBudget(MAX_TOKENS)
    for start in range(0, 8192, 512):
        budget.observe(_cost(64, start, heavy))
    assert budget.num_tokens(list(range(8000, 8512))) == budget.min_tokens == MAX_TOKENS // 8
    assert budget.num_tokens(list(range(8000, 8010))) == 10  # what is left, though under the least chunk
    assert budget.num_tokens(list(range(0, 4 * MAX_TOKENS))) == MAX_TOKENS
    free = ChunkBudget(MAX_TOKENS, min_tokens=16)
    for start in range(0, 8192, 512):
        free.observe(_cost(64 + start // 64, start, (20.0, 1.0, 0.0)))  # no attention cost, a fixed cost a piece
    assert free.num_tokens(list(range(8000, 8000 + 4 * MAX_TOKENS))) == MAX_TOKENS
    assert free.num_tokens(list(range(4 * MAX_TOKENS)), budget_ms=10 * free.turn_ms) == MAX_TOKENS


def test_outliers_move_the_chunks_a_bounded_step_and_leave_with_the_window():
    budget = ChunkBudget(MAX_TOKENS)
    _short_requests(budget)
    _long_prompt(budget)
    before = _sizes(budget)
    for start in (6000, 7000, 8000):  # the machine stalled three times late in a prompt: 100x the time
        piece = _cost(128, start)
        budget.observe(PieceCost(piece.num_tokens, piece.num_attended_keys, piece.ms * 100))
    stalled = _sizes(budget)
    assert stalled != before  # they did count
    assert all(s >= b // 2 for s, b in zip(stalled, before, strict=True)), (stalled, before)
    for i in range(WINDOW_PIECES):
        budget.observe(_cost(64 + i, 100 * i))
    assert _sizes(budget) == before


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": 8, "min_tokens": 9},
                                    {"max_tokens": 8, "min_tokens": 0}, {"max_tokens": 8, "window_pieces": 2}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ChunkBudget(**kwargs)
