"""OpenAI's ``logit_bias``, ``frequency_penalty`` and ``presence_penalty`` and vLLM's ``repetition_penalty`` and
``min_tokens``, as a ``LogitsMask`` in a sequence's chain.

``Penalties`` is a request's setting; ``new_mask(inner, prompt_ids)`` gives one call's ``PenalizedLogits``, which
wraps the call's own constraint (a grammar, or None) and changes the logits the sampler sees, greedy included, in
vLLM's order:

1. ``logit[j] + logit_bias[j]``; while fewer than ``min_tokens`` tokens were generated, the stop tokens
   (``min_tokens_stop_ids``: the end-of-sequence ids and the request's ``stop_token_ids``) are -inf;
2. repetition (vLLM's, from CTRL): a token ``j`` seen in the prompt or the output so far has a positive logit divided
   by ``repetition_penalty``, a negative one multiplied by it;
3. ``- count[j] * frequency_penalty - (count[j] > 0) * presence_penalty``, as OpenAI defines them,

where ``count[j]`` is how often token ``j`` occurs in this call's generated output so far (the prompt counts for
the repetition penalty only). The constraint's -inf stays -inf (-inf plus a finite bias, times a positive
penalty). Per call, so each sequence of a batched decode step has its own counts. Log-probabilities are reported
before the bias and penalties (``unadjusted``), as OpenAI does: they describe the model, not the request's nudges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """A request's bias and penalties; zeros, an empty bias, a repetition penalty of 1 and no ``min_tokens`` change
    nothing (``active`` is False)."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_tokens: int = 0  # the stop ids are held back until this many tokens were generated
    min_tokens_stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")

    @property
    def active(self) -> bool:
        return any(bias != 0 for _, bias in self.logit_bias) or self.frequency_penalty != 0 \
            or self.presence_penalty != 0 or self.repetition_penalty != 1 \
            or (self.min_tokens > 0 and bool(self.min_tokens_stop_ids))

    @property
    def counts_output(self) -> bool:
        """Whether the output's token counts are needed."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def new_mask(self, inner=None, prompt_ids: list[int] | tuple[int, ...] = ()) -> PenalizedLogits:
        """One call's state, around that call's own constraint ``inner`` (a ``LogitsMask`` or None); ``prompt_ids``:
        the call's prompt (what the repetition penalty counts besides the output)."""
        return PenalizedLogits(self, inner, prompt_ids)


class PenalizedLogits:
    """One call's bias and penalties (``kvrelay.engine.sequence.LogitsMask``), around its constraint ``inner``."""

    def __init__(self, penalties: Penalties, inner=None, prompt_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.penalties, self.inner = penalties, inner
        self.prompt_ids = tuple(prompt_ids) if penalties.repetition_penalty != 1 else ()
        self.num_generated = 0
        self.counts: torch.Tensor | None = None  # [vocab] occurrences in the output, on the logits' device
        self.seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output (repetition penalty)
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
        if self.num_generated < p.min_tokens and p.min_tokens_stop_ids:
            stop_ids = [i for i in p.min_tokens_stop_ids if i < adjusted.shape[-1]]
            held = adjusted.clone()
            held[stop_ids] = float("-inf")
            # a constraint that allows only the end (a grammar complete) ends the answer, min_tokens or not:
            # holding the end back then would leave no token to sample
            if bool(torch.isfinite(held).any()):
                adjusted = held
        if p.repetition_penalty != 1:
            if self.seen is None:  # the prompt's tokens, once the vocabulary's size is known
                self.seen = torch.zeros(adjusted.shape[-1], dtype=torch.bool, device=adjusted.device)
                self.seen[list(self.prompt_ids)] = True
            # times the float32 reciprocal, as vLLM's kernel computes it (x / p can differ from it in the last bit).
            # Any float > 0 is valid (vLLM's range), but one outside float32's normal range is 0 or inf there, and
            # a product past float32's range is inf: the penalty and the product are clamped to finite values (a
            # no-op for any penalty that overflows nothing), so 1e-300 prefers seen tokens, never fails the request
            finfo = torch.finfo(torch.float32)
            penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32, device=adjusted.device)
            penalty = penalty.clamp(finfo.tiny, finfo.max)
            scale = torch.where(adjusted > 0, 1.0 / penalty, penalty)
            scaled = (adjusted * scale).clamp(-finfo.max, finfo.max)
            # a constraint's -inf stays -inf: the clamp would make a banned token sampleable
            adjusted = torch.where(self.seen & torch.isfinite(adjusted), scaled, adjusted)
        if self.counts is not None:
            adjusted -= self.counts * p.frequency_penalty + (self.counts > 0).float() * p.presence_penalty
        return adjusted

    @property
    def ended(self) -> bool:
        """The constraint inside is complete (``kvrelay.engine.sequence.LogitsMask.ended``)."""
        return bool(getattr(self.inner, "ended", False))

    def advance(self, token_id: int) -> None:
        # the constraint first: when it refuses the token (TokenRefused) nothing here has changed either
        if self.inner is not None:
            self.inner.advance(token_id)
        self.num_generated += 1
        p = self.penalties
        if not p.counts_output:
            return
        if self.counts is None:  # the engine applies a mask before it advances it: the logits' shape is known
            self.counts = torch.zeros(self.unadjusted.shape[-1], dtype=torch.float32, device=self.unadjusted.device)
        self.counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True

    def mask_first(self, logits: torch.Tensor) -> torch.Tensor:
        """The first token's logits as its logprobs show them: the constraint's mask, not the bias (see above)."""
        mask_first = getattr(self.inner, "mask_first", None)
        return logits if mask_first is None else mask_first(logits)

    def logprob_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What a step's logprobs are computed from: that step's logits before the bias and penalties."""
        return logits if self.unadjusted is None else self.unadjusted
