"""Any-offset token matching against stored spans: where does a prompt repeat stored tokens?

Pure Python, no torch. Every stored span's tokens are cut into aligned blocks of ``block_len`` tokens
(offsets 0, B, 2B, ...). A query is hashed at *every* offset, so a stored block is found wherever it
sits in the prompt, and each hit is extended left and right to the maximal common run.

How holders are kept, and why the lookup is linear. A block's holders are grouped by the block
before them (none at a span's start) and, inside a group, by everything after the block: holders
of one member (same previous block, same block, same tokens to the span's end) give the same run
against any prompt, so a member is checked once, however many spans it stands for. At query offset
``i`` the group whose previous block equals the prompt's block at ``i - B`` is skipped whole: its
runs reach back a full block, so they were found from their first block, at ``i - B`` or before.
Extensions are compared by prefix hashes (O(1) per probe), galloping from the end that would beat
the runs already found; a run contained in an earlier one (from a span at least as preferred) is
dropped. On ``n`` identical tokens this is O(n) work: each offset adds one token past the previous
run. Hashes only steer the search: ``find`` compares every run it returns token by token.

Guarantee. Every maximal run of at least ``2 * block_len - 1`` tokens that the prompt shares with any
span of the namespace is contained in a run ``find_runs`` returns (the same prompt offsets or more),
however many spans hold its blocks: such a run covers a whole aligned block of its span, its first
such block has a previous block that differs from the prompt's (or none), so its group is visited
there. The one exception is a collision of the 61-bit hash (random base per index) between different
blocks, which can hide a run but never returns a false one. Shorter runs are found when they cover an
aligned block. ``find`` then leaves no free stretch of ``max(min_tokens, 2 * block_len - 1)`` prompt
tokens that some span shares (see ``find``).

Cost. Work per lookup is O(prompt tokens * B) in the worst case over anchors, plus one O(1) check per
*distinct* member of a visited group (spans that differ after the block) and O(log) per extension;
it does not grow with the number of spans holding identical content around a block.

Everything is scoped by a namespace: a span indexed under one namespace is never returned for a
query in another.
"""

from __future__ import annotations

import bisect
import heapq
import secrets
from array import array
from collections import deque
from dataclasses import dataclass, field

MATCH_PREFERENCES = ("oldest", "longest")
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
class _Entry:
    namespace: str
    token_ids: tuple[int, ...]
    prefix: array  # PolyHash prefix hashes of token_ids
    order: int = 0  # when the span was added: older spans have smaller numbers
    keys: list[tuple[tuple[str, int], int | None, tuple[int, int]]] = field(default_factory=list)


@dataclass
class _Member:
    """Holders (span_id, offset) -> span order that share the previous block, the block and all that follows."""

    holders: dict[tuple[str, int], int] = field(default_factory=dict)

    def oldest(self) -> tuple[tuple[str, int], int]:
        return next(iter(self.holders.items()))  # insertion order is span order: no copy

    def newest(self) -> tuple[tuple[str, int], int]:
        return next(reversed(self.holders.items()))


