"""Attention over keys held in several tensors: each part attended on its own, the parts merged exactly.

A sequence cache that reads reused K/V in place from the stored spans (``cache.refs``) has a layer's keys
in several places: runs of its own buffer and the spans' rows. Softmax attention splits over disjoint key
sets: with each part's output ``o_i`` (normalised over its keys) and log-sum-exp ``l_i`` of its scores,
the whole is ``sum_i o_i * exp(l_i - logsumexp_j l_j)``. CPU only: the log-sum-exp comes from the CPU flash
kernel (the same one ``layers.attention`` runs there).

Grouped-query attention without repeating K/V: the ``group`` query heads that share a KV head are folded
into the query rows ([H, n, hd] -> [Hkv, group * n, hd]), so each part's mask is the [n, m] one repeated
``group`` times along its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PartMask:
    """One key part's mask, as the folded queries use it."""

    additive: torch.Tensor  # [group * n, m] float: 0 visible, -inf not
    sees_any: torch.Tensor | None  # [group * n] bool: rows that see some key here (None: every row does)


def fold_mask(visible: torch.Tensor, group: int, dtype: torch.dtype) -> PartMask | None:
    """A part's bool mask [n, m] (True = visible) for folded queries; None when no row sees any of its keys
    (the part can be skipped)."""
    sees = visible.any(dim=1)  # [n]
    if not bool(sees.any()):
        return None
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).repeat(group, 1)
    return PartMask(additive, None if bool(sees.all()) else sees.repeat(group))


def fold_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [H, n, hd] -> [Hkv, group * n, hd] (query heads j*group .. j*group+group-1 read kv head j)."""
    heads, n, hd = q.shape
    return q.reshape(num_kv_heads, heads // num_kv_heads * n, hd)


def attention_parts(queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                    masks: list[PartMask], num_heads: int) -> torch.Tensor:
    """Attention of folded queries ([Hkv, group * n, hd], one per part: a part whose keys were moved reads
    queries rotated back by the move) over the parts' keys and values ([Hkv, m_i, hd]) -> [n, H * hd]."""
    outs, lses = [], []
    for q, k, v, mask in zip(queries, keys, values, masks, strict=True):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, False, attn_mask=mask.additive[None, None])[:2]
        lse, out = lse[0], out[0]  # [Hkv, group * n], [Hkv, group * n, hd]
        if mask.sees_any is not None:  # a row that sees no key here: its part weighs nothing (whatever the kernel
            lse = lse.masked_fill(~mask.sees_any, float("-inf"))  # returns for it: 0 and 0 on torch 2.13)
            out = out.masked_fill(~mask.sees_any[:, None], 0.0)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        merged = outs[0]
    else:
        weights = torch.stack(lses).softmax(dim=0)  # [parts, Hkv, group * n]: exp(l_i - logsumexp_j l_j)
        merged = outs[0] * weights[0, ..., None]
        for out, w in zip(outs[1:], weights[1:], strict=True):
            merged.addcmul_(out, w[..., None])
    num_kv_heads, rows, hd = merged.shape
    n = rows * num_kv_heads // num_heads
    return merged.reshape(num_heads, n, hd).transpose(0, 1).reshape(n, num_heads * hd)
