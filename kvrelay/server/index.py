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
the runs already kept. A candidate starts less than B tokens before the offset where it is met, so
candidates wait in a bucket per start and are settled B offsets later in order of start: every run
kept then starts at or before the candidate, and whether one contains it (from a span at least as
preferred) is one look-up in a staircase of furthest ends, not a scan. A group whose members all lie
inside the kept runs' reach sleeps until its own reach (a token more per offset at most) could pass them.
Hashes only steer the search: ``find`` compares every run it returns token by token.

Repeated text (``index_periodic``): a block with a period ``p`` below B (one token repeated, ``abab``, a
table's rule line) matches an equal block of a span exactly as far as the shorter side's repeats go: the
run ends where the span's repeats stop, or where the prompt's do, or, when both stop at once, as far as the
tokens after them agree, and it starts likewise where the side whose repeats start later breaks first. So a
group whose previous block breaks the period ``back`` tokens before the block gives, in a prompt stretch
starting at ``q_start``, runs starting at ``i - min(back, i - q_start)``, whatever its context, unless the
context's last token is the prompt's before the stretch (then only at ``i = q_start + back``, further left):
the groups of one block with one ``back`` are visited as one merged group, and those whose context matches
the prompt's ``d`` tokens before the stretch as one more merged group per ``d``, found by hashing those
tokens at that offset. Members keep how far their repeats go past the block, so a visit checks only the
members that go further than every more preferred one, the first that repeats as far as the prompt's, and
those that stop with the prompt's and have its next token (they go on). While a run starts where the
prompt's repeats do, each next offset gives each member a run as long or longer, so until the last such
offset only members that go on are checked. Inside a stretch, a group met at ``i`` is met again every ``p``
offsets and gives the same windows shifted by ``p``: a window given once recurs at each shift whose block
lies in the stretch, so a member whose window lies inside a shift of one (from a span at least as preferred)
lies inside the same shift of each later one, and its group sleeps until the stretch ends, one of its members
would go on past it, or (``longest``) its picks change.

Guarantee. Every maximal run of at least ``2 * block_len - 1`` tokens that the prompt shares with any
span of the namespace is contained in a run ``find_runs`` returns (the same prompt offsets or more),
however many spans hold its blocks: such a run covers a whole aligned block of its span, its first
such block has a previous block that differs from the prompt's (or none), so its group is visited
there, or sleeps because all its runs lie inside runs already found (on repeated text: inside shifts of
windows given in the stretch, each kept or inside a kept run of a span at least as preferred, by induction
on preference; a member skipped at a visit ends no further than a more preferred one). On repeated text its
group is visited as part of a merged group that gives each member's run as its own group would, except where
the context matches the prompt's further left: there the merged group's run is real but shorter, and the
merged group of the matching depth gives the whole run; a run skipped while the runs start with the prompt's
repeats lies inside the same member's run at the last such offset. The one exception is a collision of the
61-bit hash (random base per index) between different blocks or contexts, which can hide a run or return a
false one, which ``find`` drops. Shorter runs are found when they cover an aligned block. ``find`` then leaves
no free stretch of ``max(min_tokens, 2 * block_len - 1)`` prompt tokens that some span shares.

Cost (``last_work`` counts it: offsets, groups visited, members checked, tokens compared, hash
probes, candidates settled). Per offset: one hash and one dict lookup. Per visited group: at most B
token comparisons (once per pair of previous blocks). Per member checked: O(log) (a staircase look-up),
and O(1) probes per candidate settled, O(log) per run kept. Spans identical around a block and after it
are one member and do not count. Spans that share a block and the one before it but differ later are
members of one group; a group of ``SPLIT_MIN_MEMBERS`` or more (spans that open with one system prompt) is
visited by class (``index_splits``, ``prefer="oldest"``, not on a block of one repeated token): one hash
search, a look-up per distinct point where its members leave the group's reference, and the members that
follow the prompt past it, so spans sharing a passage cost what a few do (with ``"longest"`` each member is
still checked: linear in their number per occurrence). What still counts: the groups awake at an offset,
i.e. the distinct contexts in which stored spans start the text the prompt repeats, and the runs returned.
On text repeating with a period below a block, contexts cost once per lookup (each periodic group is listed
with O(B) hashes of its context, each member once), and a stretch of the prompt costs O(B) merged groups
(one per ``back``, and one per ``d`` some context matches), each visited at its first offset, at the last
where its runs start with the prompt's repeats, and where a member goes on or (``longest``) its picks change,
plus the runs returned (``prefer="oldest"``: a window from each span whose repeats no older span's
outreach; with ``find``'s cover mode, about one, the oldest span's whose windows overlap by ``min_tokens``):
many separate stretches against 1,000 contexts cost 14 a token, not stretches x contexts. Members whose repeats
stop with the prompt's and go on with its break token (stored lines ended as the prompt's are) are sorted once per
lookup by what follows the break (``index_break``): a visit checks only those whose runs it keeps, O(log m) for
``m`` such members (1,000 lines in one place each: 6 a token, as at 300). Not bounded: such lines of varied length
and context are spread over the merged groups (one per ``back``), each woken at every extension its members have
in a stretch, so the visits grow with the spans until they fill the stretch (at most B + 1 groups an offset, each
O(log m)): 36 a token at 300 spans, 60 at 1,000, 129 at 10,000. And a period of B or more (a repeated line longer
than a block), where runs are extended as on any text, so each offset may check every span that holds the line.

