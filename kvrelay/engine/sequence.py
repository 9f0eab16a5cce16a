"""One call's options and running state: ``GenerateOptions`` (how it runs), ``LogitsMask`` (a constraint on its next
token, e.g. a grammar) and ``Sequence`` (its prompt, plan, KV and the tokens generated so far), which the engine
(kvrelay.engine.engine) starts, steps and finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine.call import CallStats
from kvrelay.errors import InputError, PromptError
from kvrelay.model.sampling import Sampler, SamplingConfig
from kvrelay.reuse import CallInput, Plan, ReuseMethod
from kvrelay.reuse.base import prompt_id_list


class LogitsMask(Protocol):
    """A per-sequence constraint on the next token (e.g. a grammar), applied before sampling. Stateful: one
    object per call (``generate_batch`` cannot share one), told every token the call takes."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[vocab] logits with the tokens not allowed now at -inf (a stop token only once the output is complete)."""

    def advance(self, token_id: int) -> None:
        """The sequence took ``token_id`` (a stop token included); ``kvrelay.engine.constrained.TokenRefused``
        (state unchanged) when the constraint refuses a token ``apply`` allowed: the engine picks another."""

    # optional ``ended`` (bool): the constraint took its end, so the token just taken ends the answer (a grammar's
    # stop token ends it even with ``ignore_eos``, which only keeps the end-of-sequence ids from being stop ids)


@dataclass(frozen=True)
class GenerateOptions:
    """How one call runs (the method is chosen separately)."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    keep_cache: bool = False  # keep the sequence KV in the output, so that ``publish`` can store it
    # the output is these ids (not sampled); their KV is computed as one more prefill chunk
    forced_output_ids: tuple[int, ...] | None = None
    learn: bool = True  # a stateful method (KVCOMM's anchor pools) learns from this prefill
    # one more decode step when generation stops at max_new_tokens, so the last output token has KV
    # too (what ``publish`` stores); None: as keep_cache
    feed_last: bool | None = None
    logits_mask: LogitsMask | None = None  # this call's own constraint (see ``LogitsMask``)
    # the token ids that end the call (not part of its output); None: the tokenizer's (end of sequence, end of turn)
    stop_ids: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.forced_output_ids is not None:
            object.__setattr__(self, "forced_output_ids", _token_ids("forced_output_ids", self.forced_output_ids))
        if self.stop_ids is not None:
            object.__setattr__(self, "stop_ids", frozenset(_token_ids("stop_ids", self.stop_ids)))

    @property
    def num_new_tokens(self) -> int:
        return len(self.forced_output_ids) if self.forced_output_ids is not None else self.sampling.max_new_tokens


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    """``ids`` as token ids, or an InputError naming the option (stop strings are the server's; here they are ids)."""
    try:
        return tuple(prompt_id_list(ids))
    except PromptError:
        hint = "; the Python API stops on token ids only" if name == "stop_ids" else ""
        raise InputError(f"GenerateOptions.{name} must be int token ids, got {ids!r} (lm.tokenizer.encode(text) "
                         f"gives a text's ids{hint})") from None


@dataclass
class Sequence:
    """One running call: its prompt, plan, KV and the tokens generated so far."""

    call: CallInput
    method: ReuseMethod
    options: GenerateOptions
    plan: Plan
    cache: SequenceKV
    sampler: Sampler
    first_logits: torch.Tensor  # [vocab] fp32
    stats: CallStats
    output_ids: list[int] = field(default_factory=list)
    top1_probs: list[float] = field(default_factory=list)
    stop_reason: str | None = None  # set when the sequence is done: "stop", "length", "forced", "cancelled", "error"
    # with stop_reason "error": what failed this sequence's sampling or forward (the rest of its batch went on)
    error: Exception | None = None
    prompt_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    decode_rows: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [hidden] per step
    decode_ms: float = 0.0
    stop_token_id: int | None = None  # with stop_reason "stop": the stop token sampled (not in ``output_ids``)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def prompt_ids(self) -> list[int]:
        return self.call.prompt_ids

    def cancel(self) -> None:
        """Stop now (a client went away, a stop string matched); the KV is freed at ``finish``."""
        if self.stop_reason is None:
            self.stop_reason = "cancelled"


def checked_options(options: GenerateOptions | None) -> GenerateOptions:
    """``options``, or the defaults; a SamplingConfig given in its place (the likely slip) is named, not an
    AttributeError deep in the call."""
    if options is None:
        return GenerateOptions()
    if not isinstance(options, GenerateOptions):
        hint = " (wrap it: GenerateOptions(SamplingConfig(...)))" if isinstance(options, SamplingConfig) else ""
        raise TypeError(f"options must be a GenerateOptions, got a {type(options).__name__}{hint}")
    return options
