"""Model configuration: one dataclass for every supported decoder family.

Validated at construction; ``kvrelay.weights.configs`` builds one from a Hugging Face ``config.json``
dict or from GGUF metadata.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvrelay.errors import ConfigError, UnsupportedModelError


@dataclass(frozen=True)
class FamilyTraits:
    """How a family's block differs from Llama's, in one place: the modules read these, not the family name.

    Everything supported is a Llama-shaped decoder (RMSNorm, gated MLP, rotate-half RoPE, grouped-query
    attention); per-checkpoint differences (qkv bias, q/k norm, windows) are ``ModelConfig`` fields instead.
    """

    norm_offset: bool = False  # RMSNorm scales by (1 + w): weights are stored as offsets from 1
    activation: str = "silu"  # the MLP gate: "silu" or "gelu_tanh"
    sandwich_norms: bool = False  # a norm on the attention output and around the MLP, not only before them
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "gelu_tanh"):
            raise ConfigError(f"family traits: activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")


# model_type (HF) -> what sets the family apart (Gemma 3 also has local/global layers: ``layer_types``)
FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(),
    "mistral": FamilyTraits(),
    "qwen2": FamilyTraits(),
    "qwen3": FamilyTraits(),
    "gemma3": FamilyTraits(norm_offset=True, activation="gelu_tanh", sandwich_norms=True, embed_scale=True),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)
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
    def traits(self) -> FamilyTraits:
        return FAMILIES[self.family]

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
