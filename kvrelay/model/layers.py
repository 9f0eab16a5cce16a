"""The decoder's modules, each with its own forward, and the one attention function they use.

Module names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``...), so a ``transformers``
state dict loads as is; that is how the parity tests build both sides. Sequences are flat
[n, hidden] tensors; a decode batch is B rows of one token each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrelay.model import packed
from kvrelay.model.config import ModelConfig
from kvrelay.model.int4 import Int4Blocks, Int4Weight, decoding, int4_of
from kvrelay.model.rope import apply_rotary

# (q [H, n, hd], fresh k [Hkv, n, hd], fresh v [Hkv, n, hd]) -> attention output [n, H * hd]: the caller
# decides where the fresh K/V go in which cache and which keys each query sees
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def visible_mask(q_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Bool [n_q, num_keys], True = visible: causal by position, within the sliding window if any."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - k_pos[None, :]) < window
    return mask


# On CUDA, SDPA may pick cuDNN's attention, which builds a plan for every new shape: 40-700 ms on the first
# call at each prompt length on an H200 (research/gpu_check.py), and a server sees a new length on
# nearly every request. Flash and memory-efficient attention have no such cost.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels ``attention`` may use on ``device``, entered once per forward (not per layer)."""
    return sdpa_kernel(_CUDA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def repeat_kv(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[Hkv, m, hd] -> [Hkv * group_size, m, hd]: query heads j*group_size .. (j+1)*group_size-1 read kv head j
    (HF's order)."""
    num_kv, m, hd = x.shape
    return x[:, None].expand(num_kv, group_size, m, hd).reshape(num_kv * group_size, m, hd)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool) -> torch.Tensor:
    """q [H, n, hd] against k, v [Hkv, m, hd] -> [n, H * hd]. ``mask``: bool [n, m], True = visible."""
    gqa = q.shape[0] != k.shape[0]
    # On CUDA, SDPA runs an explicit mask over grouped K/V heads in its math kernel only (the scores
    # materialized, a dozen kernels a layer); K/V repeated per query head take the memory-efficient kernel.
    if gqa and mask is not None and q.device.type == "cuda":
        k, v, gqa = repeat_kv(k, q.shape[0] // k.shape[0]), repeat_kv(v, q.shape[0] // k.shape[0]), False
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None],
        is_causal=causal, enable_gqa=gqa,
    )  # [1, H, n, hd]
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities [H, n, m] of q [H, n, hd] over k [Hkv, m, hd] (for methods that read them)."""
    scores = q.float() @ repeat_kv(k.float(), q.shape[0] // k.shape[0]).transpose(1, 2) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask[None], float("-inf")).softmax(-1)  # [H, n, m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           int4: Int4Weight | None = None) -> torch.Tensor:
    """``F.linear``: through ``int4`` inside decode steps while it stands for ``weight``, else through the
    weight packed for oneDNN where that applies (``kvrelay.model.packed``)."""
    if int4 is None or not decoding() or not int4.stands_for(weight):
        return packed.linear(x, weight, bias)
    out = int4(x)
    return out if bias is None else out + bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale after casting back, as transformers does (bitwise parity);
        # an offset norm (Gemma) scales by (1 + w) before the cast.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype) if self.offset else self.weight * xf.to(x.dtype)


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
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.traits.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.traits.norm_offset)
        self.qk_norm = cfg.qk_norm
        # Gemma 3 scales scores by query_pre_attn_scalar ** -0.5: folded into q, so every attention
        # (SDPA's default head_dim ** -0.5, attention_probs) sees the same scores
        self.q_scale = (cfg.head_dim / (cfg.query_pre_attn_scalar or cfg.head_dim)) ** 0.5
        self._qkv_w: torch.Tensor | None = None
        self._qkv_b: torch.Tensor | None = None
        self.int4_qkv: Int4Weight | None = None
        self.int4_o: Int4Weight | None = None

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        linears = [self.q_proj, self.k_proj, self.v_proj]
        if not _still_fused(self._qkv_w, linears):
            self._qkv_w, self._qkv_b = fuse_linears(linears)
        return self._qkv_w, self._qkv_b

    def attach_int4(self, blocks: Int4Blocks, prefix: str) -> list[Int4Weight | None]:
        """4-bit stand-ins for the weights under ``prefix`` (``model.layers.N.self_attn.``) that have blocks."""
        qkv_w, _ = self.fused_qkv()
        self.int4_qkv = int4_of(qkv_w, [f"{prefix}{p}_proj.weight" for p in "qkv"], blocks)
        self.int4_o = int4_of(self.o_proj.weight, [f"{prefix}o_proj.weight"], blocks)
        return [self.int4_qkv, self.int4_o]

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> q, k and v side by side: [n, (H + 2 * Hkv) * hd]."""
        qkv_w, qkv_b = self.fused_qkv()
        return linear(x, qkv_w, qkv_b, self.int4_qkv)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> q [H, n, hd], k [Hkv, n, hd], v [Hkv, n, hd]; q and k rotated."""
        n, q_dim, kv_dim = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.project_qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [n, H, hd]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, hd]
        v = v.reshape(n, self.num_kv_heads, self.head_dim).transpose(0, 1)  # [Hkv, n, hd]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(0, 1), cos, sin)  # [H, n, hd]
        k = apply_rotary(k.transpose(0, 1), cos, sin)  # [Hkv, n, hd]
        return (q * self.q_scale if self.q_scale != 1.0 else q), k, v

    def out(self, attn_out: torch.Tensor) -> torch.Tensor:
        """The output projection: attn_out [n, H * hd] -> [n, hidden]."""
        return linear(attn_out, self.o_proj.weight, self.o_proj.bias, self.int4_o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self._gate_up_w: torch.Tensor | None = None
        self.gelu = cfg.traits.activation == "gelu_tanh"
        self.int4_gate_up: Int4Weight | None = None
        self.int4_down: Int4Weight | None = None

    def fused_gate_up(self) -> torch.Tensor:
        linears = [self.gate_proj, self.up_proj]
        if not _still_fused(self._gate_up_w, linears):
            self._gate_up_w, _ = fuse_linears(linears)
        return self._gate_up_w

    def attach_int4(self, blocks: Int4Blocks, prefix: str) -> list[Int4Weight | None]:
        """4-bit stand-ins for the weights under ``prefix`` (``model.layers.N.mlp.``) that have blocks."""
        self.int4_gate_up = int4_of(self.fused_gate_up(), [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"],
                                    blocks)
        self.int4_down = int4_of(self.down_proj.weight, [f"{prefix}down_proj.weight"], blocks)
        return [self.int4_gate_up, self.int4_down]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.fused_gate_up(), None, self.int4_gate_up).chunk(2, dim=-1)  # [n, inter] each
        # in place: the product is a temporary, and two fewer [n, inter] allocations pay on CPU prefill
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate, inplace=True)
        return linear(act.mul_(up), self.down_proj.weight, self.down_proj.bias, self.int4_down)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        offset = cfg.traits.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.traits.sandwich_norms
        if self.sandwich:  # each block's output is normalised too (HF's post_attention_layernorm is that one)
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's first half: h [n, hidden] -> q [H, n, hd], k, v [Hkv, n, hd] (rotated)."""
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer's second half: residual + output projection, then the MLP block. h [n, hidden]."""
        if self.sandwich:
            h = h + self.post_attention_layernorm(self.self_attn.out(attn_out))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + self.self_attn.out(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [n, hidden] -> (output [n, hidden], q, fresh k, fresh v). Prefill, decode and batched decode
        all run this body; ``attend`` stores the fresh K/V and attends over the right keys. (A schedule
        that selects tokens from their Q/K/V runs ``project``, selects, then ``finish`` on the rest.)"""
        q, k, v = self.project(h, cos, sin)
        return self.finish(h, attend(q, k, v)), q, k, v
