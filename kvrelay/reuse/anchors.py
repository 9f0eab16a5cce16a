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


MIX_MODES = ("anchor", "layer", "head", "token")


def _rows(v: torch.Tensor, n: int) -> torch.Tensor:
    """[L, Hkv, >=n, hd] -> [L, Hkv, n, hd] in float, zero-padded past the tensor's own length."""
    v = v[:, :, :n].float()
    if v.shape[2] < n:
        v = torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], n - v.shape[2], v.shape[3])], dim=2)
    return v


def coverage(anchors: list[Anchor], num_tokens: int) -> torch.Tensor:
    """[num_anchors, num_tokens] bool: which placeholder tokens each anchor has offsets for."""
    lengths = torch.tensor([a.num_tokens for a in anchors])
    return torch.arange(num_tokens)[None, :] < lengths[:, None]


def relative_distance_grid(new_v: torch.Tensor, anchors: list[Anchor], per_head: bool = False) -> torch.Tensor:
    """|v_new - v_anchor| / |v_new| per anchor, layer and token: [A, L, n], the norm over all KV heads and
    channels; ``per_head``: [A, L, Hkv, n], the norm over one head's channels. Positions an anchor does not
    cover are NaN (callers mask them with ``coverage``)."""
    n = new_v.shape[2]
    new = new_v.float()  # [L, Hkv, n, hd]
    covered = coverage(anchors, n)  # [A, n]
    out = []
    for a, cov in zip(anchors, covered, strict=True):
        diff = new - _rows(a.base_v, n)
        if per_head:
            rel = diff.norm(dim=-1) / new.norm(dim=-1).clamp_min(1e-6)  # [L, Hkv, n]
        else:
            rel = diff.permute(0, 2, 1, 3).flatten(2).norm(dim=-1) / new.permute(0, 2, 1, 3).flatten(2).norm(
                dim=-1).clamp_min(1e-6)  # [L, n]
        out.append(rel.masked_fill(~cov, float("nan")))
    return torch.stack(out)


def value_distances(new_v: torch.Tensor, anchors: list[Anchor], per_layer: bool = False) -> torch.Tensor:
    """Relative value distance of a placeholder's base values to each anchor's: [num_anchors], or
    [num_anchors, L] with ``per_layer``.

    Per layer and token, ``|v_new - v_anchor|`` over all KV heads divided by ``|v_new|``, averaged over
    the tokens both have (the new placeholder's first n, or the anchor's length if shorter), and over
    layers unless ``per_layer``.
    """
    grid = relative_distance_grid(new_v, anchors)  # [A, L, n]
    per_layer_d = grid.nanmean(dim=2)  # [A, L]
    return per_layer_d if per_layer else per_layer_d.mean(dim=1)


def mixing_weights(new_v: torch.Tensor, anchors: list[Anchor], mode: str, temperature: float) -> torch.Tensor:
    """softmax(-relative distance / temperature) over the anchors, at the granularity ``mode`` picks, as a
    [A, L|1, Hkv|1, n|1] tensor (``mix`` broadcasts it over channels):

    - ``anchor``: one weight per anchor (distance averaged over layers and tokens);
    - ``layer``: one per anchor and layer; ``head``: one per anchor, layer and KV head;
    - ``token``: one per anchor and placeholder token (distance averaged over layers), the granularity of
      KVCOMM's public code.

    Anchors shorter than the placeholder weigh nothing on the tokens past their end; there the other anchors'
    weights are renormalized. A token no anchor covers gets all-zero weights (callers compute it).
    """
    n = new_v.shape[2]
    covered = coverage(anchors, n)  # [A, n]
    grid = relative_distance_grid(new_v, anchors, per_head=mode == "head")  # [A, L, n] or [A, L, H, n]
    if mode == "token":
        logits = -grid.mean(dim=1) / temperature  # [A, n]; NaN where not covered
        logits = logits.masked_fill(~covered, float("-inf"))
        w = torch.softmax(logits, dim=0).nan_to_num(0.0)  # a column with no anchor: all -inf -> NaN -> 0
        return w[:, None, None, :]  # [A, 1, 1, n]
    if mode == "head":
        d = grid.nanmean(dim=3)[..., None]  # [A, L, H, 1]
    elif mode == "layer":
        d = grid.nanmean(dim=2)[:, :, None, None]  # [A, L, 1, 1]
    elif mode == "anchor":
        d = grid.nanmean(dim=2).mean(dim=1)[:, None, None, None]  # [A, 1, 1, 1]
    else:
        raise ValueError(f"mix mode must be one of {MIX_MODES}, got {mode!r}")
    w = torch.softmax(-d / temperature, dim=0)
    if bool(covered.all()):
        return w
    w = w * covered[:, None, None, :]  # [A, L|1, H|1, n]: shorter anchors drop out past their end
    return w / w.sum(dim=0, keepdim=True).clamp_min(1e-30)


def l2_distances(new_v: torch.Tensor, anchors: list[Anchor]) -> torch.Tensor:
    """L2 norm of ``v_new - v_anchor`` over the whole placeholder (every layer, head, token and channel
    of its first n tokens): [num_anchors]. The scale KVCOMM's public code gates on (softmax at
    temperature 1): it grows with the placeholder, so gaps between anchors are units, not hundredths.
    An anchor shorter than the placeholder is compared on its m tokens and its norm scaled by sqrt(n / m),
    the norm n tokens would have at the same mean square.
    """
    n = new_v.shape[2]
    new = new_v.float()
    out = []
    for a in anchors:
        m = min(n, a.num_tokens)
        out.append((new[:, :, :m] - a.base_v[:, :, :m].float()).norm() * math.sqrt(n / m))
    return torch.stack(out)


def normalized_entropy(weights: torch.Tensor) -> float:
    """Entropy of a weight vector over log(its length): 0 = one anchor takes all, 1 = uniform."""
    if weights.numel() <= 1:
        return 0.0
    p = weights.clamp_min(1e-12)
    return float(-(p * p.log()).sum() / math.log(weights.numel()))


def _as_grid(weights: torch.Tensor) -> torch.Tensor:
    """[A] -> [A, 1, 1, 1]; [A, L] -> [A, L, 1, 1]; [A, L|1, H|1, n|1] as it is."""
    if weights.dim() == 1:
        return weights[:, None, None, None]
    if weights.dim() == 2:
        return weights[:, :, None, None]
    return weights


def mix(weights: torch.Tensor, tensors: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """sum_a w_a * t_a[:, :, :num_tokens] for [L, Hkv, n_a, hd] tensors; ``weights`` is [num_anchors] (one
    weight for all layers), [num_anchors, L] (one per layer) or [num_anchors, L|1, Hkv|1, n|1] (see
    ``mixing_weights``). A tensor shorter than ``num_tokens`` adds to its own first n_a tokens only."""
    grid = _as_grid(weights)
    out = torch.zeros_like(tensors[0][:, :, :1]).expand(-1, -1, num_tokens, -1).contiguous()
    for w, t in zip(grid, tensors, strict=True):
        if w.max() <= 1e-6:  # negligible anchors cost a full tensor pass for nothing
            continue
        m = min(num_tokens, t.shape[2])
        w = w[..., :m] if w.shape[-1] > 1 else w  # [L|1, H|1, m|1]
        if w.numel() == 1:
            out[:, :, :m].add_(t[:, :, :m], alpha=float(w))
        else:
            out[:, :, :m].add_(t[:, :, :m] * w.to(t.dtype)[..., None])  # [L|1, H|1, m|1, 1] over channels
    return out
