"""The lookup sweep of ``kvrelay.server.index``: the prompt's offsets, left to right (see that module).

Also the pieces both sides share: the polynomial hash and the match record. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import heapq
import secrets
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrelay.server.index_periodic import PeriodicVisits
from kvrelay.server.index_splits import common_length

if TYPE_CHECKING:
    from kvrelay.server.index import TokenIndex, _Entry

_MOD = (1 << 61) - 1  # a Mersenne prime: hashes stay Python ints below 2**61 (they fit an int64 array)
_LEN_MASK = (1 << 32) - 1  # a holder is (span order << 32 | number of the block in the span)
_LEN_BITS = 32


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


def _group_number(group: list) -> int:
    return group[1]


class Sweep(PeriodicVisits):
    """One ``find_runs`` sweep over the query's offsets (state shared by its helpers).

    A group visited at offset ``i`` gives candidates that start at ``i - left`` with ``left < B`` (the block
    before differs from the prompt's; at ``i < B`` the prompt holds only ``i`` tokens before), so once the
    sweep reaches offset ``s + B`` every candidate starting at ``s`` is known. Candidates wait in a bucket per
    start and are settled (checked against the runs kept, extended, kept) in order of start: every run kept
    then starts at or before the candidate, so whether one contains it depends on its end alone, and one
    staircase of furthest ends answers in O(log) what a scan of the runs found near it did before.
    """

    def __init__(self, index: TokenIndex, q: list[int], namespace: str, oldest: bool,
                 cover_tokens: int | None = None) -> None:
        self.index, self.q, self.namespace, self.oldest = index, q, namespace, oldest
        # ``oldest`` only: a window whose every piece of this many tokens lies in one run of an older span is left
        # out (``TokenIndex.find_runs``)
        self.cover_tokens = cover_tokens if oldest else None
        self.prefix = index.hasher.prefix(q)
        # period -> (an offset, where the prompt's repeats of it around that offset start, where they stop)
        self.stretch_ends: dict[int, tuple[int, int, int]] = {}
        # (period, end of the prompt's stretch) -> windows given as candidates there, which recur every period
        # offsets (see ``_covered``): (start modulo the period, length, tokens before the block, span order) ->
        # the first start, and the same in order of arrival
        self.families: dict[tuple[int, int], tuple[dict, list]] = {}
        # a window found inside none of a stretch's first k families is inside none of them a period later
        self.scanned: dict[tuple[int, ...], int] = {}
        self.work = len(q)
        self.runs: list[TokenMatch] = []
        # every run kept starts at or before every candidate still to settle, so only its reach counts: the
        # furthest end (``longest``), or a staircase of (span order, furthest end of runs from spans at most
        # that old), both increasing (``oldest``: only an older or the same span contains a run)
        self.max_end = -1
        self.stair_orders: list[int] = []
        self.stair_ends: list[int] = []
        # start -> candidates waiting: (offset, left, [(span id, offset in span, order, cap, entry, whether the
        # run ends exactly at cap)])
        self.pending: dict[int, list[tuple[int, int, list]]] = {}
        self.left_of: dict[tuple[int, int], int] = {}  # (group's previous block, prompt's) -> tokens matching
        # repeated text meets the same groups at offset after offset: a group whose every member lies inside
        # the runs kept sleeps until its reach (growing a token per offset) could pass them.
        # Per block hash met: (groups awake, heap of (wake offset, tie, group) asleep); a group is
        # [previous block, group number, members in the order they are checked (filled on the first visit), period,
        # and for periodic blocks how its repeats start and what it merges] (``PeriodicVisits._block_groups``)
        self.block_state: dict[int, tuple[list, list]] = {}
        self.num_asleep = 0
        # per periodic block met: (period, (tokens before the block that go on with its period, the token that
        # breaks them) -> groups), visited alone where the prompt's repeats start with that token before them
        self.specials: dict[int, tuple[int, dict]] = {}

    def run(self) -> list[TokenMatch]:
        index, q, b = self.index, self.q, self.index.block_len
        qp, groups_of = self.prefix, index._groups
        ns_key = index.block_key(self.namespace, 0)
        power_b = index.hasher.power(b)
        pending = self.pending
        q_prev = None
        for i in range(len(q) - b + 1):
            if pending:
                ready = pending.pop(i - b, None)  # no candidate found from offset i on starts before i - B + 1
                if ready is not None:
                    self._settle(ready)
            h = (qp[i + b] - qp[i] * power_b) % _MOD  # the query's block at i
            state = self.block_state.get(h)
            if state is None:
                if ns_key is None or (ns_key | h) not in groups_of:
                    self.block_state[h] = state = ([], [])
                else:
                    groups, special = self._block_groups(groups_of.nodes(ns_key | h))
                    state = self.block_state[h] = (groups, [])
                    if special:
                        self.specials[h] = special
            awake, asleep = state
            if asleep and asleep[0][0] <= i:
                while asleep and asleep[0][0] <= i:
                    awake.append(heapq.heappop(asleep)[2])
                awake.sort(key=_group_number)  # visited in the order groups were stored, whatever slept: which of
                # equal runs of one span (a span that repeats itself) is kept does not depend on what slept
            if awake:
                still_awake = []
                for group in awake:
                    if group[0] is not None and group[0] == q_prev:
                        still_awake.append(group)
                        continue  # reaches back a whole block: found from its first block
                    self.work += 1
                    wake = self._visit(i, group, q_prev)
                    if wake > i + 1:
                        self.num_asleep += 1
                        heapq.heappush(asleep, (wake, self.num_asleep, group))
                    else:
                        still_awake.append(group)
                awake[:] = still_awake
            if h in self.specials:
                self._visit_specials(i, self.specials[h], q_prev)
            if i + 1 >= b:
                q_prev = (qp[i + 1] - qp[i + 1 - b] * power_b) % _MOD  # the block before offset i + 1
        for start in sorted(pending):
            self._settle(pending[start])
        self.index.last_work = self.work
        return sorted(self.runs, key=lambda m: (m.start, -m.num_tokens))

    def _ordered(self, group: list) -> list[tuple[str, int, int, int, int, _Entry]]:
        """The group's members as checked (see ``TokenIndex.group_holders``), listed on its first visit."""
        group[2] = self.index.group_holders(group[1], self.oldest)
        return group[2]

    def _visit(self, i: int, group: list, q_prev: int | None) -> int:
        """Candidates whose first aligned block sits at query offset ``i`` in this group's holders, to settle
        once their start is reached; returns the first offset where the group could give a run again (past
        ``i + 1`` when every member was inside the runs kept: their reach never shrinks, a member's grows by
        at most a token per offset)."""
        if group[3]:
            return self._visit_periodic(i, group, q_prev)
        if self.oldest and self.index.by_class(group[1]):
            return self._visit_split(i, group, q_prev)  # many members: by class
        ordered = group[2] or self._ordered(group)
        left = self._left(i, group[0], q_prev, ordered[0][5], ordered[0][1])
        self.work += len(ordered)
        picks = [(h, None, len(self.q)) for h in ordered]
        return self._check(i, left, picks, len(self.q))

    def _check(self, i: int, left: int, picks: list, wake: int, families: tuple | None = None) -> int:
        """Candidates of a visit at ``i`` among ``picks`` ((member, exact end or None, the last offset + 1 where
        its cap grows by at most a token per offset), those of a periodic group in span order for ``oldest``);
        returns the first offset where one could give a run again (at most ``wake``)."""
        b = self.index.block_len
        n = len(self.q)
        oldest, stair_orders, stair_ends = self.oldest, self.stair_orders, self.stair_ends
        cands = []
        # the furthest exact end of this visit's candidates so far, and its span's order: a candidate whose
        # cap it reaches is inside that run (same start), unless that is from a less preferred span (``oldest``:
        # members come in span order, so never; ``longest``: an older one, the newer span wins among equals)
        visit_end, visit_order = -1, -1
        for (span_id, off, order, tail, _, entry, _), exact_end, lasts_until in picks:
            exact = exact_end is not None
            cap = exact_end if exact else i + b + min(n - i - b, tail)
            if oldest:
                k = bisect.bisect_right(stair_orders, order)
                front = stair_ends[k - 1] if k else -1
            else:
                front = self.max_end
            if front >= cap:  # inside a run kept, which starts before any candidate from here on
                if front < n:  # no run ends past the prompt: one reaching its end covers all later ones
                    wake = min(wake, i + front - cap + 1, lasts_until)
                continue
            if visit_end > cap or (visit_end == cap and (oldest or order <= visit_order)):
                wake = i + 1
                continue  # inside a candidate of this visit
            if exact and families is not None:
                until = self._covered(i, left, order, cap, *families)
                if until is not None:  # inside a window of this stretch that recurs as long as it needs
                    wake = min(wake, until)
                    continue
            wake = i + 1
            if exact:
                visit_end, visit_order = cap, order
                if families is not None:  # a window that recurs every period (see ``_covered``)
                    (known, given), period, q_end = families
                    # one that ends with the prompt's repeats does so at each recurrence
                    key = ((i - left) % period, n if cap == q_end else cap - (i - left), left, order)
                    if key not in known:
                        known[key] = i - left
                        given.append((i - left, *key[1:]))
            cands.append((span_id, off, order, cap, entry, exact))
        if cands:
            self.pending.setdefault(i - left, []).append((i, left, cands))
        return wake

    def _left(self, i: int, prev: int | None, q_prev: int | None, entry: _Entry, off: int) -> int:
        """How many tokens before offset ``i`` match the tokens before the group's block (any member's)."""
        if prev is None:
            return 0
        # the previous block differs from the prompt's: fewer than B tokens match
        left = self.left_of.get((prev, q_prev), -1) if q_prev is not None else -1
        if left < 0:  # the same two blocks met before (repeated text) match as far as then
            q, src = self.q, entry.token_ids
            left, limit = 0, min(i, self.index.block_len)
            while left < limit and q[i - 1 - left] == src[off - 1 - left]:
                left += 1
            self.work += left
            if q_prev is not None:
                self.left_of[(prev, q_prev)] = left
        self.work += 1
        return left

    def _visit_split(self, i: int, group: list, q_prev: int | None) -> int:
        """``_visit`` for a group of many members: a candidate per class of members with one end, and the
        members that follow the prompt past the group's reference (see ``index_splits``). ``oldest`` only."""
        index, q, b, n = self.index, self.q, self.index.block_len, len(self.q)
        gid, splits = group[1], index._splits
        ref_order, ref_off = splits.ref(gid)
        ref = index.entry_of(ref_order)
        left = self._left(i, group[0], q_prev, ref, ref_off)
        split_q, probes = common_length(index.hasher, self.prefix, i + b, ref.prefix, ref_off + b,
                                        min(n - i - b, len(ref.token_ids) - ref_off - b))
        self.work += probes + 1
        token_q = q[i + b + split_q] if i + b + split_q < n else None
        found: list[tuple[int, int, int]] = []  # (order, member, cap)
        at_split_q = None  # the oldest (order, member) of the class that ends at split_q
        for point in splits.points.nodes(gid):
            self.work += 1
            split = point & _LEN_MASK
            if split < split_q:  # the prompt follows the reference further: the class ends at its split
                found.append((*self._oldest_of(point, None), i + b + split))
                continue
            skip = token_q if split == split_q else None
            if skip is not None:  # these follow the prompt past split_q: each its own candidate
                for mid in splits.at_token.nodes(splits.token_key(point, skip)):
                    self.work += 1
                    order, off, entry = self._holder(mid)
                    found.append((order, mid, i + b + min(n - i - b, len(entry.token_ids) - off - b)))
            oldest = self._oldest_of(point, skip)
            if oldest is not None and (at_split_q is None or oldest < at_split_q):
                at_split_q = oldest
        if at_split_q is not None:
            found.append((*at_split_q, i + b + split_q))
        found.sort()
        cands = []
        stair_orders, stair_ends = self.stair_orders, self.stair_ends
        for order, mid, cap in found:
            k = bisect.bisect_right(stair_orders, order)
            if k and stair_ends[k - 1] >= cap:
                continue  # inside a run kept, which starts before any candidate from here on
            _, off, entry = self._holder(mid)
            cands.append((entry.span_id, off, order, cap, entry, False))
        if cands:
            self.pending.setdefault(i - left, []).append((i, left, cands))
        return i + 1

    def _holder(self, mid: int) -> tuple[int, int, _Entry]:
        """(order, offset, span) of a member's oldest holder."""
        index = self.index
        holder = index._holders.head[mid]
        return holder >> _LEN_BITS, (holder & _LEN_MASK) * index.block_len, index.entry_of(holder >> _LEN_BITS)

    def _oldest_of(self, point: int, skip_token: int | None) -> tuple[int, int] | None:
        """The oldest (order, member) filed at a split point, less those whose token there is ``skip_token``:
        members come in order of creation, and none holds an older span than the one that created it."""
        splits, heads = self.index._splits, self.index._holders.head
        best = None
        for mid in splits.at_point.nodes(point):
            self.work += 1
            if best is not None and splits.born[mid] >= best[0]:
                break
            if skip_token is not None and splits.token[mid] == skip_token:
                continue
            order = heads[mid] >> _LEN_BITS
            if best is None or order < best[0]:
                best = (order, mid)
        return best

    def _settle(self, visits: list[tuple[int, int, list]]) -> None:
        """Check, extend and keep the candidates of one start (every run kept starts at or before it)."""
        b, oldest = self.index.block_len, self.oldest
        for i, left, cands in visits:
            best_end, best_order, best = -1, -1, None
            for span_id, off, order, cap, entry, exact in cands:
                self.work += 1
                if oldest:  # the staircase holds the runs kept from this visit's older members
                    k = bisect.bisect_right(self.stair_orders, order)
                    front = self.stair_ends[k - 1] if k else -1
                else:
                    front = self.max_end
                if front >= cap:
                    continue  # inside a run kept
                need = max(front + 1, i + b)
                if not oldest:
                    need = max(need, best_end if order > best_order else best_end + 1)
                if need > cap:
                    continue
                if exact and self._equal(i, entry, off, cap):
                    end = cap  # repeats: the run ends exactly there (``index_periodic``), one probe checks it
                elif need > i + b and not self._equal(i, entry, off, need):
                    continue
                else:
                    end = self._gallop(i, entry, off, need, cap)
                if oldest:
                    self._keep(TokenMatch(i - left, end, span_id, off - left), order)
                else:
                    best_end, best_order, best = end, order, TokenMatch(i - left, end, span_id, off - left)
            if best is not None:
                self._keep(best, best_order)

    def _keep(self, run: TokenMatch, order: int) -> None:
        self.runs.append(run)
        end = run.end
        if not self.oldest:
            self.max_end = max(self.max_end, end)
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

    def _equal(self, i: int, entry: _Entry, off: int, end: int) -> bool:
        """Query [i, end) equals the span from ``off`` under the hash."""
        self.work += 1
        power, p, qp = self.index.hasher.power(end - i), entry.prefix, self.prefix
        return (qp[end] - qp[i] * power - p[off + end - i] + p[off] * power) % _MOD == 0

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
