"""``SamplingConfig``: how a sequence picks its next tokens, validated at construction (``kvrelay.model.sampling``
samples with it). Torch-free, so that the CLI derives ``kvrelay generate``'s flags from it without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.errors import ConfigError

# Below this the distribution is the argmax for any logit gap float32 logits resolve, so the sampler
# takes the argmax outright (ties aside, what sampling at that temperature would give).
MIN_TEMPERATURE = 1e-6


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate at most (>= 1)"})
    temperature: float = field(default=0.0, metadata={"help": "softmax temperature, finite, >= 0; 0 = greedy "
                                                              f"(as is anything below {MIN_TEMPERATURE:g})"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass in (0, 1]; 1 = off"})
    seed: int = field(default=0, metadata={"help": "random seed of the sampler (integer)"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens; 0 or -1 = off (vLLM's)"})
    min_p: float = field(default=0.0, metadata={"help": "drop tokens below min_p x the top token's probability, "
                                                        "in [0, 1]; 0 = off (vLLM's)"})

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.seed) or not -(1 << 63) <= self.seed < (1 << 64):
            raise ConfigError(f"seed must be an integer in [-2**63, 2**64 - 1] (a torch.Generator's seed), "
                              f"got {self.seed!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be an integer: 0 or -1 (off) or at least 1, got {self.top_k!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