Storage, and the garbage collector. Python's cyclic collector walks every object it tracks at each full
collection, and one lands in whatever lookup or decode step crosses its threshold: with a container or two per
block, 10,000 stored spans of 1K tokens were 2M tracked objects and a 0.6 s pause. So nothing per block is a
container: groups, members and holders are numbered, their keys packed into single ints (namespace number
and block hash; that and the previous block's hash; group number, hash and length of what follows), and each
list of them (a block's groups, a group's members, a member's holders) is linked through dicts of ints
(``IntLists``). A dict whose keys and values are all ints is never tracked, so a collection does not see
them. Per span the collector tracks two objects (its entry and its prefix hashes); the token tuple is
untracked at the next collection.

Everything is scoped by a namespace: a span indexed under one namespace is never returned for a
query in another.
"""

from __future__ import annotations

from array import array

from kvrelay.server import index_choose, index_splits
from kvrelay.server.index_periodic import block_periods
from kvrelay.server.index_splits import END, Splits, common_length
from kvrelay.server.index_sweep import _MOD, PolyHash, Sweep, TokenMatch
from kvrelay.server.int_lists import IntLists

__all__ = ["MATCH_PREFERENCES", "PolyHash", "TokenIndex", "TokenMatch"]

MATCH_PREFERENCES = ("oldest", "longest")

NO_PREV = _MOD  # "no previous block" (a span's first block): no hash equals it (hashes are below _MOD)
_BITS = 61  # a block hash, a previous block's hash (or NO_PREV) and a namespace's number fit in this many bits
_HASH_MASK = (1 << _BITS) - 1
_LEN_BITS = 32  # a span's length, and the number of a block in it
_LEN_MASK = (1 << _LEN_BITS) - 1


class _Entry:
    """A stored span. With its prefix hashes, the only objects per span that the garbage collector tracks."""

    __slots__ = ("span_id", "namespace", "token_ids", "prefix", "order", "member_ids")

    def __init__(self, span_id: str, namespace: str, token_ids: tuple[int, ...], prefix: array, order: int) -> None:
        self.span_id, self.namespace, self.token_ids, self.prefix = span_id, namespace, token_ids, prefix
        self.order = order  # when the span was added: older spans have smaller numbers
        self.member_ids: tuple[int, ...] = ()  # the member of each aligned block, in span order


class TokenIndex:
    """Block index of stored spans' token ids, per namespace."""

    def __init__(self, block_len: int = 16, hash_base: int | None = None) -> None:
        if not isinstance(block_len, int) or block_len <= 0:
            raise ValueError(f"block_len must be a positive integer, got {block_len!r}")
        self.block_len = block_len
        self.hasher = PolyHash(hash_base)
        self._spans: dict[str, _Entry] = {}
        self._by_order: dict[int, _Entry] = {}
        self._num_added = 0
        # Per block, nothing the garbage collector tracks: dicts whose keys and values are all ints (which it
        # never tracks, and never walks), lists of ints linked through such dicts. Keys pack their parts in
        # one int; groups and members are numbered, in order of creation.
        # namespace -> its number while it holds a span (numbers are never reused: a key of a forgotten
        # namespace never meets a new one's), and how many spans it holds
        self._namespace_ids: dict[str, int] = {}
        self._namespace_spans: dict[str, int] = {}
        self._num_namespaces = 0
        # block key (namespace number, block hash) -> its groups, in the order they were first stored
        self._groups = IntLists()
        # group key (block key, previous block's hash or NO_PREV) <-> group number
        self._group_ids: dict[int, int] = {}
        self._group_keys: dict[int, int] = {}
        self._group_members = IntLists()  # group -> its members, in the order they were first stored
        # member key (group, hash and length of the tokens after the block) <-> member number
        self._member_ids: dict[int, int] = {}
        self._member_keys: dict[int, int] = {}
        # group -> its block's period below block_len (``index_periodic``; absent: none)
        self._group_period: dict[int, int] = {}
        # member of such a group -> how many tokens after the block go on with its period, and the token that
        # breaks it (END: the span ends first); set by the block and what follows it, so the same for every holder
        self._period_after: dict[int, int] = {}
        self._period_break: dict[int, int] = {}
        # member -> its holders (span order, number of the block in the span), oldest span first; a span
        # holds a member once (the length after the block is in its key)
        self._holders = IntLists()
        self._group_sizes: dict[int, int] = {}  # group -> its number of members
        # per group of SPLIT_MIN_MEMBERS members or more (once), where each member leaves the group's reference
        # (``index_splits``), and the removed spans still some group's reference (their tokens define where
        # its members leave it)
        self._splits = Splits()
        self._ghosts: dict[int, _Entry] = {}
        self._num_groups = self._num_members = 0
        self.last_work = 0  # steps of the last lookup (offsets, groups, members, tokens, hash probes)
        self.num_collisions = 0  # candidate runs whose tokens differed (a hash collision): dropped

    def __contains__(self, span_id: str) -> bool:
        return span_id in self._spans

    def __len__(self) -> int:
        return len(self._spans)

    def block_key(self, namespace: str, block_hash: int) -> int | None:
        """The key of a block of ``namespace`` (None: the namespace never held a span)."""
        ns = self._namespace_ids.get(namespace)
        return None if ns is None else ns << _BITS | block_hash

    def entry_of(self, order: int) -> _Entry:
        """The span added as ``order`` (a removed one while it is some group's reference)."""
        entry = self._by_order.get(order)
        return entry if entry is not None else self._ghosts[order]

    def by_class(self, group_id: int) -> bool:
        """Whether a group's members are filed by where they leave its reference (it is visited by class)."""
        return group_id in self._splits.refs

    def group_prev(self, group_id: int) -> int | None:
        """The hash of the block before a group's block (None: the spans' first block)."""
        prev = self._group_keys[group_id] & _HASH_MASK
        return None if prev == NO_PREV else prev

    def group_period(self, group_id: int) -> int:
        """The period of a group's block below block_len, or 0 (none)."""
        return self._group_period.get(group_id, 0)

    def group_holders(self, group_id: int, oldest: bool) -> list[tuple[str, int, int, int, int, _Entry, int]]:
        """A group's members: (span id, offset of the block in it, span order, tokens after the block, tokens after
        it that go on with the block's period or -1, span, the token that breaks the period) of each member's oldest
        holder (``oldest``: in span order) or newest (in the order the members were first stored)."""
        ends = self._holders.head if oldest else self._holders.tail
        by_order, following = self._by_order, self._group_members.next
        after, breaks = self._period_after, self._period_break
        b = self.block_len
        out = []
        mid = self._group_members.head.get(group_id)
        while mid is not None:
            holder = ends[mid]
            entry = by_order[holder >> _LEN_BITS]
            off = (holder & _LEN_MASK) * b
            out.append((entry.span_id, off, entry.order, len(entry.token_ids) - off - b, after.get(mid, -1), entry,
                        breaks.get(mid, END)))
            mid = following.get(mid)
        if oldest:  # members come in order of their first holder: sorted, unless an oldest holder was removed
            out.sort(key=lambda h: h[2])
        return out

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
        if len(ids) > _LEN_MASK:
            raise ValueError(f"a span holds at most {_LEN_MASK} tokens, got {len(ids)}")
        self._num_added += 1
        entry = _Entry(span_id, namespace, tuple(ids), self.hasher.prefix(ids), self._num_added)
        ns = self._namespace_ids.get(namespace)
        if ns is None:
            ns = self._namespace_ids[namespace] = self._num_namespaces
            self._num_namespaces += 1
        self._namespace_spans[namespace] = self._namespace_spans.get(namespace, 0) + 1
        b, m, sub, p = self.block_len, len(ids), self.hasher.sub, entry.prefix
        periods = block_periods(ids, b)
        member_ids = []
        self._by_order[entry.order] = entry  # a group opened here takes it as its reference
        for off in range(0, m - b + 1, b):
            bkey = ns << _BITS | sub(p, off, off + b)
            gkey = bkey << _BITS | (sub(p, off - b, off) if off else NO_PREV)
            gid = self._group_ids.get(gkey)
            if gid is None:
                gid = self._group_ids[gkey] = self._num_groups
                self._num_groups += 1
                self._group_keys[gid] = gkey
                self._groups.append(bkey, gid)
                self._group_sizes[gid] = 0
                if periods[off // b][0]:
                    self._group_period[gid] = periods[off // b][0]
            mkey = (gid << _BITS | sub(p, off + b, m)) << _LEN_BITS | (m - off - b)
            mid = self._member_ids.get(mkey)
            if mid is None:
                mid = self._member_ids[mkey] = self._num_members
                self._num_members += 1
                self._member_keys[mid] = mkey
                period, after, breaker = periods[off // b]
                if period:
                    self._period_after[mid], self._period_break[mid] = after, breaker
                self._group_members.append(gid, mid)
                self._group_sizes[gid] += 1
                if gid in self._splits.refs:
                    self._file(gid, mid, entry, off, entry.order)
                elif self._group_sizes[gid] >= index_splits.SPLIT_MIN_MEMBERS:
                    self._file_group(gid, mid, entry, off)
            self._holders.append(mid, entry.order << _LEN_BITS | len(member_ids))  # the newest span: last
            member_ids.append(mid)
        entry.member_ids = tuple(member_ids)
        self._spans[span_id] = entry

    def _file(self, gid: int, mid: int, entry: _Entry, off: int, born: int) -> None:
        """File a member (held by ``entry`` at ``off``; no holder of it is older than ``born``, and none of the
        members after it in the group) by where it leaves its group's reference."""
        b = self.block_len
        ref_order, ref_off = self._splits.ref(gid)
        ref, tail = self.entry_of(ref_order), len(entry.token_ids) - off - b
        split, _ = common_length(self.hasher, entry.prefix, off + b, ref.prefix, ref_off + b,
                                 min(tail, len(ref.token_ids) - ref_off - b))
        self._splits.add_member(gid, mid, born, split, entry.token_ids[off + b + split] if split < tail else END)

    def _file_group(self, gid: int, new_mid: int, entry: _Entry, off: int) -> None:
        """A group reached SPLIT_MIN_MEMBERS: its first member's oldest span becomes its reference, and every
        member is filed (the newest, ``new_mid``, is held by ``entry`` at ``off``; its holder is not listed yet)."""
        heads, b = self._holders.head, self.block_len
        members = []
        for mid in self._group_members.nodes(gid):
            holder = heads[mid] if mid != new_mid else entry.order << _LEN_BITS | off // b
            members.append((mid, self._by_order[holder >> _LEN_BITS], (holder & _LEN_MASK) * b))
        self._splits.set_ref(gid, members[0][1].order, members[0][2])
        borns = [m[1].order for m in members]
        for k in range(len(borns) - 2, -1, -1):
            borns[k] = min(borns[k], borns[k + 1])  # the oldest span of this member or any after it
        for (mid, holder_entry, holder_off), born in zip(members, borns, strict=True):
            self._file(gid, mid, holder_entry, holder_off, born)  # in order of creation, as lists are read

    def remove(self, span_id: str) -> None:
        """Forget a span (evicted or removed from the store); unknown ids are ignored."""
        entry = self._spans.pop(span_id, None)
        if entry is None:
            return
        del self._by_order[entry.order]
        for k, mid in enumerate(entry.member_ids):
            if not self._holders.remove(mid, entry.order << _LEN_BITS | k):
                continue
            self._period_after.pop(mid, None)
            self._period_break.pop(mid, None)
            mkey = self._member_keys.pop(mid)
            del self._member_ids[mkey]
            gid = mkey >> (_BITS + _LEN_BITS)
            filed = gid in self._splits.refs
            if filed:
                self._splits.remove_member(gid, mid)
            self._group_sizes[gid] -= 1
            if not self._group_members.remove(gid, mid):
                continue
            del self._group_sizes[gid]
            released = self._splits.drop_ref(gid) if filed else None
            if released is not None:
                self._ghosts.pop(released, None)
            self._group_period.pop(gid, None)
            gkey = self._group_keys.pop(gid)
            del self._group_ids[gkey]
            self._groups.remove(gkey >> _BITS, gid)
        if entry.order in self._splits.ref_uses:  # its tokens still define where other members leave it
            self._ghosts[entry.order] = entry
        left = self._namespace_spans.pop(entry.namespace) - 1
        if left:
            self._namespace_spans[entry.namespace] = left
        else:  # none of its blocks, groups or references is left: a namespace per client salt is not kept
            del self._namespace_ids[entry.namespace]

    def token_ids(self, span_id: str) -> tuple[int, ...]:
        return self._spans[span_id].token_ids

    # ------------------------------------------------------------------ lookup
    def find_runs(self, token_ids: list[int] | tuple[int, ...], namespace: str = "",
                  prefer: str = "longest", cover_tokens: int | None = None) -> list[TokenMatch]:
        """Candidate runs, in order of query start (then longest first): maximal runs shared with spans of
        ``namespace`` that cover an aligned block of the span, less those contained in another candidate
        from a span at least as preferred (``prefer="longest"``: any span; ``"oldest"``: the same span or an older
        one, whose run ``find`` takes first).

        Each is the maximal run of its span on its diagonal; a run held by several spans names the newest
        (``"longest"``) or the oldest (``"oldest"``) of them. Runs are equal under the index's hash;
        ``find`` checks tokens. See the module docstring for the guarantee.

        ``cover_tokens`` (``prefer="oldest"`` only; ``find`` passes its ``min_tokens``): also leave out a window of
        repeated text whose every piece of ``cover_tokens`` tokens lies inside one window that an older span gives
        at every period of the prompt's stretch. ``find``, which takes every run of an older span before any of a
        newer one, can then take nothing from it (each such piece is taken, or lies in a free piece of that
        window shorter than ``min_tokens``), so its result is the same, and a span whose repeats outreach the
        older ones' no longer gives a window at every offset. The guarantee then holds for what ``find`` takes,
        not for the runs returned."""
        if prefer not in MATCH_PREFERENCES:
            raise ValueError(f"prefer must be one of {MATCH_PREFERENCES}, got {prefer!r}")
        if cover_tokens is not None and (not isinstance(cover_tokens, int) or cover_tokens < 1):
            raise ValueError(f"cover_tokens must be a positive integer or None, got {cover_tokens!r}")
        return Sweep(self, list(token_ids), namespace, prefer == "oldest", cover_tokens).run()

    def find(self, token_ids: list[int] | tuple[int, ...], namespace: str = "", min_tokens: int = 16,
             covered: list[tuple[int, int]] | None = None, prefer: str = "longest") -> list[TokenMatch]:
        """Non-overlapping runs shared with stored spans, each at least ``min_tokens`` long, in query order.

        Greedy over ``find_runs``: by length (``prefer="longest"``; ties: earlier query start, then newer
        span), or from the oldest span first (``prefer="oldest"``: a text is taken where it was first
        stored, then by length). A run overlapping one already taken (or a ``covered`` query range, e.g.
        the exact prefix or a chat prompt's framing) goes back in line as its free pieces, each ranked by its
        own length: on repeated text a window beside one taken is free by a token more at each next offset,
        and taking a piece as soon as ``min_tokens`` of it were free cut the text into pieces of
        ``min_tokens`` where whole windows fit. Every run returned is checked token by token.

        What is left: no candidate keeps a free piece of ``min_tokens`` or more, so (by the guarantee) no
        free stretch of ``max(min_tokens, 2 * block_len - 1)`` tokens outside ``covered`` is shared with
        any span of the namespace.
        """
        runs = self.find_runs(token_ids, namespace, prefer, min_tokens if min_tokens >= 1 else None)
        return self.choose(token_ids, runs, min_tokens, covered, prefer)

    def choose(self, token_ids: list[int] | tuple[int, ...], runs: list[TokenMatch], min_tokens: int = 16,
               covered: list[tuple[int, int]] | None = None, prefer: str = "longest") -> list[TokenMatch]:
        """``find``'s greedy over ``runs`` (from ``find_runs`` on ``token_ids``); adds its steps to ``last_work``."""
        return index_choose.choose(self, token_ids, runs, min_tokens, covered, prefer)
