"""Blocks that repeat inside themselves (``abab...``, a repeated table row): their period, and how far it goes on.

A block of ``B`` tokens has period ``p < B`` when each token equals the one ``p`` before it. Two equal blocks of
period ``p``, one in the prompt at ``i`` and one in a span at ``off``, go on matching exactly while both go on
repeating with period ``p``: a token ``j >= B`` after the block is the one ``p`` before it, on both sides, and
those matched already. So when the span's repeats stop ``a`` tokens after its block and the prompt's ``a_q``:

- ``a < a_q``: the run ends exactly at ``i + B + a`` (the span breaks the period, the prompt does not);
- ``a > a_q``: it ends exactly where the prompt's repeats stop;
- ``a == a_q``: both break there; the run goes on only if the tokens that break it are equal.

That is the period-1 rule (a run of one repeated token ends where the shorter side's repeats stop) for any
period below a block. Per member the index keeps ``a`` and the token that breaks the period (``END``: the span
ends first); per group its block's period (every member has the same block). Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from kvrelay.server import index_break
from kvrelay.server.index_break import GoingOn
from kvrelay.server.index_splits import END, common_length

__all__ = ["PeriodicVisits", "block_periods", "smallest_period"]


def smallest_period(ids: list[int] | tuple[int, ...], start: int, block_len: int) -> int:
    """The smallest period of ``ids[start:start + block_len]`` below ``block_len``, or 0 (none): prefix function."""
    fail = [0] * block_len
    k = 0
    for j in range(1, block_len):
        t = ids[start + j]
        while k and ids[start + k] != t:
            k = fail[k - 1]
        if ids[start + k] == t:
            k += 1
        fail[j] = k
    period = block_len - fail[-1]
    return period if period < block_len else 0


def block_periods(ids: list[int] | tuple[int, ...], block_len: int) -> list[tuple[int, int, int]]:
    """Per aligned block: (period, tokens after the block that go on with it, the token that breaks it or END);
    (0, -1, END) for a block with no period below ``block_len``. Linear: aligned blocks in one stretch of a period
    share its end (their overlap is longer than the period), so each stretch is walked once."""
    out = []
    m, b = len(ids), block_len
    last_period, last_end = 0, -1
    for off in range(0, m - b + 1, b):
        p = smallest_period(ids, off, b)
        if not p:
            out.append((0, -1, END))
            continue
        if p == last_period and last_end >= off + b:
            end = last_end
        else:
            end = off + b
            while end < m and ids[end] == ids[end - p]:
                end += 1
        last_period, last_end = p, end
        out.append((p, end - off - b, ids[end] if end < m else END))
    return out


def _order(holder: tuple) -> int:
    return holder[2]


class PeriodicVisits:
    """The sweep's visits to groups whose block has a period below a block (``index_sweep.Sweep`` holds the state).

    Inside a stretch of the prompt that repeats with period ``p``, a group met at ``i`` is met again at ``i + p``,
    ``i + 2p``, ...: the same members give the same windows shifted by ``p`` (a window starts where the span's
    repeats start, when the prompt's start earlier, and ends where the shorter side's stop). So a window given once
    recurs at every shift whose block still lies in the stretch, and a window inside a shift of it (from a span at
    least as preferred) stays inside the same shift of each later one: its group sleeps until the stretch ends, or
    until one of its members' repeats stop with the prompt's (whose next tokens may then match).

    Runs start likewise where the side whose repeats start later breaks first, so groups whose spans start their
    repeats equally far before the block are visited as one, whatever their context (``_block_groups``): a
    stretch of the prompt costs a visit or a few per such distance, not per context.
    """

    def _stretch(self, period: int, i: int) -> tuple[int, int]:
        """The prompt's stretch of ``period`` around the block at ``i`` (which has that period): (start, end), where
        each token of [start + period, end) equals the one ``period`` before it."""
        b, n = self.index.block_len, len(self.q)
        first, start, end = self.stretch_ends.get(period, (-1, -1, -1))
        if first <= i and i + b <= end:  # the same stretch: its blocks overlap by more than the period
            return start, end
        hasher, qp = self.index.hasher, self.prefix
        k, probes = common_length(hasher, qp, i + b, qp, i + b - period, n - i - b)
        # backwards: the longest common suffix of q[:i + b] and q[:i + b - period], doubling then bisecting
        sub, a, c = hasher.sub, i + b, i + b - period
        lo, step, hi = 0, 1, c + 1
        while lo + step <= c:
            probes += 1
            if sub(qp, a - lo - step, a) != sub(qp, c - lo - step, c):
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        else:
            hi = lo + 1 if lo == c else c + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            probes += 1
            if sub(qp, a - mid, a) == sub(qp, c - mid, c):
                lo = mid
            else:
                hi = mid
        self.work += probes + 1
        self.stretch_ends[period] = (i, c - lo, i + b + k)
        return c - lo, i + b + k

    def _block_groups(self, group_ids: Iterator[int]) -> tuple[list, tuple[int, dict] | None]:
        """The groups of a block met for the first time, as the sweep visits them, and its groups to visit alone.

        A group is [previous block, number, view, period, ``back``, merged group numbers or None]. A group of a
        periodic block whose previous block does not go on with the period all the way (its spans start their
        repeats in a context of their own) is merged with every such group whose repeats start as many tokens
        before the block (``back``): against a prompt stretch starting at ``q_start`` their runs start at
        ``i - min(back, i - q_start)`` (the side whose repeats start later breaks first), unless the token before
        the span's repeats equals the prompt's, which matters only at ``i = q_start + back``. So the merged group
        gives exactly the runs its groups would there (its runs are real; one that goes further left is found by
        its group alone), and such a group is also kept by (back, that token), to be visited alone there.
        Returns (groups, (period, groups by (back, token)) or None)."""
        index, b = self.index, self.index.block_len
        groups, merged, special = [], {}, {}
        period = 0
        for gid in group_ids:
            prev, period = index.group_prev(gid), index.group_period(gid)
            group = [prev, gid, None, period, 0, None]
            if not period:
                groups.append(group)
                continue
            back = 0
            if prev is not None:
                _, off, entry = self._holder(index._group_members.head[gid])
                src = entry.token_ids
                while back < b and src[off - 1 - back] == src[off - 1 - back + period]:
                    back += 1
                self.work += back + 1
                group[4] = back
                if back == b:  # inside stored repeats: skipped where the prompt's go back a block too
                    groups.append(group)
                    continue
                special.setdefault((back, src[off - 1 - back]), []).append(gid)
            pseudo = merged.get(back)
            if pseudo is None:
                pseudo = merged[back] = [None, gid, None, period, back, [], 0]
                groups.append(pseudo)
            pseudo[5].append(gid)
        return groups, ((period, special) if special else None)

    def _visit_specials(self, i: int, specials: tuple[int, dict], q_prev: int | None) -> None:
        """Visit alone the groups whose repeats start ``i - q_start`` tokens before the block after the token the
        prompt's start after: their runs go further left than their merged group's."""
        period, special = specials
        q_start, _ = self._stretch(period, i)
        back, b = i - q_start, self.index.block_len
        if not q_start or back >= b:
            return
        key = (back, self.q[q_start - 1])
        tree = special.get(key)
        if tree is None:
            return
        if isinstance(tree, list):  # first met: its groups by how far their contexts go, as hashes of their ends
            tree = special[key] = self._context_tree(tree, back)
        sub, qp = self.index.hasher.sub, self.prefix
        for reach in range(1, min(b - back, q_start + 1)):
            self.work += 1
            context = (reach, sub(qp, q_start - reach, q_start))
            node = tree.get(context)
            if node is None:
                return
            if node[0] is not None:  # first met: its groups (numbers), merged
                node = tree[context] = [None, node[0], None, period, back, node, reach]
            self.work += 1
            self._visit_periodic(i, node, q_prev)

    def _context_tree(self, group_ids: list[int], back: int) -> dict:
        """(tokens of context, hash of them) -> the groups whose context ends so, for groups whose repeats start
        ``back`` tokens before the block after the same token."""
        index, b = self.index, self.index.block_len
        sub, tree = index.hasher.sub, {}
        for gid in group_ids:
            _, off, entry = self._holder(index._group_members.head[gid])
            p = entry.prefix
            for reach in range(1, b - back):  # as far as the tokens before its repeats could match the prompt's
                tree.setdefault((reach, sub(p, off - back - reach, off - back)), []).append(gid)
            self.work += b - back
        return tree

    def _periodic_view(self, group: list) -> tuple:
        """A periodic group's members as checked (``oldest``: in span order; else newest first), the members
        that go on with the period further than every one before them (their extensions increase), the members
        by extension, by extension and the token that breaks the period, and each such token's extensions
        (sorted); listed on its first visit."""
        if group[5] is not None and len(group[5]) > 1:  # merged groups (``_block_groups``)
            ordered = [h for gid in group[5] for h in self.index.group_holders(gid, self.oldest)]
            if self.oldest:
                ordered.sort(key=_order)
        else:
            ordered = self.index.group_holders(group[1], self.oldest)
        if not self.oldest:
            ordered.sort(key=_order, reverse=True)
        self.work += len(ordered)
        rec_after, rec_k, by_after, by_break, afters_of = [], [], {}, {}, {}
        best = -2
        for k, h in enumerate(ordered):
            after = h[4]
            same = by_after.get(after)
            if same is None:
                by_after[after] = [k]
            else:
                same.append(k)
            key = (after, h[6])
            same = by_break.get(key)
            if same is None:
                by_break[key] = [k]
                afters_of.setdefault(h[6], []).append(after)
            else:
                same.append(k)
            if after > best:
                best = after
                rec_after.append(after)
                rec_k.append(k)
        for afters in afters_of.values():
            afters.sort()
        # per extension, the first member whose break token differs from the first one's (``_first_stopping``)
        other = {}
        for after, ks in by_after.items():
            first_break = ordered[ks[0]][6]
            other[after] = next((k for k in ks if ordered[k][6] != first_break), None)
        group[2] = (ordered, rec_after, rec_k, by_after, by_break, afters_of, other, {})
        return group[2]

    def _visit_periodic(self, i: int, group: list, q_prev: int | None) -> int:
        """``_visit`` for a group whose block has a period below a block: runs end where the shorter side's
        repeats stop (``index_periodic``), so only members no earlier one (in preference) outreaches are checked,
        the first that outreaches the prompt's repeats, and those that stop with them and have the prompt's next
        token (they go on past them).

        While the run starts where the prompt's repeats do (``left = i - q_start``, below the tokens before the
        block that go on with the period), each further offset gives each member the same run, as long or
        longer: only members that go on past the prompt's repeats are checked, until the last such offset."""
        q, b, n = self.q, self.index.block_len, len(self.q)
        view = group[2] or self._periodic_view(group)
        ordered, rec_after, rec_k, by_after, by_break, afters_of, _, _ = view
        period = group[3]
        q_start, q_end = self._stretch(period, i)
        if group[5] is not None:  # merged: the side whose repeats start later breaks first (``_block_groups``)
            left = min(group[4], i - q_start) + group[6]
            self.work += 1
        else:
            left = self._left(i, group[0], q_prev, ordered[0][5], ordered[0][1])
        q_after = q_end - i - b
        token = q[q_end] if q_end < n else None
        # offsets to wake at: where the next member with the prompt's next token stops with the prompt's repeats
        # (it goes on past them); the block leaves the stretch at q_end - b + 1
        afters = afters_of.get(token, ()) if token is not None else ()
        j = bisect.bisect_left(afters, q_after)
        wake = q_end - b - afters[j - 1] if j else q_end - b + 1
        picks = self._going_on(view, q_after, token, q_end) if token is not None else []
        if left == i - q_start < group[4]:
            last = i + period * min((q_start + group[4] - i) // period, (q_end - b - i) // period)
            if last > i:  # the same runs, as long or longer, at ``last``: until then only those that go on
                self.work += len(picks) + 1
                if picks:
                    self._check(i, left, picks, n)
                return min(wake, last)
        below = bisect.bisect_left(rec_after, q_after)  # records that stop before the prompt's repeats do
        if self.oldest:
            picks += [(ordered[rec_k[r]], i + b + rec_after[r], q_end - b - rec_after[r]) for r in range(below)]
        elif below == len(rec_after):
            picks.append((ordered[rec_k[-1]], i + b + rec_after[-1], q_end - b - rec_after[-1]))
        # every other member that repeats as far as the prompt ends with its repeats: the first one (the others
        # give the same run from a span no more preferred), either the first going further or one stopping there
        over = bisect.bisect_right(rec_after, q_after)
        first = rec_k[over] if over < len(rec_after) else len(ordered)
        stops = self._first_stopping(view, q_after, token)
        if stops is not None and stops < first:
            first = stops
        if first < len(ordered):
            picks.append((ordered[first], q_end, q_end - b + 1))
        if self.oldest and len(picks) > 1:
            picks.sort(key=lambda pick: pick[0][2])
        self.work += len(picks) + 1
        if not self.oldest:  # ``longest``: where the picks change (a record's repeats stop with the prompt's):
            # then its run ends where the prompt's repeats do, as a newer span's may, which is preferred
            j = bisect.bisect_left(rec_after, q_after)
            if j:
                wake = min(wake, q_end - b - rec_after[j - 1])
        if i - left <= q_start:  # the prompt's repeats start inside the run: no window recurs a period later
            return self._check(i, left, picks, wake)
        families = self.families.get((period, q_end))
        if families is None:
            families = self.families[period, q_end] = ({}, [])
        return self._check(i, left, picks, wake, (families, period, q_end))

    def _first_stopping(self, view: tuple, q_after: int, token: int | None) -> int | None:
        """The first member (in the order checked) whose repeats stop with the prompt's and whose break token is
        not the prompt's ``token`` (its run ends with the prompt's repeats), or None."""
        ordered, by_after, other = view[0], view[3], view[6]
        ks = by_after.get(q_after)
        self.work += 1
        if not ks:
            return None
        return ks[0] if token is None or ordered[ks[0]][6] != token else other[q_after]

    def _going_on(self, view: tuple, q_after: int, token: int, q_end: int) -> list:
        """Picks among the members whose repeats stop with the prompt's and whose break token is the prompt's: they
        go on past the stretch, and only those whose runs a visit keeps are checked (``index_break``)."""
        ordered, goes_on, n = view[0], view[4].get((q_after, token), ()), len(self.q)
        if len(goes_on) < index_break.BREAK_SORT_MIN_MEMBERS:
            return [(ordered[k], None, n) for k in goes_on]
        index = self.index
        bucket = view[7].get((q_after, token))
        if bucket is None:  # first met in this lookup: sorted by the tokens after the break
            bucket = view[7][q_after, token] = GoingOn([ordered[k] for k in goes_on], index.block_len, index.hasher)
            self.work += bucket.work
        bucket.work = 0
        members = bucket.picks(index.hasher, self.prefix, self.q, q_end + 1, self.oldest)
        self.work += bucket.work
        return [(h, None, n) for h in members]

    def _covered(self, i: int, left: int, order: int, end: int, families: tuple, period: int, q_end: int) -> int | None:
        """Whether an exact window of a periodic member lies inside a window already given in this stretch, by
        a span at least as preferred, shifted by whole periods: then the first offset where that no longer holds
        (else None). A window given at ``i_f`` recurs at every ``i_f + k * period`` whose block still lies in the
        stretch (its group is met there), so a window inside one shift of it stays inside the same shift of
        each later one."""
        b, oldest, cover = self.index.block_len, self.oldest, self.cover_tokens
        start, need = i - left, end - (i - left)
        given = families[1]
        key = (period, q_end, start % period, need, left, order)
        first = self.scanned.get(key, 0)  # the same window a period later: its shifts and reach are the same
        for f_start, f_length, f_left, f_order in given[first:]:
            self.work += 1
            if f_start > start:
                continue
            shift = (start - f_start) % period
            f_at = start - shift + f_left  # the offset of the shifted window's block
            if f_at > q_end - b:
                continue
            reach = min(f_length - shift, q_end - start)  # its windows stop where the prompt's repeats do
            if (oldest and f_order < order and reach >= need) or (
                    not oldest and (reach > need or (reach == need and f_order > order))):
                return q_end - b - (f_at - i) + 1
            if cover is not None and f_order < order and f_length >= cover + period - 1:
                # the family's windows overlap by ``cover`` tokens or more from one shift to the next, so every
                # piece of ``cover`` tokens in [f_start, f_end) lies inside one of them, where ``f_end`` is the end
                # of the last shift whose block lies in the stretch
                last = f_start + (q_end - b - f_left - f_start) // period * period
                f_end = min(last + f_length, q_end)
                if end <= f_end:  # a period later this window ends ``period`` tokens further (or at q_end)
                    return q_end - b + 1 if f_end == q_end else i + (f_end - end) // period * period + 1
        self.scanned[key] = len(given)
        return None