class TokenIndex:
    """Block index of stored spans' token ids, per namespace."""

    def __init__(self, block_len: int = 16, hash_base: int | None = None) -> None:
        if not isinstance(block_len, int) or block_len <= 0:
            raise ValueError(f"block_len must be a positive integer, got {block_len!r}")
        self.block_len = block_len
        self.hasher = PolyHash(hash_base)
        self._spans: dict[str, _Entry] = {}
        self._num_added = 0
        # (namespace, block hash) -> previous block's hash (None: the span's first block)
        #   -> (hash, length) of the tokens after the block -> member
        self._groups: dict[tuple[str, int], dict[int | None, dict[tuple[int, int], _Member]]] = {}
        self.last_work = 0  # steps of the last lookup (offsets, groups, members, tokens, hash probes)
        self.num_collisions = 0  # candidate runs whose tokens differed (a hash collision): dropped

    def __contains__(self, span_id: str) -> bool:
        return span_id in self._spans

    def __len__(self) -> int:
        return len(self._spans)

    def add(self, span_id: str, token_ids: list[int] | tuple[int, ...], namespace: str = "",
            unmatchable: list[tuple[int, int]] | tuple[()] = ()) -> None:
        """Index ``token_ids`` (a span stored at position 0) under ``span_id`` (replacing it if present).

        ``unmatchable``: ranges [start, end) of the span that no run may take in (a chat prompt's
        framing); they are indexed as ids no prompt holds, so every run stops at them.
        """
        if span_id in self._spans:
            self.remove(span_id)
        ids = [int(t) for t in token_ids]
        for start, end in unmatchable:
            ids[start:end] = [-1 - i for i in range(start, min(end, len(ids)))]  # unique, never a real id
        self._num_added += 1
        entry = _Entry(namespace, tuple(ids), self.hasher.prefix(ids), self._num_added)
        b, m, sub, p = self.block_len, len(ids), self.hasher.sub, entry.prefix
        for off in range(0, m - b + 1, b):
            gkey = (namespace, sub(p, off, off + b))
            prev = sub(p, off - b, off) if off else None
            rkey = (sub(p, off + b, m), m - off - b)
            member = self._groups.setdefault(gkey, {}).setdefault(prev, {}).setdefault(rkey, _Member())
            member.holders[(span_id, off)] = entry.order
            entry.keys.append((gkey, prev, rkey))
        self._spans[span_id] = entry

    def remove(self, span_id: str) -> None:
        """Forget a span (evicted or removed from the store); unknown ids are ignored."""
        entry = self._spans.pop(span_id, None)
        if entry is None:
            return
        for k, (gkey, prev, rkey) in enumerate(entry.keys):
            groups = self._groups[gkey]
            members = groups[prev]
            members[rkey].holders.pop((span_id, k * self.block_len), None)
            if not members[rkey].holders:
                del members[rkey]
                if not members:
                    del groups[prev]
                    if not groups:
                        del self._groups[gkey]

    def token_ids(self, span_id: str) -> tuple[int, ...]:
        return self._spans[span_id].token_ids

    # ------------------------------------------------------------------ lookup
    def find_runs(self, token_ids: list[int] | tuple[int, ...], namespace: str = "",
                  prefer: str = "longest") -> list[TokenMatch]:
        """Candidate runs, in order of query start (then longest first): maximal runs shared with spans of
        ``namespace`` that cover an aligned block of the span, less those contained in another candidate
        from a span at least as preferred (``prefer="longest"``: any span; ``"oldest"``: the same span).

        Each is the maximal run of its span on its diagonal; a run held by several spans names the newest
        (``"longest"``) or the oldest (``"oldest"``) of them. Runs are equal under the index's hash;
        ``find`` checks tokens. See the module docstring for the guarantee."""
        if prefer not in MATCH_PREFERENCES:
            raise ValueError(f"prefer must be one of {MATCH_PREFERENCES}, got {prefer!r}")
        return _Lookup(self, list(token_ids), namespace, prefer == "oldest").run()

    def find(self, token_ids: list[int] | tuple[int, ...], namespace: str = "", min_tokens: int = 16,
             covered: list[tuple[int, int]] | None = None, prefer: str = "longest") -> list[TokenMatch]:
        """Non-overlapping runs shared with stored spans, each at least ``min_tokens`` long, in query order.

        Greedy over ``find_runs``: by length (``prefer="longest"``; ties: earlier query start, then newer
        span), or from the oldest span first (``prefer="oldest"``: a text is taken where it was first
        stored, then by length). A run overlapping one already taken (or a ``covered`` query range, e.g.
        the exact prefix or a chat prompt's framing) keeps its longest free piece, and its other free
        pieces go back in line. Every run returned is checked token by token.

        What is left: no candidate keeps a free piece of ``min_tokens`` or more, so (by the guarantee) no
        free stretch of ``max(min_tokens, 2 * block_len - 1)`` tokens outside ``covered`` is shared with
        any span of the namespace.
        """
        runs = self.find_runs(token_ids, namespace, prefer)
        q = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)

        def rank(m: TokenMatch, k: int) -> tuple[int, ...]:
            order = self._spans[m.span_id].order
            return (order, -m.num_tokens, m.start, k) if prefer == "oldest" else (-m.num_tokens, m.start, -order, k)

        taken = _merged(covered or [])
        chosen: list[TokenMatch] = []
        line = [(rank(m, k), m) for k, m in enumerate(runs)]
        heapq.heapify(line)
        while line:
            (*_, k), run = heapq.heappop(line)
            pieces = [p for p in _free_pieces(run.start, run.end, taken) if p[1] - p[0] >= min_tokens]
            if not pieces:
                continue
            longest = max(pieces, key=lambda p: p[1] - p[0])  # the first of equals
            for start, end in pieces:
                piece = TokenMatch(start, end, run.span_id, run.src_start + (start - run.start))
                if (start, end) != longest:
                    heapq.heappush(line, (rank(piece, k), piece))
                elif q[start:end] != self._spans[run.span_id].token_ids[piece.src_start:piece.src_start + end - start]:
                    self.num_collisions += 1  # equal hashes, different tokens: never returned
                else:
                    chosen.append(piece)
                    bisect.insort(taken, (start, end))
        return sorted(chosen, key=lambda m: m.start)


