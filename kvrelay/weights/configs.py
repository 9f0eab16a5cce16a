"""A ``ModelConfig`` from a model file's own description: a Hugging Face ``config.json`` dict (transformers
4.x or 5.x layout) or a GGUF file's key/values. Unsupported architectures and options are refused by name."""

from __future__ import annotations

from typing import Any

from kvrelay.errors import UnsupportedModelError
from kvrelay.model.config import SUPPORTED_FAMILIES, ModelConfig, gemma3_layer_types


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """From a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
    family = {"gemma3_text": "gemma3"}.get(hf.get("model_type"), hf.get("model_type"))
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={hf.get('model_type')!r} "
            f"(architectures={hf.get('architectures')}); supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    gemma, act = family == "gemma3", hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise UnsupportedModelError(f"unsupported hidden activation {act!r} for {family}")
    if hf.get("mlp_bias") or hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping") \
            or hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("unsupported: mlp_bias, logit soft-capping or bidirectional attention")
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters (Gemma 3: one per layer type).
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {}) if gemma else {}
    rope = dict(rope.get("full_attention") or {}) if gemma else rope
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"unsupported RoPE type {local['rope_type']!r} on sliding layers")
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope_scaling = {"rope_type": rope_type, **rope} if rope_type != "default" else {}
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    window = hf.get("sliding_window")
    if family == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if family == "qwen3" and not hf.get("use_sliding_window", False):
        window = None
    if family == "llama" and hf.get("attention_bias"):
        raise UnsupportedModelError("unsupported: llama with attention_bias=true")
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "gemma3"),
        sliding_window=int(window) if window else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        layer_types=tuple(hf.get("layer_types") or gemma3_layer_types(
            int(hf["num_hidden_layers"]), hf.get("sliding_window_pattern", 6))) if gemma else (),
        rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))) if gemma else None,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]) if gemma else None,
    )


def config_from_gguf(meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
    """From GGUF key/values (``general.architecture`` and ``<arch>.*`` keys)."""
    arch = meta.get("general.architecture")
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2, qwen3, gemma3"
        )
    gemma = family == "gemma3"

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads)))
    rope_scaling: dict[str, Any] = {}
    kind = get("rope.scaling.type")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"unsupported GGUF rope.scaling.type {kind!r}")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=not has_output_weight,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "gemma3"),
        sliding_window=get("attention.sliding_window"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        # what a Gemma 3 GGUF may leave out, llama.cpp fixes: 1-in-6 global layers, local base 10k,
        # scores scaled by head_dim ** -0.5 (all sizes but 27B, whose scale differs)
        layer_types=gemma3_layer_types(int(get("block_count")), get("attention.sliding_window_pattern", 6))
        if gemma else (),
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)) if gemma else None,
        query_pre_attn_scalar=float(head_dim) if gemma else None,
    )
