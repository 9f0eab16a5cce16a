"""The connector's forward on vLLM's Llama-layout decoder layers, as vLLM's own layer runs them.

The connector's methods (``plan.CONNECTOR_METHODS``) compute a fixed set of prompt positions at every layer (a
static schedule: the gaps between reused runs and the tokens the method repairs), attending to every position
before each. Through kvrelay's modules (``binding``) that forward spends ~0.85 ms a computed token beyond the linear
products on SmolLM2, against vLLM's ~0.3: kvrelay's norm, RoPE and MLP activation are several tensor operations
each, with a temporary per operation, and its scheduled prefill's per-layer bookkeeping serves schedules that
change the active set, which these methods never do. Here each layer is the body of vLLM's ``LlamaDecoderLayer``
with vLLM's own modules: its fused RMS norm (the residual added inside it), its qkv projection, its in-place
rotary embedding, its fused gate/up activation and down projection, the same operations in the same order as vLLM's
prefill computes for these tokens. Only the attention is kvrelay's: vLLM's attention layer reads and writes its
paged cache through the step's forward context, which does not exist between forwards; the fresh K/V go into the
load's sequence cache and the queries attend over it (causal by position, over the reused rows too).

The last layer stops once its K/V are written: nothing reads its output (no logits are needed).

The queries attend in a few chunks of rows (``attention_chunks``), each over the keys up to its last position only: a
mask hides scores without skipping their work, and the computed tokens of a reused prompt are spread over it (new
leading tokens, each moved run's first tokens, the framing between runs), so one [m, n] mask computes about twice the
scores that causality lets through. A few SDPA calls a layer cost less than those scores.

A layout this does not cover (Gemma's sandwich norms, query/key norms, sliding windows, scaled embeddings, scores
scaled otherwise than by ``head_dim ** -0.5``) is refused at bind time (``bind_layers`` returns None) and the
connector computes through kvrelay's modules instead.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.cache.kv import SequenceKV
from kvrelay.model.config import ModelConfig
from kvrelay.model.layers import visible_mask

_ATTENTION = ("qkv_proj", "o_proj", "rotary_emb")
MAX_ATTENTION_CHUNKS = 4  # SDPA calls a layer's attention is split into, at most
_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


def _out(result: torch.Tensor | tuple) -> torch.Tensor:
    """A vLLM linear module's output (they return (output, bias) pairs)."""
    return result[0] if isinstance(result, tuple) else result


def attention_chunks(positions: list[int], max_chunks: int = MAX_ATTENTION_CHUNKS) -> list[tuple[int, int]]:
    """Rows [start, end) of ``positions`` (ascending) cut into at most ``max_chunks`` chunks, each attending to keys
    [0, positions[end - 1] + 1), so that the scores computed (rows times keys, summed) are fewest, in as few chunks
    as come within 10% of that: exact over cuts between runs of consecutive positions, at most 64 cut candidates
    (evenly spread where there are more)."""
    m = len(positions)
    if m == 0:
        return []
    cuts = [i for i in range(1, m) if positions[i] != positions[i - 1] + 1]
    if len(cuts) > 64:
        cuts = [cuts[round(j * (len(cuts) - 1) / 63)] for j in range(64)]
    bounds = [0, *cuts, m]  # candidate chunk edges, as row indices
    num = len(bounds)

    def cost(a: int, b: int) -> int:  # rows bounds[a]..bounds[b] as one chunk
        return (bounds[b] - bounds[a]) * (positions[bounds[b] - 1] + 1)

    # best[c][j]: the fewest scores of rows [0, bounds[j]) in c chunks; back[c][j]: where its last chunk starts
    inf = float("inf")
    best = [[inf] * num for _ in range(max_chunks + 1)]
    back = [[0] * num for _ in range(max_chunks + 1)]
    best[0][0] = 0
    for c in range(1, max_chunks + 1):
        for j in range(1, num):
            for i in range(j):
                total = best[c - 1][i] + cost(i, j)
                if total < best[c][j]:
                    best[c][j], back[c][j] = total, i
    # each chunk is an SDPA call of its own: the fewest chunks within 10% of the fewest scores
    fewest = min(best[c][num - 1] for c in range(1, max_chunks + 1))
    chunks_used = next(c for c in range(1, max_chunks + 1) if best[c][num - 1] <= 1.1 * fewest)
    edges, j = [], num - 1
    for c in range(chunks_used, 0, -1):
        edges.append((bounds[back[c][j]], bounds[j]))
        j = back[c][j]
    return edges[::-1]


