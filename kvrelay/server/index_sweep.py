"""The lookup sweep of ``kvrelay.server.index``: the prompt's offsets, left to right (see that module).

Also the pieces both sides share: the polynomial hash and the match record. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import heapq
import secrets
from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.server.index import TokenIndex, _Entry, _Member

_MOD = (1 << 61) - 1  # a Mersenne prime: hashes stay Python ints below 2**61 (they fit an int64 array)


class PolyHash:
    """Polynomial hash of token sequences: ``sub(prefix(x), a, b)`` hashes ``x[a:b]`` in O(1).

    The base is random per instance, so nobody can craft token lists that collide on purpose."""

    def __init__(self, base: int | None = None) -> None:
        self.base = base if base is not None else (1 << 20) + secrets.randbelow(_MOD - (1 << 21))
        self._powers = [1]

    def prefix(self, token_ids: list[int] | tuple[int, ...]) -> array:
        """``out[k]`` = hash of ``token_ids[:k]`` (k = 0..len)."""
        out = array("q", [0])
        h, base = 0, self.base
        for t in token_ids:
            h = (h * base + t + 1) % _MOD
            out.append(h)
        return out

    def power(self, k: int) -> int:
        powers = self._powers
        while len(powers) <= k:
            powers.append(powers[-1] * self.base % _MOD)
        return powers[k]

    def sub(self, prefix: array, start: int, end: int) -> int:
        return (prefix[end] - prefix[start] * self.power(end - start)) % _MOD


@dataclass(frozen=True)
class TokenMatch:
    """Query tokens [start, end) equal tokens [src_start, src_start + end - start) of span ``span_id``."""

    start: int
    end: int
    span_id: str
    src_start: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass


class Sweep:
    """One ``find_runs`` sweep over the query's offsets (state shared by its helpers)."""

    def __init__(self, index: TokenIndex, q: list[int], namespace: str, oldest: bool) -> None:
        self.index, self.q, self.namespace, self.oldest = index, q, namespace, oldest
        self.prefix = index.hasher.prefix(q)
        self.same_end = same_token_ends(q)
        self.work = len(q)
        self.runs: list[TokenMatch] = []
        # runs found from the last B offsets: (offset, start, end, span order, span id)
        self.recent: deque[tuple[int, int, int, int, str]] = deque()
        # older runs all start further left than any run found now, so only their reach counts: the
        # furthest end (``longest``), or a staircase of (span order, furthest end of runs from spans at
        # most that old), both increasing (``oldest``: only an older or the same span dominates)
        self.old_max_end = -1
        self.stair_orders: list[int] = []
        self.stair_ends: list[int] = []
        self.left_of: dict[tuple[int, int], int] = {}  # (group's previous block, prompt's) -> tokens matching
        # repeated text meets the same groups at offset after offset: a group whose every member lies inside
        # the older runs' reach sleeps until its reach (growing a token per offset) could pass them.
        # Per block hash met: (groups awake, heap of (wake offset, tie, group) asleep)
        self.block_state: dict[int, tuple[list, list]] = {}
        self.num_asleep = 0

    def run(self) -> list[TokenMatch]:
        index, q, b = self.index, self.q, self.index.block_len
        qp, groups_of, namespace = self.prefix, index._groups, self.namespace
        power_b = index.hasher.power(b)
        q_prev = None
        for i in range(len(q) - b + 1):
            h = (qp[i + b] - qp[i] * power_b) % _MOD  # the query's block at i
            state = self.block_state.get(h)
            if state is None:
                groups = groups_of.get((namespace, h))
                if not groups:
                    self.block_state[h] = state = ([], [])
                else:
                    state = self.block_state[h] = (list(groups.items()), [])
            awake, asleep = state
            while asleep and asleep[0][0] <= i:
                awake.append(heapq.heappop(asleep)[2])
            if awake:
                while self.recent and self.recent[0][0] <= i - b:
                    self._retire(*self.recent.popleft()[2:4])
                still_awake = []
                for group in awake:
                    prev, members = group
                    if prev is not None and prev == q_prev:
                        still_awake.append(group)
                        continue  # reaches back a whole block: found from its first block
                    self.work += 1
                    wake = self._visit(i, prev, q_prev, members)
                    if wake > i + 1:
                        self.num_asleep += 1
                        heapq.heappush(asleep, (wake, self.num_asleep, group))
                    else:
                        still_awake.append(group)
                awake[:] = still_awake
            if i + 1 >= b:
                q_prev = (qp[i + 1] - qp[i + 1 - b] * power_b) % _MOD  # the block before offset i + 1
        self.index.last_work = self.work
        return sorted(self.runs, key=lambda m: (m.start, -m.num_tokens))

    def _retire(self, end: int, order: int) -> None:
        if not self.oldest:
            self.old_max_end = max(self.old_max_end, end)
            return
        orders, ends = self.stair_orders, self.stair_ends
        k = bisect.bisect_right(orders, order)
        if k > 0 and ends[k - 1] >= end:
            return  # an older (or the same) span already reaches as far
        if k > 0 and orders[k - 1] == order:
            k -= 1
            del orders[k], ends[k]
        j = k
        while j < len(orders) and ends[j] <= end:
            j += 1
        orders[k:j], ends[k:j] = [order], [end]

    def _visit(self, i: int, prev: int | None, q_prev: int | None, members: dict[tuple[int, int], _Member]) -> int:
        """The runs whose first aligned block sits at query offset ``i`` in this group's holders; returns the
        first offset where the group could give a run again (past ``i + 1`` when every member was inside the
        older runs: their reach never shrinks, a member's grows by at most a token per offset)."""
        index, q, b = self.index, self.q, self.index.block_len
        spans = index._spans
        (span_id, off), _ = next(iter(members.values())).oldest()
        src = spans[span_id].token_ids
        left = 0
        if prev is not None:  # the previous block differs from the prompt's: fewer than B tokens match
            left = self.left_of.get((prev, q_prev), -1) if q_prev is not None else -1
            if left < 0:  # the same two blocks met before (repeated text) match as far as then
                left, limit = 0, min(i, b)
                while left < limit and q[i - 1 - left] == src[off - 1 - left]:
                    left += 1
                self.work += left
                if q_prev is not None:
                    self.left_of[(prev, q_prev)] = left
            self.work += 1
        start = i - left
        if self.oldest:
            ordered = sorted(((*m.oldest(), m) for m in members.values()), key=lambda h: h[1])
        else:
            ordered = [(*m.newest(), m) for m in members.values()]
        best_end, best_order, best = -1, -1, None
        wake = len(q)
        for (span_id, off), order, member in ordered:
            self.work += 1
            entry = spans[span_id]
            cap = i + b + min(len(q) - i - b, len(entry.token_ids) - off - b)
            lasts_until = len(q)  # the last offset + 1 where cap grows by at most a token per offset
            tight = i + b + member.same_after
            if member.same_after >= 0 and tight < self.same_end[i]:
                # one token repeated in the prompt past the span's repeats: the span stops the run there
                cap, lasts_until = tight, self.same_end[i] - b - member.same_after
            front, lasting = self._dominated_end(start, order, cap)
            if not lasting:
                wake = i + 1
            elif front < len(q):  # no run ends past the prompt: one reaching its end covers all later ones
                wake = min(wake, i + front - cap + 1, lasts_until)
            if front >= cap:
                continue  # inside a run already found
            need = front + 1
            if self.oldest:
                need = max(need, best_end + 1)  # older members first: a newer one must reach further
            else:
                need = max(need, best_end if order > best_order else best_end + 1)
            need = max(need, i + b)
            if need > cap or (need > i + b and not self._equal(i, entry, off, need)):
                continue
            end = self._gallop(i, entry, off, need, cap)
            best_end, best_order = end, order
            best = TokenMatch(start, end, span_id, off - left)
            if self.oldest:
                self._keep(i, best, order)
        if best is not None and not self.oldest:
            self._keep(i, best, best_order)
        return wake

    def _dominated_end(self, start: int, order: int, cap: int) -> tuple[int, bool]:
        """The furthest end of a run found so far that starts at or before ``start``, from a span as preferred
        (``longest``: any; ``oldest``: one at least as old); it stops looking once that reaches ``cap``.
        Also whether the older runs alone reach ``cap`` (then they still start further left at later offsets)."""
        if self.oldest:
            k = bisect.bisect_right(self.stair_orders, order)
            end = self.stair_ends[k - 1] if k else -1
        else:
            end = self.old_max_end
        if end >= cap:
            return end, True
        for _, r_start, r_end, r_order, _ in self.recent:
            self.work += 1
            if r_start <= start and r_end > end and (not self.oldest or r_order <= order):
                end = r_end
                if end >= cap:
                    break
        return end, False

    def _equal(self, i: int, entry: _Entry, off: int, end: int) -> bool:
        """Query [i, end) equals the span from ``off`` under the hash."""
        self.work += 1
        sub = self.index.hasher.sub
        return sub(self.prefix, i, end) == sub(entry.prefix, off, off + end - i)

    def _gallop(self, i: int, entry: _Entry, off: int, lo: int, cap: int) -> int:
        """The end of the run, given that query [i, lo) matches: doubling steps, then bisection."""
        step, hi = 1, cap + 1  # hi: the first end known not to match (or past the cap)
        while lo + step <= cap:
            if not self._equal(i, entry, off, lo + step):
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        else:
            if lo == cap:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._equal(i, entry, off, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _keep(self, i: int, run: TokenMatch, order: int) -> None:
        self.runs.append(run)
        self.recent.append((i, run.start, run.end, order, run.span_id))


def same_token_ends(ids: list[int] | tuple[int, ...]) -> list[int]:
    """``out[k]``: the end of the stretch of equal tokens that holds position k."""
    out = [0] * len(ids)
    end = len(ids)
    for k in range(len(ids) - 1, -1, -1):
        if k + 1 < len(ids) and ids[k] != ids[k + 1]:
            end = k + 1
        out[k] = end
    return out
