"""``relay_anchors``' spans prepared when they are published: a stored span with its anchors already added, per role.

The anchors' estimate of a span token's move reads only the token's stored key and the role that reads it (the agent
and the placeholder the span fills), nothing else of the call: so it can be made when the span is published, outside
any call's TTFT. A role learns which spans it reads by their openings: the tokens every span it read begins with (the
publishing call's chat template and system prompt, the same for every call of an agent; at least ``MIN_OPENING``
tokens, else another kind); a published span is prepared for each frozen role that read spans so opened. A later
call of that role loads the prepared span as ``naive`` loads the stored one: no match, no mix and no patch on the
call. Where a span was not prepared (published elsewhere, dropped from the bounded set, or published again under its
id since) the call computes its anchors itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.model.rope import RotaryEmbedding

MIN_OPENING = 8  # the fewest opening tokens two spans of one kind share (a chat template's header is shorter)
MAX_OPENING = 64  # the most opening tokens kept of a kind


def _common_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def anchored_span(span: StoredSpan, k_move: torch.Tensor, v_move: torch.Tensor, rope: RotaryEmbedding) -> StoredSpan:
    """``span`` with the moves [L, Hkv, n, hd] (every token of it; keys without RoPE) added, the key moves rotated for
    the span's own positions: a load that re-rotates the span to new positions then moves them with it (RoPE is
    linear). The carried hidden states are the span's own (shared, not copied)."""
    k = span.k.to(torch.float32, copy=True)  # [L, Hkv, n, hd]: the moves added in fp32, rounded once
    rope.add_keys_at(k_move.to(k.device, torch.float32), span.start_pos, k)
    v = span.v.to(torch.float32, copy=True) + v_move.to(span.v.device, torch.float32)
    return StoredSpan(span.token_ids, span.start_pos, k.to(span.k.dtype), v.to(span.v.dtype), span.fingerprint,
                      span.hidden, span.hidden_from)


@dataclass
class PreparedSpan:
    source: StoredSpan  # the store's span it was made from: a span published again under its id is another object
    span: StoredSpan  # the anchored K/V of every token of it
    residual: torch.Tensor | None  # [n]: the squared move each token's estimate is expected to miss (if asked for)


class PreparedSpans:
    """The spans each role reads, by signature, and at most ``max_entries`` prepared (span id, role) pairs (the ones
    prepared longest ago dropped first)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._read_by: dict[str, list[tuple[int, ...]]] = {}  # role -> the openings of the kinds of span it read
        self._entries: OrderedDict[tuple[str, str], PreparedSpan] = OrderedDict()

    def note_read(self, role: str, span: StoredSpan) -> None:
        """``role`` read (part of) ``span`` in a learning call: a kind it read whose opening ``span`` shares for at
        least ``MIN_OPENING`` tokens is cut to what they share, else ``span``'s opening is a new kind."""
        ids, openings = tuple(span.token_ids[:MAX_OPENING]), self._read_by.setdefault(role, [])
        for i, opening in enumerate(openings):
            if (common := _common_len(opening, ids)) >= MIN_OPENING:
                openings[i] = opening[:common]
                return
        openings.append(ids)

    def roles_reading(self, span: StoredSpan) -> list[str]:
        """The roles that read spans of ``span``'s kind (spans that begin with one of its openings), in the order
        they first read one."""
        ids = tuple(span.token_ids[:MAX_OPENING])
        return [role for role, openings in self._read_by.items()
                if any(ids[: len(opening)] == opening for opening in openings)]

    def put(self, span_id: str, role: str, prepared: PreparedSpan) -> None:
        if self.max_entries <= 0:
            return
        self._entries.pop((span_id, role), None)
        self._entries[span_id, role] = prepared
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, span_id: str, role: str, source: StoredSpan) -> PreparedSpan | None:
        """The prepared span of ``role`` for ``span_id``, if it was made from ``source`` (the store's span now)."""
        prepared = self._entries.get((span_id, role))
        return prepared if prepared is not None and prepared.source is source else None

    def __len__(self) -> int:
        return len(self._entries)
