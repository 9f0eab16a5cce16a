"""Next-token choice: greedy, or temperature with nucleus (top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(config.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] -> token id."""
        if self.config.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.config.temperature, dim=-1)
        if self.config.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the top token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.config.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
