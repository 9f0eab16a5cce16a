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
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
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
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        family = hf.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"unsupported architecture model_type={family!r} "
                f"(architectures={hf.get('architectures')}); supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only silu")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("unsupported: mlp_bias=true")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
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
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        """From GGUF key/values (``general.architecture`` and ``<arch>.*`` keys)."""
        arch = meta.get("general.architecture")
        family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(arch)
        if family is None:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2, qwen3"
            )

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
            qk_norm=family == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
