"""Where each member of a group leaves the group's reference: many spans that share a passage are few candidates.

Spans that open with one system prompt and then differ are one group per block of the prompt, with a member
per span: a prompt holding that passage met every member, one candidate each, so a lookup grew with the
number of stored spans. But every member of a group starts its run at the same prompt offset, and its end is
where its tokens after the block leave the prompt's. Against the group's reference (its first member's
tokens, kept while the group lives, even once that span is gone) each member is filed by where it leaves
the reference (``split``, the length of their common extension) and by its token there (none past its end).
For a prompt that leaves the reference at ``split_q`` with token ``t``:

- a member that leaves it earlier, at ``v``, ends at ``v`` (the prompt still follows the reference there);
- a member that leaves it later, or at ``split_q`` with a token other than ``t``, ends at ``split_q``;
- a member that leaves it at ``split_q`` with token ``t`` goes further: it is checked alone.

Members with the same end give the same run, so each class is one candidate, its oldest member (a member
holds as old a span as the one that created it, or a newer one: a class is read in order of creation until
no later member can be older). The work is the number of distinct split points, plus the members that
follow the prompt past the reference, plus one longest-common-extension by hashes. Pure Python, no torch;
everything per member in dicts of ints (see ``int_lists``), out of the garbage collector's sight.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from kvrelay.server.int_lists import IntLists

if TYPE_CHECKING:
    from kvrelay.server.index_sweep import PolyHash

__all__ = ["END", "SPLIT_MIN_MEMBERS", "Splits", "common_length"]

# a group is filed once it has this many members, and visited by class from then on (with the prompt's token
# a block of one repeated token, member by member): the same runs, and the work no longer grows with the
# members; fewer are checked one by one (a class costs a hash search and a few look-ups, filing one per member)
SPLIT_MIN_MEMBERS = 16
END = -(1 << 62)  # "no token": the member's tokens end where it leaves the reference (token ids are far above)
_LEN_BITS = 32
_LEN_MASK = (1 << _LEN_BITS) - 1
_TOKEN_BIAS = 1 << 63


def common_length(hasher: PolyHash, p1: array, start1: int, p2: array, start2: int, limit: int) -> tuple[int, int]:
    """(k, probes): the longest k <= ``limit`` with equal hashes of [start1, start1 + k) and [start2, start2 + k)
    (doubling steps, then bisection)."""
    sub = hasher.sub
    lo, step, hi, probes = 0, 1, limit + 1, 0
    while lo + step <= limit:
        probes += 1
        if sub(p1, start1, start1 + lo + step) != sub(p2, start2, start2 + lo + step):
            hi = lo + step
            break
        lo, step = lo + step, step * 2
    else:
        if lo == limit:
            return lo, probes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes += 1
        if sub(p1, start1, start1 + mid) == sub(p2, start2, start2 + mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


class Splits:
    """Per group: its reference and, per member, where it leaves it (see the module docstring)."""

    __slots__ = ("refs", "ref_uses", "split", "token", "born", "points", "at_point", "at_token")

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}  # group -> its reference: span order << 32 | offset of the block
        self.ref_uses: dict[int, int] = {}  # span order -> groups it is the reference of
        self.split: dict[int, int] = {}  # member -> where it leaves its group's reference
        self.token: dict[int, int] = {}  # member -> its token there (END: none)
        self.born: dict[int, int] = {}  # member -> the order of the span that created it
        self.points = IntLists()  # group -> its split points (group << 32 | split), as first met
        self.at_point = IntLists()  # split point -> its members, in order of creation
        self.at_token = IntLists()  # (split point, token) -> its members, in order of creation

    @staticmethod
    def token_key(point: int, token: int) -> int:
        return point << 64 | (token + _TOKEN_BIAS)

    def add_member(self, gid: int, mid: int, order: int, split: int, token: int) -> None:
        point = gid << _LEN_BITS | split
        if point not in self.at_point:
            self.points.append(gid, point)
        self.at_point.append(point, mid)
        self.at_token.append(self.token_key(point, token), mid)
        self.split[mid], self.token[mid], self.born[mid] = split, token, order

    def remove_member(self, gid: int, mid: int) -> None:
        point = gid << _LEN_BITS | self.split.pop(mid)
        del self.born[mid]
        self.at_token.remove(self.token_key(point, self.token.pop(mid)), mid)
        if self.at_point.remove(point, mid):
            self.points.remove(gid, point)

    def set_ref(self, gid: int, order: int, off: int) -> None:
        self.refs[gid] = order << _LEN_BITS | off
        self.ref_uses[order] = self.ref_uses.get(order, 0) + 1

    def drop_ref(self, gid: int) -> int | None:
        """Forget a group's reference; the span order whose tokens are no longer needed, if any."""
        order = self.refs.pop(gid) >> _LEN_BITS
        uses = self.ref_uses[order] - 1
        if uses:
            self.ref_uses[order] = uses
            return None
        del self.ref_uses[order]
        return order

    def ref(self, gid: int) -> tuple[int, int]:
        """(span order, offset of the block) of a group's reference."""
        ref = self.refs[gid]
        return ref >> _LEN_BITS, ref & _LEN_MASK
