"""Sampling under a per-sequence constraint (``kvrelay.engine.sequence.LogitsMask``, e.g. a grammar).

A grammar library answers two questions per step: which tokens its mask allows, and whether it accepts the one
sampled. They are meant to agree; when they do not (a library bug, a token its mask over-allows), the sampled
token must not end the request: the constraint refuses it (``TokenRefused``, its state unchanged), and the
sampler picks again among the tokens left. A sampled pick is retried ``MAX_RESAMPLES`` times; past that, the
allowed tokens are tried most likely first, so a token the constraint accepts is found whenever one exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrelay.model.sampling import SamplingError

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvrelay.engine.sequence import LogitsMask

MAX_RESAMPLES = 8  # sampled picks retried before the most-likely-first scan


class TokenRefused(Exception):
    """``LogitsMask.advance`` refused a token its own ``apply`` allowed; the constraint's state is unchanged."""


class ConstraintDeadEnd(SamplingError):
    """The constraint allows no token where the model's logits were fine: the request's grammar cannot be
    completed from here (e.g. a rule that only refers to itself), the request's fault, not the model's."""


def sample_masked(sampler: Callable[[torch.Tensor], int], mask: LogitsMask, logits: torch.Tensor) -> int:
    """The next token of a sequence under ``mask`` (``logits``: [vocab]); the mask has taken it (``advance``).

    Raises ``SamplingError`` only when the constraint accepts none of the tokens its mask allowed."""
    masked = mask.apply(logits)
    num_refused = 0
    while num_refused < MAX_RESAMPLES and (num_refused == 0 or bool(torch.isfinite(masked).any())):
        try:
            token_id = sampler(masked)  # SamplingError when the mask allows nothing
        except SamplingError:
            # checked only here: a finiteness scan of a large vocabulary costs ~1 ms, too much for every step
            if num_refused == 0 and not bool(torch.isfinite(masked).any()) and bool(torch.isfinite(logits).any()):
                raise ConstraintDeadEnd("the output constraint (structured_outputs, response_format or tools) "
                                        "allows no token here: it cannot be completed") from None
            raise
        try:
            mask.advance(token_id)
            return token_id
        except TokenRefused:
            num_refused += 1
            masked = masked.clone()
            masked[token_id] = float("-inf")
    for token_id in masked.argsort(descending=True).tolist():  # most likely first
        if not torch.isfinite(masked[token_id]):
            break
        try:
            mask.advance(token_id)
            return token_id
        except TokenRefused:
            num_refused += 1
    raise SamplingError(f"the output constraint refused every token its mask allowed ({num_refused} tried)")
