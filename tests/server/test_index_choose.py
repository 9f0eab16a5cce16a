"""``find``'s greedy over candidate runs (``index_choose``): its steps are counted in ``last_work`` and bounded.

A run that overlaps ranges already taken meets only the free gaps long enough to hold a piece ``find`` keeps, so an
oldest span cut into many short pieces does not make every newer run step over each of them."""

from __future__ import annotations

import random

from kvrelay.server.index import TokenIndex
from kvrelay.server.index_choose import _free_gaps, _free_pieces, _take


def _cut_oldest_scene(num_tokens: int, num_newer: int, step: int = 4) -> tuple[TokenIndex, list[int]]:
    """The prompt; its oldest span equals it but for every 20th token (taken first, in 19-token pieces with 1-token
    gaps); newer spans each hold a long slice of it, shifted by ``step``."""
    rng = random.Random(0)
    q = [rng.randrange(100, 50_000) for _ in range(num_tokens)]
    index = TokenIndex(block_len=8)
    oldest = list(q)
    for j in range(19, num_tokens, 20):
        oldest[j] = 60_000 + j
    index.add("s0", oldest)
    length = num_tokens - num_newer * step
    for k in range(num_newer):
        index.add(f"s{k + 1}", [70_000 + k] + q[k * step: k * step + length] + [80_000 + k])
    return index, q


def test_newer_runs_over_a_cut_oldest_span_cost_what_they_return():
    work = {}
    for num_newer in (100, 400):
        index, q = _cut_oldest_scene(4000, num_newer)
        found = index.find(q, min_tokens=16, prefer="oldest")
        assert {m.span_id for m in found} == {"s0"} and sum(m.num_tokens for m in found) == 3800
        work[num_newer] = index.last_work
    per_span = (work[400] - work[100]) / 300
    assert per_span <= 32, work  # stepping over the 200 short gaps once per newer run: ~400 a span


def test_free_pieces_meet_only_gaps_that_hold_a_piece():
    taken = [(k, k + 19) for k in range(0, 400, 20)]  # 1-token gaps between, then [399, 500) free
    gaps = _free_gaps(taken, 500, 16)
    assert gaps == [(399, 500)]
    pieces, num_steps = _free_pieces(0, 450, gaps, 16)
    assert pieces == [(399, 450)] and num_steps == 1
    _take(gaps, 420, 440, 16)
    assert gaps == [(399, 420), (440, 500)]
    _take(gaps, 440, 470, 16)
    assert gaps == [(399, 420), (470, 500)]
    pieces, num_steps = _free_pieces(405, 480, gaps, 16)
    assert pieces == [] and num_steps == 2  # 15 and 10 tokens: too short to keep
