"""Loaded spans read in place: a sequence cache's positions whose K/V stay in the stored span's tensors.

Loading a span used to copy its rows (and re-rotate its keys when it moved) into the sequence cache: on
SmolLM2 ~46 KB a token, 97 MB for the 2,093 reused tokens of copy-agents:5's fifth agent, and on the CPU
that copy is memory-bound. A ``SpanRef`` instead lets ``SequenceKV.attend`` read those rows where they are,
as one key part of a split attention (``model.split_attention``); a moved span's keys are not rotated
at all: the queries are rotated back by the move for that part instead (RoPE: q . R(d) k = R(-d) q . k).

A layer's rows are copied after all (``SpanRef.copy_layer``) only where the cache must hold them: when
the forward writes fresh K/V over some of them at that layer (copy on write), or when anything other
than ``attend`` reads that layer (a decode step, a schedule reading the reused values, an export).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvrelay.model.rope import RotaryEmbedding, rotate_halves_into
from kvrelay.model.split_attention import PartMask, fold_mask, fold_queries

if TYPE_CHECKING:
    from kvrelay.cache.kv import StoredSpan


@dataclass(eq=False)
class SpanRef:
    """Positions [dst_start, dst_start + num_tokens) read from ``span``'s rows from ``src_start``, keys moved by
    ``delta`` positions, at the layers in ``layers`` (the others are copied into the cache)."""

    span: StoredSpan | None  # None once every layer is copied in
    src_start: int
    dst_start: int
    num_tokens: int
    delta: int
    rope: RotaryEmbedding
    layers: set[int]
    cos: torch.Tensor | None = field(default=None, repr=False)  # the move's factors: [hd / 2] or [L, 1, 1, hd / 2]
    sin: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.delta and self.cos is None:
            self.cos, self.sin = self.rope.shift_factors(self.delta)

    @property
    def dst_end(self) -> int:
        return self.dst_start + self.num_tokens

    def _factors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_layer = self.cos.dim() > 1
        return (self.cos[layer], self.sin[layer]) if per_layer else (self.cos, self.sin)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K (rotated for the span's own positions) and V of this layer: [Hkv, num_tokens, hd], views."""
        rows = slice(self.src_start, self.src_start + self.num_tokens)
        return self.span.k[layer, :, rows], self.span.v[layer, :, rows]

    def queries(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Queries [..., hd] that score this part's stored keys as if they had moved by ``delta``."""
        if not self.delta:
            return q
        cos, sin = self._factors(layer)
        out = torch.empty_like(q)
        rotate_halves_into(q, cos, -sin, out)  # by -delta
        return out

    def copy_layer(self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy this layer's rows into a cache's K/V of the same positions ([Hkv, num_tokens, hd] each)."""
        k, v = self.kv(layer)
        if self.delta:  # rotated straight into the cache: no temporaries of the keys' size
            cos, sin = self._factors(layer)
            rotate_halves_into(k, cos, sin, k_out)
        else:
            k_out.copy_(k)
        v_out.copy_(v)
        self.layers.discard(layer)
        if not self.layers:  # copied in everywhere: the cache no longer keeps the stored span alive
            self.span = self.cos = self.sin = None


@dataclass(frozen=True)
class SplitPlan:
    """A layer's keys [0, num_keys) as parts: the referenced spans read in place, and the cache's own rows
    (one part: gathered when they are not one run)."""

    refs: tuple[tuple[SpanRef, int], ...]  # (ref, its positions' count below num_keys)
    own: slice | torch.Tensor | None  # the own positions: a run, or indices [m], or none
    masks: tuple[PartMask, ...]  # one per ref, then the own part's


def split_plan(refs: list[SpanRef], visible: torch.Tensor, group: int, dtype: torch.dtype) -> SplitPlan:
    """The parts of keys [0, visible.shape[1]) given the refs read in place at a layer (disjoint), with
    each part's folded mask; a part no query sees is left out."""
    num_keys = visible.shape[1]
    own_mask = torch.ones(num_keys, dtype=torch.bool)
    parts, masks = [], []
    for ref in sorted(refs, key=lambda r: r.dst_start):
        start, end = ref.dst_start, min(ref.dst_end, num_keys)
        if start >= end:
            continue
        own_mask[start:end] = False
        mask = fold_mask(visible[:, start:end], group, dtype)
        if mask is not None:
            parts.append((ref, end - start))
            masks.append(mask)
    own_pos = own_mask.nonzero().flatten()
    own: slice | torch.Tensor | None = None
    if own_pos.numel():
        first, last = int(own_pos[0]), int(own_pos[-1])
        own = slice(first, last + 1) if last - first + 1 == own_pos.numel() else own_pos.to(visible.device)
        mask = fold_mask(visible[:, own] if isinstance(own, slice) else visible.index_select(1, own), group, dtype)
        if mask is None:
            own = None
        else:
            masks.append(mask)
    return SplitPlan(tuple(parts), own, tuple(masks))


class SplitPlans:
    """One cache's split plans, by what they depend on: the layers between two changes of the active set
    share one mask and the same refs in place, so they share one plan (masks folded once, not per layer)."""

    MAX_PLANS = 8  # a forward's mask kinds (Gemma 3: local and global) times a few active sets

    def __init__(self) -> None:
        self._plans: dict[tuple, tuple[torch.Tensor | None, SplitPlan]] = {}

    def get(self, refs: list[SpanRef], mask: torch.Tensor | None, causal: bool, num_keys: int, q: torch.Tensor,
            num_kv_heads: int) -> SplitPlan:
        """The plan for queries q [H, n, hd] over keys [0, num_keys) with ``mask`` (bool [n, num_keys]; None:
        ``causal`` as SDPA's is_causal means it, or every key visible)."""
        num_q, group = q.shape[1], q.shape[0] // num_kv_heads
        key = (id(mask), num_q, num_keys, causal, tuple(id(r) for r in refs), group)
        entry = self._plans.get(key)
        if entry is not None and entry[0] is mask:  # (the mask is held, so its id cannot be reused meanwhile)
            return entry[1]
        if mask is None:  # (the forward passes causal only when every position is active: num_q == num_keys)
            q_pos = torch.arange(num_q) if causal else torch.full((num_q,), num_keys)
            mask_or_causal = torch.arange(num_keys)[None, :] <= q_pos[:, None]
        else:
            mask_or_causal = mask
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        plan = split_plan(refs, mask_or_causal.to(q.device), group, q.dtype)
        self._plans[key] = (mask, plan)
        return plan


def attend_split(plan: SplitPlan, q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor,
                 layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The folded queries, keys and values of each part of ``plan`` at ``layer``; own_k, own_v: the cache's
    [Hkv, capacity, hd] of that layer."""
    folded = fold_queries(q, own_k.shape[0])
    queries, keys, values = [], [], []
    for ref, num in plan.refs:
        k, v = ref.kv(layer)
        queries.append(ref.queries(folded, layer))
        keys.append(k[:, :num])
        values.append(v[:, :num])
    if plan.own is not None:
        own = plan.own
        queries.append(folded)
        keys.append(own_k[:, own] if isinstance(own, slice) else own_k.index_select(1, own))
        values.append(own_v[:, own] if isinstance(own, slice) else own_v.index_select(1, own))
    return queries, keys, values
