"""A compact Llama-family decoder with a scheduled prefill and a lean decode step.

Module names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``...), so a
``transformers`` state dict loads as is; that is how the parity tests build both sides.
Batch size is 1 throughout: a sequence is a flat [n, hidden] tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.errors import ContextLengthError, ScheduleError
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryEmbedding, apply_rotary
from kvrelay.model.schedule import LayerView, Schedule

if TYPE_CHECKING:
    from kvrelay.cache.kv import SequenceKV


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale after casting back, as transformers does (bitwise parity).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linears that read the same input.

    Decoding is bound by reading weights; one GEMV over the stacked rows runs ~20% faster on CPU
    than three small ones. The Linears' parameters are re-pointed to views of the fused tensor, so
    memory stays single and HF-named state dicts still load into them (copy_ writes the views).
    """
    # Built outside inference mode: an inference tensor as a parameter could never be loaded into again.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        has_bias = linears[0].bias is not None
        bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
        row = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
            if has_bias:
                lin.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
            row += rows
    return weight, bias


def _still_fused(fused: torch.Tensor | None, linears: list[nn.Linear]) -> bool:
    """True while every Linear's weight is still the view of ``fused`` made by fuse_linears."""
    if fused is None:
        return False
    offset = fused.data_ptr()
    for lin in linears:
        if lin.weight.data_ptr() != offset or lin.weight.dtype != fused.dtype:
            return False
        offset += lin.weight.numel() * lin.weight.element_size()
    return True


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self._qkv_w: torch.Tensor | None = None
        self._qkv_b: torch.Tensor | None = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> q [H, n, hd], k [Hkv, n, hd], v [Hkv, n, hd]; q and k rotated."""
        linears = [self.q_proj, self.k_proj, self.v_proj]
        if not _still_fused(self._qkv_w, linears):
            self._qkv_w, self._qkv_b = fuse_linears(linears)
        n, q_dim, kv_dim = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self._qkv_w, self._qkv_b).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [n, H, hd]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, hd]
        v = v.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)  # [Hkv, n, hd]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(0, 1), cos, sin)  # [H, n, hd]
        k = apply_rotary(k.transpose(0, 1), cos, sin)  # [Hkv, n, hd]
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self._gate_up_w: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = [self.gate_proj, self.up_proj]
        if not _still_fused(self._gate_up_w, linears):
            self._gate_up_w, _ = fuse_linears(linears)
        gate, up = F.linear(x, self._gate_up_w).chunk(2, dim=-1)  # [n, inter] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] for the last prompt token, or [n_out, vocab] with all_logits
    num_computed_token_layers: int  # sum over layers of the active-set size
    exit_layer: int | None = None  # set when the schedule's exit test stopped the forward
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # layer -> (prompt indices [m], input hidden states [m, hidden]) for capture layers


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: RotaryEmbedding | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def rope(self) -> RotaryEmbedding:
        device = self.lm_head.weight.device
        if self._rope is None or self._rope.device != device:
            self._rope = RotaryEmbedding(self.config, device)
        return self._rope

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()

    def _mask(self, q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
        """Bool [n_q, num_keys], True = visible: causal by position (+ sliding window)."""
        k_pos = torch.arange(num_keys, device=q_pos.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        window = self.config.sliding_window
        if window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < window
        return mask

    def _attend(self, q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """q [H, n, hd] against key/value segments ([Hkv, m_i, hd] each, position order) -> [n, H * hd].

        ``mask``: bool [n, sum m_i], True = visible. One segment is the usual contiguous cache (SDPA);
        several come from a shared-prefix cache, whose prefix is not copied next to the branch's rows.
        """
        if len(segments) == 1:
            k_all, v_all = segments[0]
            out = F.scaled_dot_product_attention(
                q[None], k_all[None], v_all[None], attn_mask=None if mask is None else mask[None, None],
                is_causal=causal, enable_gqa=q.shape[0] != k_all.shape[0],
            )  # [1, H, n, hd]
            return out[0].transpose(0, 1).reshape(q.shape[1], -1)
        num_heads, n, head_dim = q.shape
        num_kv_heads = segments[0][0].shape[0]
        group = num_heads // num_kv_heads
        if causal and mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # query heads j*group .. j*group+group-1 read kv head j (HF's repeat_kv order)
        qg = q.reshape(num_kv_heads, group * n, head_dim)  # [Hkv, g*n, hd]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)  # softmax in at least fp32
        scores = torch.cat([qg @ k.transpose(1, 2) for k, _ in segments], dim=-1).to(acc_dtype)  # [Hkv, g*n, m]
        scores = scores * head_dim ** -0.5
        if mask is not None:
            scores = scores.view(num_kv_heads, group, n, -1).masked_fill(~mask, float("-inf"))
            scores = scores.view(num_kv_heads, group * n, -1)
        probs = scores.softmax(-1).to(q.dtype)
        out = None
        for p, (_, v) in zip(probs.split([k.shape[1] for k, _ in segments], dim=-1), segments, strict=True):
            out = p @ v if out is None else out + p @ v  # [Hkv, g*n, hd]
        return out.view(num_heads, n, head_dim).transpose(0, 1).reshape(n, -1)

    def check_length(self, num_positions: int) -> None:
        limit = self.config.max_position_embeddings
        if num_positions > limit:
            raise ContextLengthError(
                f"{num_positions} positions do not fit the model's context length of {limit} tokens"
            )

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: SequenceKV, schedule: Schedule | None = None,
                all_logits: bool = False) -> PrefillResult:
        """Scheduled prefill of a whole prompt into ``cache`` (slot = position, 0..n-1).

        token_ids: [n]. Tokens the schedule never activates at a layer must already be in the cache.
        """
        schedule = schedule or Schedule()
        n = int(token_ids.shape[0])
        self.check_length(n)
        cache.ensure_capacity(n)
        device, dtype = self.device, self.dtype
        token_ids = token_ids.to(device)
        cos_all, sin_all = self.rope.cos_sin(torch.arange(n, device=device), dtype, n)
        entries = schedule.entries(n)
        if any(layer > 0 and e.hidden is None for layer, e in entries.items()):
            raise ScheduleError("a token entering above layer 0 needs its carried hidden state")
        window = self.config.sliding_window

        active = torch.empty(0, dtype=torch.long, device=device)  # prompt indices, ascending
        h = torch.empty(0, self.config.hidden_size, dtype=dtype, device=device)
        mask, mask_key, causal = None, None, False
        computed, exit_layer = 0, None
        captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for li, layer in enumerate(self.model.layers):
            entry = entries.get(li)
            if entry is not None and entry.token_idx.numel():
                idx = entry.token_idx.to(device)
                new_h = self.model.embed_tokens(token_ids[idx]) if entry.hidden is None else entry.hidden
                active, order = torch.sort(torch.cat([active, idx]))
                h = torch.cat([h, new_h.to(device, dtype)])[order]
                mask_key = None
            n_act = active.numel()
            if li in schedule.capture_layers and n_act:
                captured[li] = (active.clone(), h.clone())
            if n_act == 0:
                continue
            computed += n_act
            if mask_key is None:  # the active set changed: rebuild the mask once
                full_causal = n_act == n and (window is None or n <= window)
                causal = full_causal  # rows 0..n-1 against keys 0..n-1: SDPA's own causal mask
                mask = None if full_causal else self._mask(active, n)
                cos, sin = cos_all[active], sin_all[active]
                mask_key = True
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = attn.qkv(x, cos, sin)
            prev_k = prev_v = None
            if schedule.has_layer_hook and schedule.needs_prev_kv(li):
                prev_k, prev_v = cache.gather(li, active)
            cache.write(li, active, k, v)
            segments = cache.kv(li, 0, n)  # [(Hkv, m, hd) K, V] covering positions 0..n-1
            h = h + attn.o_proj(self._attend(q, segments, mask, causal))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if schedule.has_layer_hook:
                view = LayerView(li, active, h, q, k, v, prev_k, prev_v,
                                 _attention_probs=self._probs_fn(q, segments, active, n))
                keep = schedule.after_layer(view)
                if keep is not None and not bool(keep.all()):
                    active, h, mask_key = active[keep], h[keep], None
            if schedule.has_exit_test and n_act and active[-1] == n - 1 and schedule.exit_after(li, h[-1]):
                exit_layer = li
                break
        cache.length = max(cache.length, n)
        if exit_layer is None:
            cache.check_filled(n)
        if active.numel() == 0 or int(active[-1]) != n - 1:
            raise ScheduleError("the last prompt token must stay active to the top layer to give logits")
        logits = self.logits_from_hidden(h if all_logits else h[-1])
        return PrefillResult(logits, computed, exit_layer, captured)

    def _probs_fn(self, q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], active: torch.Tensor,
                  n: int):
        def probs(rows: torch.Tensor) -> torch.Tensor:
            group = q.shape[0] // segments[0][0].shape[0]
            qr = q[:, rows]  # [H, n_q, hd]
            # per segment, repeat kv heads for their query heads; scores (not keys) are concatenated
            scores = torch.cat([qr @ k.repeat_interleave(group, dim=0).transpose(1, 2) for k, _ in segments],
                               dim=-1) * q.shape[-1] ** -0.5  # [H, n_q, n]
            visible = self._mask(active[rows], n)
            return scores.masked_fill(~visible[None], float("-inf")).softmax(-1)

        return probs

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def decode_step(self, token_id: int, cache: SequenceKV,
                    capture_layers: tuple[int, ...] = (), captured: dict[int, list] | None = None
                    ) -> torch.Tensor:
        """Feed one token at position ``cache.length``; returns next-token logits [vocab].

        With ``capture_layers``, appends each such layer's input hidden state ([hidden]) to
        ``captured[layer]`` (RelayCaching carries these to the downstream agent).
        """
        pos = cache.length
        self.check_length(pos + 1)
        cache.ensure_capacity(pos + 1)
        device, dtype = self.device, self.dtype
        positions = torch.tensor([pos], device=device)
        cos, sin = self.rope.cos_sin(positions, dtype, pos + 1)
        h = self.model.embed_tokens(torch.tensor([token_id], device=device))  # [1, hidden]
        window = self.config.sliding_window
        start = 0 if window is None else max(0, pos + 1 - window)
        for li, layer in enumerate(self.model.layers):
            if captured is not None and li in capture_layers:
                captured.setdefault(li, []).append(h[0].clone())
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)
            cache.write_range(li, pos, k, v)
            h = h + attn.o_proj(self._attend(q, cache.kv(li, start, pos + 1), None, False))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length = pos + 1
        return self.logits_from_hidden(h[0])
