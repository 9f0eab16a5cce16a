"""The exact-prefix lookup: which indexed span shares the longest exact prefix with a query.

Spans that start at position 0 are indexed by the chained hashes of their full blocks (``store.block_hashes``,
seeded with the model and the namespace by the caller, so equal hashes mean equal prefixes of one model in one
namespace and span ids alone key the index). A query walks its own block hashes while some span has them, then
extends the match token by token into the next partial block, so the length is exact, not rounded to a block.
Among spans of equal match the most recently indexed wins. The memory store (``KVStore``) and the shared tier's
announcements (``tier.announce.RemoteSpans``) both use it. Pure Python, no torch; not locked (its owner's lock is).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    span_id: str
    num_tokens: int  # exact common prefix length of the query and the span's token ids


class PrefixIndex:
    """Span ids by the hashes of their full blocks; ``longest`` finds the span with the longest exact prefix."""

    def __init__(self, block_len: int) -> None:
        self.block_len = block_len
        self._by_hash: dict[bytes, OrderedDict[str, None]] = {}  # block hash -> span ids, oldest indexed first

    def __len__(self) -> int:
        """Distinct block hashes indexed."""
        return len(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def add(self, span_id: str, hashes: Sequence[bytes]) -> None:
        """Index ``span_id`` under its block hashes (a span that starts at position 0)."""
        for h in hashes:
            self._by_hash.setdefault(h, OrderedDict())[span_id] = None

    def remove(self, span_id: str, hashes: Sequence[bytes]) -> None:
        """Forget ``span_id`` under the hashes it was added with (those it is not under are skipped)."""
        for h in hashes:
            ids = self._by_hash.get(h)
            if ids is None:
                continue
            ids.pop(span_id, None)
            if not ids:
                del self._by_hash[h]

    def longest(self, hashes: Sequence[bytes], token_ids: Sequence[int],
                span_tokens: Callable[[str], Sequence[int]]) -> PrefixMatch | None:
        """The indexed span sharing the longest exact prefix with ``token_ids`` (whose block hashes are ``hashes``),
        or None when no span shares its first block. ``span_tokens(span_id)``: an indexed span's token ids."""
        candidates: OrderedDict[str, None] | None = None
        num_blocks = 0
        for h in hashes:
            ids = self._by_hash.get(h)
            if not ids:
                break
            candidates, num_blocks = ids, num_blocks + 1
        best: PrefixMatch | None = None
        for span_id in reversed(candidates or {}):  # most recently indexed first among equals
            ids_of_span = span_tokens(span_id)
            n = num_blocks * self.block_len
            limit = min(len(token_ids), len(ids_of_span))
            while n < limit and ids_of_span[n] == token_ids[n]:
                n += 1
            if best is None or n > best.num_tokens:
                best = PrefixMatch(span_id, n)
        return best
