"""Next-token choice: greedy, or temperature with min-p, top-k and nucleus (top-p) sampling, in vLLM's order.

The filters apply to the tempered distribution, as vLLM's sampler does: min-p drops the tokens whose probability
is below ``min_p`` times the top token's, then top-k keeps the ``top_k`` most likely (those tied with the k-th
too), then top-p keeps the smallest set whose mass, renormalized over what is left, reaches ``top_p``. Greedy
ignores all three (vLLM resets them at temperature 0).

Sampling is numerically safe for every temperature and top_p the config accepts: the logits are shifted
by their maximum before the temperature divides them (so ``(logit - max) / temperature`` is <= 0, the top
token's exactly 0: no overflow to inf, no inf - inf = NaN, however small the temperature), a temperature
below ``MIN_TEMPERATURE`` is greedy (so the divisor is never a float32 denormal or 0), and top-p always
keeps the most likely token (a top_p that rounds to 0 in float32 still samples), as min-p (its threshold is at most
the top token's probability) and top-k (k >= 1) do.
Logits the model got wrong (NaN, +inf, or nothing allowed) raise ``SamplingError`` instead of
sampling garbage, so the caller can fail that one sequence.
"""

from __future__ import annotations

import math

import torch

from kvrelay.model.sampling_config import MIN_TEMPERATURE, SamplingConfig

__all__ = ["MIN_TEMPERATURE", "Sampler", "SamplingConfig", "SamplingError"]


class SamplingError(RuntimeError):
    """Logits no token can be sampled from (NaN, +inf, or every token masked): the model's fault, not the
    request's, and that sequence's alone."""


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
        probs = self._min_p_top_k(probs)
        if self.config.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p; the top token always stays (its preceding mass is 0)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.config.top_p
            drop[0] = False
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _min_p_top_k(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` without the tokens min-p and top-k drop, renormalized (unchanged when both are off)."""
        min_p, top_k = self.config.min_p, self.config.top_k
        if min_p <= 0 and (top_k <= 0 or top_k >= probs.numel()):
            return probs
        if min_p > 0:  # the top token's probability is the max: its own threshold is min_p <= 1 times itself
            probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
        if 0 < top_k < probs.numel():  # ties with the k-th value stay, as in vLLM's threshold
            kth = torch.topk(probs, top_k).values[-1]
            probs = torch.where(probs < kth, 0.0, probs)
        return probs / probs.sum()
