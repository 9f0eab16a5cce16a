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

    taken = _merged(covered or [])
    chosen: list[TokenMatch] = []
    line = [entry(m.start, m.end, k, m.src_start) for k, m in enumerate(runs)]
    heapq.heapify(line)
    work = len(line)
    while line:
        *_, k, start, end, src_start = heapq.heappop(line)
        work += 1
        pieces = [p for p in _free_pieces(start, end, taken) if p[1] - p[0] >= min_tokens]
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
            _take(taken, start, end)
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


def _take(taken: list[tuple[int, int]], start: int, end: int) -> None:
    """Add the free range [start, end) to ``taken`` (sorted, disjoint), joined to the ranges it touches: on
    repeated text ``find`` takes many short pieces end to end, and ``_free_pieces`` then steps over one."""
    k = bisect.bisect_left(taken, (start, start))
    if k < len(taken) and taken[k][0] == end:
        end = taken.pop(k)[1]
    if k > 0 and taken[k - 1][1] == start:
        k -= 1
        start = taken.pop(k)[0]
    taken.insert(k, (start, end))


def _free_pieces(start: int, end: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The maximal sub-ranges of [start, end) that overlap no range of ``taken`` (sorted, disjoint)."""
    pieces = []
    cursor = start
    k = max(bisect.bisect_right(taken, (start, start)) - 1, 0)  # the last range starting at or before start
    while k < len(taken) and taken[k][0] < end:
        t_start, t_end = taken[k]
        if t_end > cursor:
            if t_start > cursor:
                pieces.append((cursor, t_start))
            cursor = t_end
        k += 1
    if cursor < end:
        pieces.append((cursor, end))
    return pieces
