"""OpenAI's ``logit_bias``, ``frequency_penalty`` and ``presence_penalty``, as a ``LogitsMask`` in a sequence's chain.

``Penalties`` is a request's setting; ``new_mask(inner)`` gives one call's ``PenalizedLogits``, which wraps the call's
own constraint (a grammar, or None) and changes the logits the sampler sees, greedy included, as OpenAI defines it::

    logit[j] + logit_bias[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty

where ``count[j]`` is how often token ``j`` occurs in this call's generated output so far (the prompt does not
count). The constraint's -inf stays -inf (-inf plus a finite bias). Per call, so each sequence of a batched decode
step has its own counts. Log-probabilities are reported before the bias and penalties (``unadjusted``), as OpenAI
does since 2024: they describe the model, not the request's nudges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """A request's bias and penalties; zeros and an empty bias change nothing (``active`` is False)."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def active(self) -> bool:
        return any(bias != 0 for _, bias in self.logit_bias) or self.frequency_penalty != 0 \
            or self.presence_penalty != 0

    def new_mask(self, inner=None) -> PenalizedLogits:
        """One call's state, around that call's own constraint ``inner`` (a ``LogitsMask`` or None)."""
        return PenalizedLogits(self, inner)


class PenalizedLogits:
    """One call's bias and penalties (``kvrelay.engine.engine.LogitsMask``), around its constraint ``inner``."""

    def __init__(self, penalties: Penalties, inner=None) -> None:
        self.penalties, self.inner = penalties, inner
        self.counts: torch.Tensor | None = None  # [vocab] occurrences in the output, on the logits' device
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values), on the logits' device
        self.unadjusted: torch.Tensor | None = None  # the last step's logits before the bias and penalties

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        masked = logits if self.inner is None else self.inner.apply(logits)
        self.unadjusted = masked
        adjusted = masked.float().clone()
        p = self.penalties
        if p.logit_bias:
            if self.bias is None:  # built once: the device is known with the first logits
                ids, values = zip(*p.logit_bias, strict=True)
                self.bias = (torch.tensor(ids, dtype=torch.long, device=logits.device),
                             torch.tensor(values, dtype=torch.float32, device=logits.device))
            adjusted.index_add_(0, *self.bias)
        if self.counts is not None:
            adjusted -= self.counts * p.frequency_penalty + (self.counts > 0).float() * p.presence_penalty
        return adjusted

    def advance(self, token_id: int) -> None:
        # the constraint first: when it refuses the token (TokenRefused) nothing here has changed either
        if self.inner is not None:
            self.inner.advance(token_id)
        p = self.penalties
        if p.frequency_penalty == 0 and p.presence_penalty == 0:
            return
        if self.counts is None:  # the engine applies a mask before it advances it: the logits' shape is known
            self.counts = torch.zeros(self.unadjusted.shape[-1], dtype=torch.float32, device=self.unadjusted.device)
        self.counts[token_id] += 1

    def mask_first(self, logits: torch.Tensor) -> torch.Tensor:
        """The first token's logits as its logprobs show them: the constraint's mask, not the bias (see above)."""
        mask_first = getattr(self.inner, "mask_first", None)
        return logits if mask_first is None else mask_first(logits)

    def logprob_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What a step's logprobs are computed from: that step's logits before the bias and penalties."""
        return logits if self.unadjusted is None else self.unadjusted