class VllmLayersForward:
    """K/V of a fixed set of positions at every layer, through vLLM's decoder-layer modules (see the module)."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module, layers: list[nn.Module]) -> None:
        self.config, self.embed, self.layers = cfg, embed, layers
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def compute_kv(self, token_ids: torch.Tensor, cache: SequenceKV, active: torch.Tensor) -> None:
        """The K/V of positions ``active`` ([m] ascending) of ``token_ids`` ([n], n = active[-1] + 1) at every layer
        into ``cache``, which holds every other position below n already."""
        n, m = int(token_ids.shape[0]), int(active.numel())
        cfg = self.config
        cache.ensure_capacity(n)
        positions = active.tolist()
        # per chunk of rows: (start, end, keys, mask [end - start, keys] or None where its rows are every position
        # below its keys: SDPA's own causal mask), built once for every layer
        chunks = []
        for start, end in attention_chunks(positions):
            keys = positions[end - 1] + 1
            causal = end - start == keys
            chunks.append((start, end, keys, causal, None if causal else visible_mask(active[start:end], keys, None)))
        hidden = self.embed(token_ids.index_select(0, active))  # [m, hidden]
        residual = None
        last = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            attn = layer.self_attn
            q, k, v = _out(attn.qkv_proj(hidden)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = attn.rotary_emb(active, q, k)  # [m, H * hd], [m, Hkv * hd]
            k_heads = k.view(m, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)  # [Hkv, m, hd]
            v_heads = v.view(m, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            if m == n:
                cache.write_range(li, 0, k_heads, v_heads)
            else:
                cache.write(li, active, k_heads, v_heads)
            if li == last:  # its output feeds nothing: only its K/V are kept
                break
            q_heads = q.reshape(m, cfg.num_heads, cfg.head_dim).transpose(0, 1)  # [H, m, hd]
            outs = [cache.attend(li, q_heads[:, start:end], mask, causal, keys)  # [end - start, H * hd] each
                    for start, end, keys, causal, mask in chunks]
            hidden = _out(attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs)))  # [m, hidden]
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden)
        cache.length = max(cache.length, n)
        cache.check_filled(n)  # no position left without K/V


def bind_layers(cfg: ModelConfig, vllm_model: nn.Module) -> VllmLayersForward | None:
    """``VllmLayersForward`` on ``vllm_model``'s modules where its layers have vLLM's Llama layout and ``cfg`` needs
    nothing that layout's body leaves out; None otherwise."""
    traits = cfg.traits
    if cfg.qk_norm or traits.sandwich_norms or traits.embed_scale or traits.norm_offset or cfg.rope_local_theta \
            or any(cfg.window_at(li) is not None for li in range(cfg.num_layers)) \
            or (cfg.query_pre_attn_scalar or cfg.head_dim) != cfg.head_dim:
        return None
    backbone = getattr(vllm_model, "model", None)
    layers = list(getattr(backbone, "layers", []))
    embed = getattr(backbone, "embed_tokens", None)
    if embed is None or len(layers) != cfg.num_layers:
        return None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if not all(hasattr(layer, name) for name in _LAYER) or not all(hasattr(attn, name) for name in _ATTENTION):
            return None
        if abs(getattr(attn, "scaling", cfg.head_dim**-0.5) - cfg.head_dim**-0.5) > 1e-12:
            return None
    return VllmLayersForward(cfg, embed, layers)
