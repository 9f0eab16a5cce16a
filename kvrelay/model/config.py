"""Model configuration: one dataclass for every supported decoder family.

Built from a Hugging Face ``config.json`` dict or from GGUF metadata, validated at construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvrelay.errors import ConfigError, UnsupportedModelError

# model_type (HF) -> family flags. Everything here is a Llama-shaped decoder: RMSNorm, SwiGLU MLP,
# rotate-half RoPE, grouped-query attention. Families differ in qkv bias, q/k norm, sliding window.
# Gemma 3 adds (1 + w) norms around attention and MLP, a GELU MLP, scaled embeddings, local/global layers.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
GEMMA3_FIELDS = ("layer_types", "rope_local_theta", "query_pre_attn_scalar")


def gemma3_layer_types(num_layers: int, pattern: int | list[bool] = 6) -> tuple[str, ...]:
    """Every ``pattern``-th layer global, the rest sliding (Gemma 3's default), or per layer True = sliding."""
    sliding = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type + its parameters
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: a key is visible iff q_pos - k_pos < window
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3: "sliding_attention" | "full_attention" per layer (() = every layer alike, windowed iff
    # sliding_window); the sliding layers' RoPE base; scores scaled by query_pre_attn_scalar ** -0.5
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"model config: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def gemma(self) -> bool:
        return self.family == "gemma3"

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window (with the local RoPE base, if any)."""
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def window_at(self, layer: int) -> int | None:
        return self.sliding_window if self.is_local(layer) else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"], d["layer_types"] = list(self.eos_token_ids), list(self.layer_types)
        # Gemma 3's fields are left out when unset: older models' fingerprints (profile keys) stay the same
        return {k: v for k, v in d.items() if v or k not in GEMMA3_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
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
        return cls(
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

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
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
        return cls(
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
