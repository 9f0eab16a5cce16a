"""Members of a periodic group that go on past the prompt's repeats: sorted by what follows the break.

A member of a periodic group (``index_periodic``) whose repeats stop exactly where the prompt's do, with the
prompt's break token, goes on past the stretch: its run ends where its tokens after the break leave the prompt's.
Stored lines ended as the prompt's lines are (a table of rule lines, each stored in a context of its own) make
many such members, and each was a candidate at every stretch of the prompt. But they all start their run at the
same offset (one visit), so only their ends differ, and an end is the longest common extension (LCE) of two
suffixes: the prompt's after its break, and the member's after its own. Sorted by that suffix (as a suffix array
sorts), the members whose LCE with the prompt is at least ``l`` form one interval around the prompt's place in the
order, and the LCE with any member is the minimum of the LCEs of neighbours between it and that place. So one
binary search places the prompt, and then:

- ``prefer="longest"``: the one run a visit keeps is the furthest-reaching member's (the newest among equals):
  the interval of the largest LCE, and its newest member;
- ``prefer="oldest"``: a member is kept unless an older one of the visit reaches as far, so the runs kept are the
  records of reach in span order: the oldest member, then the oldest of those reaching further, ...; each is
  the oldest member of an interval, one range-minimum query.

Every other member's run lies inside one of those (same start, an end no further, a span at least as preferred),
so the visit gives the same runs. Work: a sort of each bucket's members once per lookup (O(m log m) hash
comparisons) and, per visit, O(log m) comparisons plus O(log m) per run given, whatever the number of members.
Comparisons are by hashes (``common_length``): they only steer the search, the sweep checks every run it keeps.
Pure Python, no torch.
"""

from __future__ import annotations

from array import array
from functools import cmp_to_key
from typing import TYPE_CHECKING

from kvrelay.server.index_splits import common_length

if TYPE_CHECKING:
    from kvrelay.server.index_sweep import PolyHash

__all__ = ["BREAK_SORT_MIN_MEMBERS", "GoingOn"]

# a bucket of members going on past the break is sorted from this many members on; fewer are each a candidate
BREAK_SORT_MIN_MEMBERS = 4


def _sparse(values: list[int], better) -> list[list[int]]:
    """Sparse table of positions: ``table[j][k]`` the best of ``values[k:k + 2**j]`` under ``better``
    (a position-preferring comparison), for O(1) range queries."""
    table = [list(range(len(values)))]
    width = 1
    while 2 * width <= len(values):
        prev = table[-1]
        table.append([a if better(values[a], values[c]) else c
                      for a, c in zip(prev, prev[width:], strict=False)])
        width *= 2
    return table


def _query(table: list[list[int]], values: list[int], better, lo: int, hi: int) -> int:
    """The best position in [lo, hi) (non-empty) under ``better``."""
    level = (hi - lo).bit_length() - 1
    a, c = table[level][lo], table[level][hi - (1 << level)]
    return a if better(values[a], values[c]) else c


def _less(x: int, y: int) -> bool:
    return x <= y


def _more(x: int, y: int) -> bool:
    return x >= y


