"""``relay_anchors``' spans prepared when they are published: a stored span with its anchors already added, per role.

The anchors' estimate of a span token's move reads only the token's stored key and the role that reads it (the agent
and the placeholder the span fills), nothing else of the call: so it can be made when the span is published, outside
any call's TTFT. A role learns which spans it reads by their openings: the tokens every span it read begins with (the
publishing call's chat template and system prompt, the same for every call of an agent; at least ``MIN_OPENING_TOKENS``
tokens, else another kind); a published span is prepared for each frozen role that read spans so opened. A later
call of that role loads the prepared span as ``naive`` loads the stored one: no match, no mix and no patch on the
call. Where a span was not prepared (published elsewhere, dropped from the bounded set, or published again under its
id since) the call computes its anchors itself.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.tenancy import key_namespace
from kvrelay.model.rope import RotaryEmbedding

MIN_OPENING_TOKENS = 8  # the fewest opening tokens two spans of one kind share (SmolLM2's agents part after 6)
MAX_OPENING_TOKENS = 64  # the most opening tokens kept of a kind


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
    """The kinds of span each role reads (by opening), and at most ``max_entries`` prepared (span id, role) pairs per
    namespace (the one a role's ``cache.tenancy.scoped_key`` names; the ones prepared longest ago dropped first): one
    tenant's spans never push another's out, so whether a call finds its span prepared depends on its own tenant's
    publishing alone."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._read_by: dict[str, list[tuple[int, ...]]] = {}  # role -> the openings of the kinds of span it read
        # namespace -> (span id, role) -> its prepared span, oldest first
        self._entries: dict[str, OrderedDict[tuple[str, str], PreparedSpan]] = {}

    def note_read(self, role: str, span: StoredSpan) -> None:
        """``role`` read (part of) ``span`` in a learning call: a kind it read whose opening ``span`` shares for at
        least ``MIN_OPENING_TOKENS`` tokens is cut to what they share, else ``span``'s opening is a new kind."""
        ids, openings = tuple(span.token_ids[:MAX_OPENING_TOKENS]), self._read_by.setdefault(role, [])
        for i, opening in enumerate(openings):
            if (common := _common_len(opening, ids)) >= MIN_OPENING_TOKENS:
                openings[i] = opening[:common]
                return
        openings.append(ids)

    def roles_reading(self, span: StoredSpan) -> list[str]:
        """The roles that read spans of ``span``'s kind (spans that begin with one of its openings), in the order
        they first read one."""
        ids = tuple(span.token_ids[:MAX_OPENING_TOKENS])
        return [role for role, openings in self._read_by.items()
                if any(ids[: len(opening)] == opening for opening in openings)]

    def put(self, span_id: str, role: str, prepared: PreparedSpan) -> None:
        """Keep ``prepared`` as ``role``'s span for ``span_id`` (none with ``max_entries`` 0)."""
        if self.max_entries <= 0:
            return
        entries = self._entries.setdefault(key_namespace(role), OrderedDict())
        entries.pop((span_id, role), None)
        entries[span_id, role] = prepared
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def get(self, span_id: str, role: str, source: StoredSpan) -> PreparedSpan | None:
        """The prepared span of ``role`` for ``span_id``, if it was made from ``source`` (the store's span now)."""
        prepared = self._entries.get(key_namespace(role), {}).get((span_id, role))
        return prepared if prepared is not None and prepared.source is source else None

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def drop(self, role: str) -> None:
        """Forget ``role``: the kinds it read and its prepared spans (its namespace is gone)."""
        self._read_by.pop(role, None)
        entries = self._entries.get(key_namespace(role))
        for key in [key for key in entries or () if key[1] == role]:
            del entries[key]
        if entries is not None and not entries:
            del self._entries[key_namespace(role)]


@dataclass
class PrepareStats:
    """What preparing at publish cost (the latest ``MAX_TIMES`` spans' times) and how the calls' spans were served."""

    MAX_TIMES = 4096
    num_spans: int = 0  # spans prepared for at least one role
    num_role_tokens: int = 0  # tokens prepared, summed over the roles each span was prepared for
    total_ms: float = 0.0
    num_loads_prepared: int = 0  # a call's spans loaded prepared
    num_loads_on_call: int = 0  # a call's spans whose anchors the call computed
    times_ms: deque = field(default_factory=lambda: deque(maxlen=PrepareStats.MAX_TIMES))

    def add_span(self, num_role_tokens: int, ms: float) -> None:
        self.num_spans += 1
        self.num_role_tokens += num_role_tokens
        self.total_ms += ms
        self.times_ms.append(ms)

    def count_load(self, prepared: bool) -> None:
        if prepared:
            self.num_loads_prepared += 1
        else:
            self.num_loads_on_call += 1

    def summary(self) -> dict:
        times = list(self.times_ms)
        return {"num_spans": self.num_spans, "num_role_tokens": self.num_role_tokens, "total_ms": self.total_ms,
                "median_ms": statistics.median(times) if times else None, "max_ms": max(times, default=None),
                "num_loads_prepared": self.num_loads_prepared, "num_loads_on_call": self.num_loads_on_call}
