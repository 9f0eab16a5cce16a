"""KVCOMM's anchor pool: offsets a placeholder's KV showed in real contexts, and how to mix them.

An anchor is one dense-prefilled call's record for one placeholder (say, agent 1's output in agent
3's prompt): the placeholder's *base* values (the KV it had where it was first computed, the
distance reference), the offsets ``real - base`` of its keys and values in the call's context, and
the offsets of the template segment that follows it. A new context's offsets are the
softmax(-distance)-weighted mix over the anchors at least as long as its placeholder.

Bookkeeping (age, usage, eviction) is plain Python; the tensor math is two small functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)  # identity: anchors hold tensors
class Anchor:
    base_v: torch.Tensor  # [L, Hkv, n, hd] the placeholder's base values
    dk: torch.Tensor  # [L, Hkv, n, hd] key offsets (position-free unless the pool stores absolute ones)
    dv: torch.Tensor  # [L, Hkv, n, hd] value offsets
    seg_ids: tuple[int, ...] = ()  # ids of the template segment after the placeholder (its offsets below)
    seg_dk: torch.Tensor | None = None  # [L, Hkv, m, hd]
    seg_dv: torch.Tensor | None = None
    anchor_id: int = -1  # insertion order: smaller is older (set by the pool)
    usage: float = 0.0  # total weight this anchor has had in estimates

    @property
    def num_tokens(self) -> int:
        return self.base_v.shape[2]

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.base_v, self.dk, self.dv, self.seg_dk, self.seg_dv) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class AnchorPool:
    """Anchors of one placeholder, at most ``max_anchors``; a full pool evicts the least used of its
    ``evict_window`` oldest anchors (ties: the oldest)."""

    max_anchors: int = 20
    evict_window: int = 5
    anchors: list[Anchor] = field(default_factory=list)
    _next_id: int = 0

    def add(self, anchor: Anchor) -> Anchor | None:
        """Insert ``anchor``; return the evicted one, if any."""
        evicted = None
        if len(self.anchors) >= self.max_anchors:
            oldest = sorted(self.anchors, key=lambda a: a.anchor_id)[: self.evict_window]
            evicted = min(oldest, key=lambda a: (a.usage, a.anchor_id))
            self.anchors.remove(evicted)
        anchor.anchor_id = self._next_id
        self._next_id += 1
        self.anchors.append(anchor)
        return evicted

    def eligible(self, num_tokens: int) -> list[Anchor]:
        """Anchors with offsets for at least ``num_tokens`` placeholder tokens, oldest first."""
        return [a for a in self.anchors if a.num_tokens >= num_tokens]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors)


def value_distances(new_v: torch.Tensor, anchors: list[Anchor], per_layer: bool = False) -> torch.Tensor:
    """Relative value distance of a placeholder's base values to each anchor's: [num_anchors], or
    [num_anchors, L] with ``per_layer``.

    Per layer and token, ``|v_new - v_anchor|`` over all KV heads divided by ``|v_new|``, averaged over
    tokens (and layers unless ``per_layer``); compared on the new placeholder's first n tokens (anchors
    are at least that long).
    """
    n = new_v.shape[2]
    new = new_v.float().permute(0, 2, 1, 3).flatten(2)  # [L, n, Hkv * hd]
    norm = new.norm(dim=-1).clamp_min(1e-6)  # [L, n]
    out = []
    for a in anchors:
        other = a.base_v[:, :, :n].float().permute(0, 2, 1, 3).flatten(2)  # [L, n, Hkv * hd]
        rel = (new - other).norm(dim=-1) / norm  # [L, n]
        out.append(rel.mean(dim=1) if per_layer else rel.mean())
    return torch.stack(out)


def l2_distances(new_v: torch.Tensor, anchors: list[Anchor]) -> torch.Tensor:
    """L2 norm of ``v_new - v_anchor`` over the whole placeholder (every layer, head, token and channel
    of its first n tokens): [num_anchors]. The scale KVCOMM's public code gates on (softmax at
    temperature 1): it grows with the placeholder, so gaps between anchors are units, not hundredths.
    """
    n = new_v.shape[2]
    new = new_v.float()
    return torch.stack([(new - a.base_v[:, :, :n].float()).norm() for a in anchors])


def normalized_entropy(weights: torch.Tensor) -> float:
    """Entropy of a weight vector over log(its length): 0 = one anchor takes all, 1 = uniform."""
    if weights.numel() <= 1:
        return 0.0
    p = weights.clamp_min(1e-12)
    return float(-(p * p.log()).sum() / math.log(weights.numel()))


def mix(weights: torch.Tensor, tensors: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """sum_a w_a * t_a[:, :, :num_tokens] for [L, Hkv, >=num_tokens, hd] tensors; ``weights`` is
    [num_anchors] (one weight for all layers) or [num_anchors, L] (one per layer)."""
    out = torch.zeros_like(tensors[0][:, :, :num_tokens])
    for w, t in zip(weights, tensors, strict=True):
        if w.max() <= 1e-6:  # negligible anchors cost a full tensor pass for nothing
            continue
        if w.dim() == 0:
            out.add_(t[:, :, :num_tokens], alpha=float(w))
        else:
            out.add_(t[:, :, :num_tokens] * w.to(t.dtype).view(-1, 1, 1, 1))  # [L] -> [L, 1, 1, 1]
    return out