class GoingOn:
    """One bucket of a periodic group's members (same extension ``after``, same break token), sorted by their
    tokens after the break: (prefix hashes, start, length) per member, and range tables over the LCEs of
    neighbours and over span orders."""

    __slots__ = ("members", "suffixes", "orders", "newest", "adjacent", "adjacent_table", "oldest_table",
                 "newest_table", "work")

    def __init__(self, holders: list[tuple], block_len: int, hasher: PolyHash) -> None:
        """``holders``: the bucket's members as ``TokenIndex.group_holders`` gives them."""
        self.work = 0

        def suffix(h: tuple) -> tuple[array, tuple, int, int]:
            _, off, _, tail, after, entry, _ = h
            return entry.prefix, entry.token_ids, off + block_len + after + 1, tail - after - 1

        def compare(x: tuple, y: tuple) -> int:
            return self._compare(hasher, x[1], y[1])

        pairs = sorted(((h, suffix(h), rank) for rank, h in enumerate(holders)), key=cmp_to_key(compare))
        self.members = [h for h, _, _ in pairs]
        self.suffixes = [s for _, s, _ in pairs]
        # span order, then the place in ``holders`` (members of one span: the first listed is kept, as when every
        # member is a candidate), packed in one int
        self.orders = [h[2] << 32 | rank for h, _, rank in pairs]
        self.newest = [h[2] << 32 | ((1 << 32) - 1 - rank) for h, _, rank in pairs]
        # adjacent[k]: the LCE of the k-th and (k+1)-th suffixes
        self.adjacent = [self._lce(hasher, x, y) for x, y in zip(self.suffixes, self.suffixes[1:], strict=False)]
        self.adjacent_table = _sparse(self.adjacent, _less)
        self.oldest_table = _sparse(self.orders, _less)
        self.newest_table = _sparse(self.newest, _more)
        self.work += len(holders)

    def _lce(self, hasher: PolyHash, x: tuple, y: tuple) -> int:
        """The LCE of two suffixes (prefix hashes, tokens, start, length)."""
        k, probes = common_length(hasher, x[0], x[2], y[0], y[2], min(x[3], y[3]))
        self.work += probes + 1
        return k

    def _compare(self, hasher: PolyHash, x: tuple, y: tuple) -> int:
        """-1, 0 or 1 as suffix ``x`` sorts before, with or after ``y`` (one that ends first sorts first)."""
        k = self._lce(hasher, x, y)
        if k == min(x[3], y[3]):
            a, c = x[3], y[3]
        else:
            a, c = x[1][x[2] + k], y[1][y[2] + k]
        return (a > c) - (a < c)

    def picks(self, hasher: PolyHash, prefix: array, q: list[int], start: int, oldest: bool) -> list[tuple]:
        """The members whose runs a visit keeps, for a prompt whose tokens after its break start at ``start``
        (``oldest``: the records of reach in span order; else the newest of the furthest-reaching)."""
        me = (prefix, q, start, len(q) - start)
        suffixes, m = self.suffixes, len(self.suffixes)
        lo, hi = 0, m  # the prompt's place: the first suffix above it
        while lo < hi:
            mid = (lo + hi) // 2
            if self._compare(hasher, suffixes[mid], me) > 0:
                hi = mid
            else:
                lo = mid + 1
        place = lo
        lce_left = self._lce(hasher, me, suffixes[place - 1]) if place else -1
        lce_right = self._lce(hasher, me, suffixes[place]) if place < m else -1
        if not oldest:
            lo, hi = self._at_least(max(lce_left, lce_right), place, lce_left, lce_right)
            return [self.members[_query(self.newest_table, self.newest, _more, lo, hi)]]
        out = []
        lo, hi = 0, m
        while lo < hi:
            k = _query(self.oldest_table, self.orders, _less, lo, hi)
            out.append(self.members[k])
            reach = self._reach(k, place, lce_left, lce_right)
            lo, hi = self._at_least(reach + 1, place, lce_left, lce_right)
        return out

    def _min_adjacent(self, lo: int, hi: int) -> int:
        """The least LCE of neighbours among suffixes [lo, hi] (a large number when lo == hi)."""
        if lo >= hi:
            return 1 << 62
        self.work += 1
        return self.adjacent[_query(self.adjacent_table, self.adjacent, _less, lo, hi)]

    def _reach(self, k: int, place: int, lce_left: int, lce_right: int) -> int:
        """The LCE of the prompt with the k-th suffix."""
        if k < place:
            return min(lce_left, self._min_adjacent(k, place - 1))
        return min(lce_right, self._min_adjacent(place, k))

    def _at_least(self, reach: int, place: int, lce_left: int, lce_right: int) -> tuple[int, int]:
        """The interval of suffixes whose LCE with the prompt is ``reach`` or more (empty: lo == hi)."""
        lo = hi = place
        if place and lce_left >= reach:  # the first k with min(adjacent[k:place - 1]) >= reach
            a, c = 0, place - 1
            while a < c:
                mid = (a + c) // 2
                if self._min_adjacent(mid, place - 1) >= reach:
                    c = mid
                else:
                    a = mid + 1
            lo = a
        if place < len(self.suffixes) and lce_right >= reach:  # the last k with min(adjacent[place:k]) >= reach
            a, c = place, len(self.suffixes) - 1
            while a < c:
                mid = (a + c + 1) // 2
                if self._min_adjacent(place, mid) >= reach:
                    a = mid
                else:
                    c = mid - 1
            hi = a + 1
        return lo, hi
