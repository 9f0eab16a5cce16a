"""``TokenIndex.find``'s second half: which of the candidate runs a prompt takes, and the free pieces of the rest.

Pure Python, no torch. ``find_runs`` (``index_sweep``) lists candidate runs; ``choose`` takes them greedily by
the index's preference, puts a run that overlaps one taken back in line as its free pieces, and checks every
run it returns token by token.
"""

from __future__ import annotations

import bisect
import heapq
from typing import TYPE_CHECKING

from kvrelay.server.index_sweep import TokenMatch

if TYPE_CHECKING:
    from kvrelay.server.index import TokenIndex

__all__ = ["choose"]


def choose(index: TokenIndex, token_ids: list[int] | tuple[int, ...], runs: list[TokenMatch], min_tokens: int = 16,
           covered: list[tuple[int, int]] | None = None, prefer: str = "longest") -> list[TokenMatch]:
    """``TokenIndex.find``'s greedy over ``runs`` (from ``find_runs`` on ``token_ids``); adds its steps to the
    index's ``last_work``, and the runs whose tokens differ (a hash collision) to its ``num_collisions``."""
    q = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    oldest = prefer == "oldest"
    spans = [index._spans[m.span_id] for m in runs]

    def entry(start: int, end: int, k: int, src_start: int) -> tuple[int, ...]:
        """A run's (or piece's) place in line, then what it is: (rank..., k, start, end, src_start)."""
        order = spans[k].order
        if oldest:
            return order, start - end, start, k, start, end, src_start
        return start - end, start, -order, k, start, end, src_start

    min_tokens = max(min_tokens, 1)  # a piece holds a token at least
    gaps = _free_gaps(_merged(covered or []), len(q), min_tokens)
    chosen: list[TokenMatch] = []
    line = [entry(m.start, m.end, k, m.src_start) for k, m in enumerate(runs)]
    heapq.heapify(line)
    work = len(line)
    while line:
        *_, k, start, end, src_start = heapq.heappop(line)
        pieces, num_steps = _free_pieces(start, end, gaps, min_tokens)
        work += 1 + num_steps
        if not pieces:
            continue
        if pieces[0] != (start, end):  # it overlaps what was taken: its free pieces rank by their own length
            for a, b in pieces:        # (a shorter piece waits behind longer runs)
                work += 1
                heapq.heappush(line, entry(a, b, k, src_start + a - start))
            continue
        if q[start:end] != spans[k].token_ids[src_start:src_start + end - start]:
            index.num_collisions += 1  # equal hashes, different tokens: never returned
        else:
            work += end - start  # the tokens compared
            chosen.append(TokenMatch(start, end, runs[k].span_id, src_start))
            _take(gaps, start, end, min_tokens)
    index.last_work += work
    return sorted(chosen, key=lambda m: m.start)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint union of ``ranges`` (empty ones dropped)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _free_gaps(taken: list[tuple[int, int]], num_tokens: int, min_tokens: int) -> list[tuple[int, int]]:
    """The free gaps of [0, num_tokens) between ``taken`` (sorted, disjoint) that hold ``min_tokens`` or more: only
    they can hold a piece ``find`` keeps, so a run meets just those, not every short gap between taken ranges."""
    gaps, cursor = [], 0
    for start, end in taken + [(num_tokens, num_tokens)]:
        if start - cursor >= min_tokens:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    return gaps


def _take(gaps: list[tuple[int, int]], start: int, end: int, min_tokens: int) -> None:
    """Take the free range [start, end), which lies inside one gap: what is left of that gap either side stays a gap
    if it still holds ``min_tokens``."""
    k = bisect.bisect_right(gaps, (start, float("inf"))) - 1  # the gap starting at or before ``start``
    g_start, g_end = gaps[k]
    assert g_start <= start and end <= g_end, (gaps[k], start, end)
    gaps[k:k + 1] = [g for g in ((g_start, start), (end, g_end)) if g[1] - g[0] >= min_tokens]


def _free_pieces(start: int, end: int, gaps: list[tuple[int, int]],
                 min_tokens: int) -> tuple[list[tuple[int, int]], int]:
    """The maximal free sub-ranges of [start, end) of ``min_tokens`` or more, and the gaps looked at: the gaps
    overlapping the run, each but the first and last wholly inside it (so each a piece), which bounds the steps by
    the pieces returned plus two."""
    pieces = []
    k = max(bisect.bisect_right(gaps, (start, float("inf"))) - 1, 0)  # the last gap starting at or before start
    num_steps = 0
    while k < len(gaps) and gaps[k][0] < end:
        num_steps += 1
        a, b = max(gaps[k][0], start), min(gaps[k][1], end)
        if b - a >= min_tokens:
            pieces.append((a, b))
        k += 1
    return pieces, num_steps
