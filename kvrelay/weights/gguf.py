"""Read a GGUF file: metadata, and tensors dequantized to fp32 in Hugging Face naming and layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrelay.errors import CorruptModelError, UnsupportedModelError
from kvrelay.model.config import ModelConfig
from kvrelay.model.int4 import GROUP_SIZE, Int4Blocks
from kvrelay.weights.configs import config_from_gguf
from kvrelay.weights.gguf_digests import check_gguf_magic

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 norms its blocks' inputs and outputs: llama.cpp's ffn_norm is the MLP's input norm there.
_SANDWICH_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                         "post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str, sandwich_norms: bool = False) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        mapped = (_SANDWICH_LAYER_NAMES if sandwich_norms else _LAYER_NAMES).get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{suffix}"
    mapped = _TOP_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{suffix}"


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    # [H, 2, rows/H/2, ...] in HF order was permuted to [H, rows/H/2, 2, ...]; swap back.
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _in_hf_row_order(rows: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """A Llama Q/K weight's rows (or per-row block data) back in HF order; any other tensor as it is."""
    if config.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        return _unpermute(rows, config.num_heads if "q_proj" in name else config.num_kv_heads)
    return rows


def _open(path: Path) -> Any:
    import gguf  # imported lazily: only conversions need it

    check_gguf_magic(path)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors/IndexErrors on truncation
        raise CorruptModelError(f"{path}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        meta[key] = value
    return meta


def read_gguf(path: Path, progress: bool = True) -> tuple[dict[str, Any], ModelConfig, dict[str, torch.Tensor]]:
    """Metadata, config and fp32 state dict (HF names) of a GGUF checkpoint."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    reader = _open(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(meta, has_output_weight="output.weight" in names)
    state: dict[str, torch.Tensor] = {}
    tensors = tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", disable=not progress,
                   leave=False)
    for t in tensors:
        name = _hf_name(t.name, config.traits.sandwich_norms)
        if name is None:
            if t.name.startswith("rope_freqs"):
                continue  # llama3 frequency factors: recomputed from the config
            raise UnsupportedModelError(f"{path}: unexpected tensor {t.name!r}")
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from exc
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        arr = np.asarray(arr).reshape(shape)
        arr = _in_hf_row_order(arr, name, config)
        if config.traits.norm_offset and name.endswith("norm.weight"):
            arr = arr - 1.0  # llama.cpp's converter stores offset norms' weights as (1 + w); ours hold w
        state[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # writable copy
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return meta, config, state


def _q4_blocks(raw: np.ndarray, has_offset: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 (fp16 scale, 16 bytes of nibbles; offset -8 * scale) or Q4_1 (fp16 scale and offset, nibbles):
    raw [N, K/32, 18 or 20] -> q [N, K/32, 32], scale and offset [N, K/32]."""
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    offset = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_offset else -8.0 * scale
    nibbles = raw[..., -16:]  # weight j in the low nibble of byte j, weight j + 16 in its high nibble
    return np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1), scale, offset


def _q4_k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: super-blocks of 256 (fp16 d and dmin, 6-bit scale and min for each 32, 128 bytes of nibbles):
    raw [N, K/256, 144] -> q [N, K/32, 32], scale d * sc and offset -dmin * m [N, K/32]."""
    from gguf.quants import Q4_K

    rows, supers = raw.shape[:2]
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, K/256, 1]
    dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))  # [N * K/256, 8] each
    scale = d * sc.reshape(rows, supers, 8).astype(np.float32)  # [N, K/256, 8]
    offset = -(dmin * m.reshape(rows, supers, 8).astype(np.float32))
    chunks = raw[..., 16:].reshape(rows, supers, 4, 1, 32)  # 32 bytes per 64 weights: 32 low nibbles, 32 high
    q = (chunks >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF  # [N, K/256, 4, 2, 32]
    return q.reshape(rows, -1, GROUP_SIZE), scale.reshape(rows, -1), offset.reshape(rows, -1)


# weights and bytes per block, and the block parser, of the GGUF types whose weights are scale * q + offset
# per 32 weights
_INT4_TYPES = {"Q4_0": (32, 18, lambda raw: _q4_blocks(raw, False)),
               "Q4_1": (32, 20, lambda raw: _q4_blocks(raw, True)),
               "Q4_K": (256, 144, _q4_k_blocks)}


def read_int4_blocks(path: Path, config: ModelConfig) -> Int4Blocks:
    """The layer weights a GGUF stores as Q4_0, Q4_1 or Q4_K, undequantized, by HF name: (q uint8 [N, K] in
    0..15, scale fp32 [N, K/32], offset fp32 [N, K/32]) with rows in HF order; ``scale * q + offset`` per
    group of 32 is the weight ``read_gguf`` dequantizes. Other tensors (norms, Q6_K, Q8_0...) are left out."""
    reader = _open(path)
    blocks = {}
    for t in reader.tensors:
        name = _hf_name(t.name, config.traits.sandwich_norms)
        kind = _INT4_TYPES.get(t.tensor_type.name)
        if name is None or kind is None or not name.startswith("model.layers."):
            continue
        block_len, block_bytes, parse = kind
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
        raw = np.asarray(t.data).view(np.uint8).reshape(rows, cols // block_len, block_bytes)  # [N, blocks, bytes]
        q, scale, offset = parse(raw)
        q = q.reshape(rows, cols)  # [N, K]
        q, scale, offset = (_in_hf_row_order(a, name, config) for a in (q, scale, offset))
        blocks[name] = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scale, offset))
    return blocks
