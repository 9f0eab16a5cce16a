"""One decode step for B sequences that share a prefix by reference (RKSC's branches).

The B caches come from ``SharedPrefixKV.batch``: positions below ``prefix_len`` are one prefix
cache that every row reads, and each row's own positions live in one slot of a common
[L, B, Hkv, cap, hd] tensor. So a step reads the shared prefix once for all rows, runs every
linear layer on [B, hidden] instead of B times on [1, hidden], and attends over two key
segments: the prefix (common keys) and the rows' own keys (padded to the longest row, masked).
Rows sit at different positions (their branch prompts differ in length after the root).
"""

from __future__ import annotations

import torch

from kvrelay.cache.shared import SharedPrefixKV
from kvrelay.errors import ScheduleError


def _check_batch(caches: list[SharedPrefixKV]) -> tuple[SharedPrefixKV, torch.Tensor]:
    """The first cache (which holds the common storage) and the rows' slots in it ([B])."""
    if not caches:
        raise ScheduleError("a batched decode step needs at least one sequence")
    first = caches[0]
    if first.batch_k is None or any(c.batch_k is not first.batch_k for c in caches):
        raise ScheduleError("batched decode needs caches made together by SharedPrefixKV.batch")
    return first, torch.tensor([c.batch_row for c in caches], device=first.device)


def _cos_sin(model, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, hd] for each row's own position (dynamic RoPE depends on each row's length)."""
    if model.rope.rope_type != "dynamic":
        return model.rope.cos_sin(positions, dtype, int(positions.max()) + 1)
    pairs = [model.rope.cos_sin(p[None], dtype, int(p) + 1) for p in positions]
    return torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])


@torch.inference_mode()
def decode_step_batch(model, token_ids: list[int], caches: list[SharedPrefixKV]) -> torch.Tensor:
    """Feed ``token_ids[b]`` at position ``caches[b].length`` for every row b; returns logits [B, vocab].

    Equal (up to float rounding of the batched matmuls) to B calls of ``Transformer.decode_step``.
    """
    first, rows = _check_batch(caches)
    num_rows, prefix_len = len(caches), first.prefix_len
    positions = torch.tensor([c.length for c in caches], device=first.device)  # [B]
    for c in caches:
        model.check_length(c.length + 1)
        if c.length + 1 > c.capacity:
            raise ScheduleError(f"batched cache full: position {c.length} past its capacity of {c.capacity}")
    all_rows = num_rows == first.batch_k.shape[1] and bool((rows == torch.arange(num_rows)).all())
    own_pos = positions - prefix_len  # [B] row index in the own storage
    own_len = int(own_pos.max()) + 1  # own keys any row can see this step
    dtype, cfg = model.dtype, model.config
    cos, sin = _cos_sin(model, positions, dtype)
    # visibility [B, prefix_len + own_len]: causal per row (+ sliding window), own rows past a row's end hidden
    key_pos = torch.arange(prefix_len + own_len, device=first.device)
    mask = key_pos[None, :] <= positions[:, None]
    if cfg.sliding_window is not None:
        mask &= (positions[:, None] - key_pos[None, :]) < cfg.sliding_window
    h = model.model.embed_tokens(torch.tensor(token_ids, device=first.device))  # [B, hidden]
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)  # q [H, B, hd]; k, v [Hkv, B, hd]
        big_k, big_v = first.batch_k[li], first.batch_v[li]  # [B_all, Hkv, cap, hd]
        big_k[rows, :, own_pos] = k.transpose(0, 1)  # row b's own slot own_pos[b]: [B, Hkv, hd]
        big_v[rows, :, own_pos] = v.transpose(0, 1)
        first.batch_filled[li, rows, own_pos] = True
        if all_rows:  # a view, no gather
            own_k, own_v = big_k[:, :, :own_len], big_v[:, :, :own_len]  # [B, Hkv, own_len, hd]
        else:
            own_k, own_v = big_k[rows, :, :own_len], big_v[rows, :, :own_len]
        out = _attend_batch(q, first.prefix.kv(li, 0, prefix_len), own_k, own_v, mask)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    for c in caches:
        c.length += 1
    return model.logits_from_hidden(h)  # [B, vocab]


def _attend_batch(q: torch.Tensor, prefix_segments: list[tuple[torch.Tensor, torch.Tensor]],
                  own_k: torch.Tensor, own_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [H, B, hd] against the common prefix ([Hkv, P_i, hd] segments) and each row's own keys
    (own_k, own_v [B, Hkv, m, hd]); mask bool [B, P + m]. Returns [B, H * hd]."""
    num_heads, num_rows, head_dim = q.shape
    num_kv_heads = own_k.shape[1]
    group = num_heads // num_kv_heads
    # query heads j*group .. j*group+group-1 read kv head j (HF's repeat_kv order)
    qg = q.reshape(num_kv_heads, group, num_rows, head_dim)  # [Hkv, g, B, hd]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # softmax in at least fp32
    prefix_scores = [torch.einsum("kgbd,kpd->kgbp", qg, k) for k, _ in prefix_segments]  # [Hkv, g, B, P_i]
    own_scores = torch.einsum("kgbd,bkmd->kgbm", qg, own_k)  # [Hkv, g, B, m]
    scores = torch.cat([*prefix_scores, own_scores], dim=-1).to(acc_dtype) * head_dim ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)  # [Hkv, g, B, P + m]
    sizes = [k.shape[1] for k, _ in prefix_segments] + [own_k.shape[2]]
    parts = probs.split(sizes, dim=-1)
    out = torch.einsum("kgbm,bkmd->kgbd", parts[-1], own_v)  # [Hkv, g, B, hd]
    for p, (_, v) in zip(parts[:-1], prefix_segments, strict=True):
        out = out + torch.einsum("kgbp,kpd->kgbd", p, v)
    return out.reshape(num_heads, num_rows, head_dim).transpose(0, 1).reshape(num_rows, -1)