class _Lookup:
    """One ``find_runs`` sweep over the query's offsets (state shared by its helpers)."""

    def __init__(self, index: TokenIndex, q: list[int], namespace: str, oldest: bool) -> None:
        self.index, self.q, self.namespace, self.oldest = index, q, namespace, oldest
        self.prefix = index.hasher.prefix(q)
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
        # the older runs' reach sleeps until its reach (growing a token per offset) could pass them; a block
        # whose groups all sleep (the prompt's previous block unchanged) is skipped whole
        self.group_asleep: dict[tuple[int, int | None], int] = {}
        self.block_asleep: dict[int, tuple[int, int | None]] = {}

    def run(self) -> list[TokenMatch]:
        index, q, b = self.index, self.q, self.index.block_len
        qp, groups_of, namespace = self.prefix, index._groups, self.namespace
        power_b = index.hasher.power(b)
        q_prev = None
        for i in range(len(q) - b + 1):
            h = (qp[i + b] - qp[i] * power_b) % _MOD  # the query's block at i
            groups = groups_of.get((namespace, h))
            asleep = self.block_asleep.get(h)
            if groups and (asleep is None or asleep[0] <= i or asleep[1] != q_prev):
                while self.recent and self.recent[0][0] <= i - b:
                    self._retire(*self.recent.popleft()[2:4])
                block_wake = len(q)
                for prev, members in groups.items():
                    if prev is not None and prev == q_prev:
                        continue  # reaches back a whole block: found from its first block
                    wake = self.group_asleep.get((h, prev), 0)
                    if wake <= i:
                        self.work += 1
                        wake = self._visit(i, prev, q_prev, members)
                        if wake > i + 1:
                            self.group_asleep[(h, prev)] = wake
                    block_wake = min(block_wake, wake)
                if block_wake > i + 1:  # while the prompt's previous block stays the same
                    self.block_asleep[h] = (block_wake, q_prev)
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
        if len(members) == 1:
            ordered = [next(iter(members.values())).oldest() if self.oldest else next(iter(members.values())).newest()]
        elif self.oldest:
            ordered = sorted((m.oldest() for m in members.values()), key=lambda h: h[1])
        else:
            ordered = [m.newest() for m in members.values()]
        best_end, best_order, best = -1, -1, None
        wake = len(q)
        for (span_id, off), order in ordered:
            self.work += 1
            entry = spans[span_id]
            cap = i + b + min(len(q) - i - b, len(entry.token_ids) - off - b)
            front, lasting = self._dominated_end(start, order, cap)
            wake = min(wake, i + front - cap + 1 if lasting else i + 1)
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


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint union of ``ranges`` (empty ones dropped)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


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
