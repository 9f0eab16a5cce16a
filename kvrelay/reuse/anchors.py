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
    _base_sq: torch.Tensor | None = field(default=None, repr=False)  # [L, Hkv, n] |base_v|^2 over channels

    @property
    def base_sq(self) -> torch.Tensor:
        """|base_v|^2 over channels per layer, KV head and token: [L, Hkv, n] (computed once)."""
        if self._base_sq is None:
            self._base_sq = self.base_v.float().square().sum(dim=-1)
        return self._base_sq

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


def coverage(anchors: list[Anchor], num_tokens: int) -> torch.Tensor:
    """[num_anchors, num_tokens] bool: which placeholder tokens each anchor has offsets for."""
    lengths = torch.tensor([a.num_tokens for a in anchors])
    return torch.arange(num_tokens)[None, :] < lengths[:, None]


@dataclass
class Distances:
    """A placeholder's base values against each anchor's, computed in one pass over the anchors (the plan's
    cost grows with the pool): squared differences summed over channels, per anchor, layer, KV head and token.
    Tokens past an anchor's end are NaN; every distance below is over the tokens both have."""

    sq: torch.Tensor  # [A, L, Hkv, n] |v_new - v_anchor|^2 over channels
    new_sq: torch.Tensor  # [L, Hkv, n] |v_new|^2 over channels
    covered: torch.Tensor  # [A, n] bool

    @classmethod
    def of(cls, new_v: torch.Tensor, anchors: list[Anchor]) -> Distances:
        """``new_v``: [L, Hkv, n, hd]; anchors are compared on their first min(n, length) tokens."""
        new = new_v.float()
        n = new.shape[2]
        sq = new.new_full((len(anchors), *new.shape[:3]), float("nan"))  # [A, L, Hkv, n]
        new_sq = new.square().sum(dim=-1)  # [L, Hkv, n]
        for i, a in enumerate(anchors):
            m = min(n, a.num_tokens)
            # |x - a|^2 = |x|^2 + |a|^2 - 2 x.a: one pass over the anchor's values, no difference tensor
            dot = (new[:, :, :m] * a.base_v[:, :, :m].float()).sum(dim=-1)  # [L, Hkv, m]
            sq[i, :, :, :m] = (new_sq[:, :, :m] + a.base_sq[:, :, :m] - 2 * dot).clamp_min_(0.0)
        return cls(sq, new_sq, coverage(anchors, n))

    def relative(self) -> torch.Tensor:
        """|v_new - v_anchor| / |v_new| per anchor, layer and token, the norms over all KV heads and channels:
        [A, L, n]."""
        return self.sq.sum(dim=2).sqrt() / self.new_sq.sum(dim=1).sqrt().clamp_min(1e-6)

    def value_distances(self) -> torch.Tensor:
        """Relative distance averaged over the tokens both have, then over layers: [A]."""
        return self.relative().nanmean(dim=2).mean(dim=1)

    def l2(self) -> torch.Tensor:
        """L2 norm of ``v_new - v_anchor`` over the whole placeholder (every layer, head, token and channel):
        [A]. The scale KVCOMM's public code gates on (softmax at temperature 1): it grows with the placeholder,
        so gaps between anchors are units, not hundredths. An anchor shorter than the placeholder is compared
        on its m tokens and its norm scaled by sqrt(n / m), the norm n tokens would have at the same mean square.
        """
        n = self.covered.shape[1]
        m = self.covered.sum(dim=1)  # [A]
        return (self.sq.nansum(dim=(1, 2, 3)) * n / m).sqrt()

    def weights(self, temperature: float) -> torch.Tensor:
        """One softmax(-value distance / temperature) weight per anchor: [A, 1, 1, 1] (``mix`` broadcasts it). When
        some anchor is shorter than the placeholder, [A, 1, 1, n]: it weighs nothing on the tokens past its end, and
        there the other anchors' weights are renormalized. A token no anchor covers gets all-zero weights (callers
        compute it)."""
        w = torch.softmax(-self.value_distances()[:, None, None, None] / temperature, dim=0)  # [A, 1, 1, 1]
        if bool(self.covered.all()):
            return w
        w = w * self.covered[:, None, None, :]  # [A, 1, 1, n]: shorter anchors drop out past their end
        return w / w.sum(dim=0, keepdim=True).clamp_min(1e-30)


def value_distances(new_v: torch.Tensor, anchors: list[Anchor]) -> torch.Tensor:
    """Relative value distance of a placeholder's base values to each anchor's: [num_anchors].

    Per layer and token, ``|v_new - v_anchor|`` over all KV heads divided by ``|v_new|``, averaged over
    the tokens both have (the new placeholder's first n, or the anchor's length if shorter), then over layers.
    """
    return Distances.of(new_v, anchors).value_distances()


def mixing_weights(new_v: torch.Tensor, anchors: list[Anchor], temperature: float) -> torch.Tensor:
    """``Distances.weights`` of a placeholder's base values against ``anchors``."""
    return Distances.of(new_v, anchors).weights(temperature)


def l2_distances(new_v: torch.Tensor, anchors: list[Anchor]) -> torch.Tensor:
    """``Distances.l2`` of a placeholder's base values against ``anchors``: [num_anchors]."""
    return Distances.of(new_v, anchors).l2()


def normalized_entropy(weights: torch.Tensor) -> float:
    """Entropy of a weight vector over log(its length): 0 = one anchor takes all, 1 = uniform."""
    if weights.numel() <= 1:
        return 0.0
    p = weights.clamp_min(1e-12)
    return float(-(p * p.log()).sum() / math.log(weights.numel()))


def _as_grid(weights: torch.Tensor) -> torch.Tensor:
    """[A] -> [A, 1, 1, 1]; [A, 1, 1, n|1] as it is."""
    return weights[:, None, None, None] if weights.dim() == 1 else weights


def mix(weights: torch.Tensor, tensors: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """sum_a w_a * t_a[:, :, :num_tokens] for [L, Hkv, n_a, hd] tensors; ``weights`` is [num_anchors] or
    [num_anchors, 1, 1, n|1] (``Distances.weights``). A tensor shorter than ``num_tokens`` adds to its own first n_a
    tokens only."""
    grid = _as_grid(weights)
    out = torch.zeros_like(tensors[0][:, :, :1]).expand(-1, -1, num_tokens, -1).contiguous()
    for w, t in zip(grid, tensors, strict=True):
        if w.max() <= 1e-6:  # negligible anchors cost a full tensor pass for nothing
            continue
        m = min(num_tokens, t.shape[2])
        w = w[..., :m] if w.shape[-1] > 1 else w  # [1, 1, m|1]
        if w.numel() == 1:
            out[:, :, :m].add_(t[:, :, :m], alpha=float(w))
        else:
            out[:, :, :m].addcmul_(t[:, :, :m], w.to(t.dtype)[..., None])  # [1, 1, m, 1] over channels
    return out
