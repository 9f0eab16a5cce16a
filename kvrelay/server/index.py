"""Any-offset token matching against stored spans: where does a prompt repeat stored tokens?

Pure Python, no torch. Every stored span's tokens are cut into aligned blocks of ``block_len``
tokens (offsets 0, B, 2B, ...), each indexed by a polynomial hash. A query is hashed at *every*
offset with a rolling hash (O(1) per offset), so a stored block is found wherever it sits in the
prompt. Each hit is verified token by token and extended left and right to the maximal common run.

Guarantee: a run of at least ``2 * block_len - 1`` tokens shared with a span always covers one of
the span's aligned blocks, so it is always found; shorter runs are found when they happen to cover
one. The exact prefix has its own chained-hash lookup (as the store's), so it is exact to the token.

Everything is scoped by a namespace: a span indexed under one namespace is never returned for a
query in another.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

MATCH_PREFERENCES = ("oldest", "longest")
_MOD = (1 << 61) - 1  # a Mersenne prime: the hash stays a Python int below 2**61
_BASE = 1_000_003


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
    order: int = 0  # when the span was added: older spans have smaller numbers
    block_keys: list[tuple[str, int]] = field(default_factory=list)
    chain_keys: list[tuple[str, int]] = field(default_factory=list)


def _block_hash(token_ids: tuple[int, ...] | list[int], start: int, block_len: int) -> int:
    h = 0
    for t in token_ids[start : start + block_len]:
        h = (h * _BASE + t + 1) % _MOD
    return h


def rolling_hashes(token_ids: list[int] | tuple[int, ...], block_len: int) -> list[int]:
    """Hash of ``token_ids[i : i + block_len]`` for every i (equal to ``_block_hash`` at that offset)."""
    n = len(token_ids)
    if n < block_len:
        return []
    top = pow(_BASE, block_len - 1, _MOD)
    h = _block_hash(token_ids, 0, block_len)
    out = [h]
    for i in range(1, n - block_len + 1):
        h = ((h - (token_ids[i - 1] + 1) * top) * _BASE + token_ids[i + block_len - 1] + 1) % _MOD
        out.append(h)
    return out


class TokenIndex:
    """Block index of stored spans' token ids, per namespace."""

    def __init__(self, block_len: int = 16, max_candidates: int = 4) -> None:
        if block_len <= 0:
            raise ValueError(f"block_len must be positive, got {block_len}")
        self.block_len = block_len
        # a block shared by many spans (a system prompt every request carries) is checked in its newest
        # few spans only, so lookup time does not grow with the number of spans holding it
        self.max_candidates = max_candidates
        self._spans: dict[str, _Entry] = {}
        self._num_added = 0
        self._blocks: dict[tuple[str, int], OrderedDict[tuple[str, int], None]] = {}  # -> (span_id, offset)
        self._chains: dict[tuple[str, int], OrderedDict[str, None]] = {}  # prefix chain hash -> span ids

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
        entry = _Entry(namespace, tuple(ids), self._num_added)
        ids, b = entry.token_ids, self.block_len
        chain = hash(namespace)
        for off in range(0, len(ids) - b + 1, b):
            h = _block_hash(ids, off, b)
            key = (namespace, h)
            self._blocks.setdefault(key, OrderedDict())[(span_id, off)] = None
            entry.block_keys.append(key)
            chain = hash((chain, ids[off : off + b]))
            ckey = (namespace, chain)
            self._chains.setdefault(ckey, OrderedDict())[span_id] = None
            entry.chain_keys.append(ckey)
        self._spans[span_id] = entry

    def remove(self, span_id: str) -> None:
        """Forget a span (evicted or removed from the store); unknown ids are ignored."""
        entry = self._spans.pop(span_id, None)
        if entry is None:
            return
        for i, key in enumerate(entry.block_keys):
            holders = self._blocks[key]
            holders.pop((span_id, i * self.block_len), None)
            if not holders:
                del self._blocks[key]
        for ckey in entry.chain_keys:
            holders = self._chains[ckey]
            holders.pop(span_id, None)
            if not holders:
                del self._chains[ckey]

    def token_ids(self, span_id: str) -> tuple[int, ...]:
        return self._spans[span_id].token_ids

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> TokenMatch | None:
        """The span of ``namespace`` sharing the longest exact prefix with ``token_ids`` (>= one block)."""
        b = self.block_len
        candidates: OrderedDict[str, None] | None = None
        num_blocks = 0
        chain = hash(namespace)
        for off in range(0, len(token_ids) - b + 1, b):
            chain = hash((chain, tuple(token_ids[off : off + b])))
            holders = self._chains.get((namespace, chain))
            if not holders:
                break
            candidates, num_blocks = holders, num_blocks + 1
        if candidates is None:
            return None
        best: TokenMatch | None = None
        for span_id in reversed(candidates):  # newest first among equals
            src = self._spans[span_id].token_ids
            n = num_blocks * b
            if src[:n] != tuple(token_ids[:n]):  # a hash collision: never trust a hash alone
                continue
            limit = min(len(token_ids), len(src))
            while n < limit and src[n] == token_ids[n]:
                n += 1
            if best is None or n > best.num_tokens:
                best = TokenMatch(0, n, span_id, 0)
        return best

    def find_runs(self, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> list[TokenMatch]:
        """Every maximal run of ``token_ids`` shared with a span of ``namespace`` that covers one of the
        span's indexed blocks (one per span and alignment), in order of query start."""
        q = list(token_ids)
        b, n = self.block_len, len(q)
        seen: dict[tuple[str, int], int] = {}  # (span, query start - span start) -> end of the run found
        runs: list[TokenMatch] = []
        for i, h in enumerate(rolling_hashes(q, b)):
            holders = self._blocks.get((namespace, h))
            if not holders:
                continue
            for span_id, off in list(reversed(holders))[: self.max_candidates]:
                diag = (span_id, i - off)
                if seen.get(diag, -1) > i:  # inside a run of this span already found
                    continue
                src = self._spans[span_id].token_ids
                if tuple(q[i : i + b]) != src[off : off + b]:
                    continue
                start, src_start = i, off
                while start > 0 and src_start > 0 and q[start - 1] == src[src_start - 1]:
                    start, src_start = start - 1, src_start - 1
                end, src_end = i + b, off + b
                while end < n and src_end < len(src) and q[end] == src[src_end]:
                    end, src_end = end + 1, src_end + 1
                seen[diag] = end
                runs.append(TokenMatch(start, end, span_id, src_start))
        return sorted(runs, key=lambda m: (m.start, -m.num_tokens))

    def find(self, token_ids: list[int] | tuple[int, ...], namespace: str = "", min_tokens: int = 16,
             covered: list[tuple[int, int]] | None = None, prefer: str = "longest") -> list[TokenMatch]:
        """Non-overlapping runs shared with stored spans, each at least ``min_tokens`` long.

        Greedy: by length (``prefer="longest"``; ties: earlier query start, then newer span), or from the
        oldest span first (``prefer="oldest"``: a text is taken where it was first stored, then by length;
        oldest among the spans checked, a block's ``max_candidates`` newest holders).
        A run overlapping one already taken (or a ``covered`` query range, e.g. the exact prefix or a chat
        prompt's framing) keeps its longest free piece, and its other free pieces go back in line.
        Returned in query order.
        """
        if prefer not in MATCH_PREFERENCES:
            raise ValueError(f"prefer must be one of {MATCH_PREFERENCES}, got {prefer!r}")

        def rank(m: TokenMatch, k: int) -> tuple[int, ...]:
            age = self._spans[m.span_id].order if prefer == "oldest" else 0
            return (age, -m.num_tokens, m.start, k)

        taken: list[tuple[int, int]] = sorted(covered or [])
        chosen: list[TokenMatch] = []
        line = [(rank(m, k), m) for k, m in enumerate(self.find_runs(token_ids, namespace))]
        heapq.heapify(line)
        while line:
            (*_, k), run = heapq.heappop(line)
            pieces = [p for p in _free_pieces(run.start, run.end, taken) if p[1] - p[0] >= min_tokens]
            if not pieces:
                continue
            longest = max(pieces, key=lambda p: p[1] - p[0])  # the first of equals
            for start, end in pieces:
                piece = TokenMatch(start, end, run.span_id, run.src_start + (start - run.start))
                if (start, end) == longest:
                    chosen.append(piece)
                    bisect.insort(taken, (start, end))
                else:
                    heapq.heappush(line, (rank(piece, k), piece))
        return sorted(chosen, key=lambda m: m.start)


def _free_pieces(start: int, end: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The maximal sub-ranges of [start, end) that overlap no range of ``taken`` (sorted), in order."""
    pieces = []
    cursor = start
    for t_start, t_end in taken + [(end, end)]:
        if t_end <= cursor:
            continue
        piece_end = min(t_start, end)
        if piece_end > cursor:
            pieces.append((cursor, piece_end))
        cursor = max(cursor, t_end)
        if cursor >= end:
            break
    return pieces
