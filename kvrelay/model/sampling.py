"""Next-token choice: greedy, or temperature with nucleus (top-p) sampling.

Sampling is numerically safe for every temperature and top_p the config accepts: the logits are shifted
by their maximum before the temperature divides them (so ``(logit - max) / temperature`` is <= 0, the top
token's exactly 0: no overflow to inf, no inf - inf = NaN, however small the temperature), a temperature
below ``MIN_TEMPERATURE`` is greedy (so the divisor is never a float32 denormal or 0), and top-p always
keeps the most likely token (a top_p that rounds to 0 in float32 still samples).
Logits the model got wrong (NaN, +inf, or nothing allowed) raise ``SamplingError`` instead of
sampling garbage, so the caller can fail that one sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvrelay.errors import ConfigError

# Below this the distribution is the argmax for any logit gap float32 logits resolve, so the sampler
# takes the argmax outright (ties aside, what sampling at that temperature would give).
MIN_TEMPERATURE = 1e-6


class SamplingError(RuntimeError):
    """Logits no token can be sampled from (NaN, +inf, or every token masked): the model's fault, not the
    request's, and that sequence's alone."""


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

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


class Sampler:
    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(config.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] -> token id."""
        top = float(logits.detach().max())  # NaN if any logit is, +inf if any is, -inf if all are
        if not math.isfinite(top):
            raise SamplingError("every token's logit is -inf: no token can be sampled" if top < 0 else
                                "the model produced non-finite logits (NaN or +inf) for this sequence")
        if self.config.greedy:
            return int(logits.argmax())  # the first of tied maxima, as before
        scores = logits.detach().float().cpu()
        # shifted by the max first: every exponent is <= 0, the top token's is exactly 0 (no overflow, no NaN)
        probs = torch.softmax((scores - top) / self.config.temperature, dim=-1)
        if self.config.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p; the top token always stays (its preceding mass is 0)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.config.top_p
            drop[0] = False
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
