"""One call's pieces: its stats and output, and running a plan (loads, patches, scheduled prefill).

TTFT runs from call start (planning, store lookups, loading and re-rotating reused KV, the
scheduled prefill) to the first-token logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError, ContextLengthError, PromptError
from kvrelay.model.lm import LoadedModel
from kvrelay.model.schedule import Schedule
from kvrelay.model.transformer import PrefillResult
from kvrelay.reuse import CallInput, Plan, ReuseMethod
from kvrelay.reuse.base import prompt_id_list
from kvrelay.weights.devices import sync_device  # noqa: F401 - kvrelay.engine's name for it


@dataclass
class CallStats:
    method: str
    num_prompt_tokens: int
    num_layers: int
    num_reused_tokens: int  # prompt tokens whose KV was loaded from the store
    num_computed_token_layers: int  # prompt token-layers the forward computed
    num_shifted_tokens: int  # reused tokens moved to a new position (keys re-rotated)
    ttft_ms: float
    decode_ms: float = 0.0
    num_generated_tokens: int = 0
    fallback: str | None = None
    note: str | None = None
    exit_layer: int | None = None  # the layer a schedule's exit test stopped the prefill at, if it did
    # a shared tier's fetch-or-recompute decisions for this call's lookups, with their inputs
    tier_decisions: list[dict] = field(default_factory=list)
    # prefill forwards the call ran in (more than one: chunked between other requests' decode steps, and then
    # ``ttft_ms`` is the wall time over all of them, the steps between included)
    num_prefill_chunks: int = 1

    @property
    def num_prompt_token_layers(self) -> int:
        return self.num_prompt_tokens * self.num_layers

    @property
    def num_reused_token_layers(self) -> int:
        return self.num_prompt_token_layers - self.num_computed_token_layers

    @property
    def num_recomputed_token_layers(self) -> int:
        """Token-layers of reused spans that were computed again."""
        new_token_layers = (self.num_prompt_tokens - self.num_reused_tokens) * self.num_layers
        return self.num_computed_token_layers - new_token_layers

    @property
    def reuse_rate(self) -> float:
        """Reused token-layers / prompt token-layers: a token whose KV comes from the cache at some layers and is
        computed at the others counts those layers only, so it is below ``cached_tokens / prompt_tokens`` wherever
        a method recomputes cached tokens (docs/benchmarks.md)."""
        return self.num_reused_token_layers / self.num_prompt_token_layers

    @property
    def recompute_frac(self) -> float:
        """Recomputed token-layers of reused spans / their token-layers (0 with nothing reused)."""
        reused_token_layers = self.num_reused_tokens * self.num_layers
        return self.num_recomputed_token_layers / reused_token_layers if reused_token_layers else 0.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(reuse_rate=self.reuse_rate, recompute_frac=self.recompute_frac)
        return d


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens, without the stop token
    text: str
    first_logits: torch.Tensor  # [vocab] fp32, the first-token distribution's logits
    stats: CallStats
    stop_reason: str  # "stop" (a stop token), "length" (max_new_tokens) or "forced"
    decode_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n_out, hidden]
    prompt_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n_prompt, hidden]
    cache: SequenceKV | None = None  # kept with keep_cache=True: every prompt and output token's KV
    top1_probs: list[float] = field(default_factory=list)  # probability of the chosen-by-argmax token per step
    stop_token_id: int | None = None  # with stop_reason "stop": the stop token sampled (not in ``output_ids``)

    @property
    def confidence(self) -> float:
        """Mean top-1 probability over the generated tokens (RKSC's branch confidence); 0 with none."""
        return sum(self.top1_probs) / len(self.top1_probs) if self.top1_probs else 0.0


def shiftable(plan: Plan, store: KVStore | None, model) -> Plan:
    """A plan that moves reused keys under a RoPE whose rotations do not compose becomes a full
    prefill, and says so (counted as a fallback in the stats)."""
    if model.rope.can_shift:
        return plan
    if plan.patches:  # patched keys are rotated for their positions (by the method, or by the cache)
        return Plan(Schedule(), fallback=f"RoPE type {model.rope.rope_type!r} cannot rotate patched keys; "
                                         "recomputed with a full prefill")
    for load in plan.loads:
        if store.get(load.span_id).start_pos + load.src_start != load.dst_start:
            return Plan(Schedule(), fallback=f"RoPE type {model.rope.rope_type!r} cannot move keys "
                                             f"(span {load.span_id!r}); recomputed with a full prefill")
    return plan


def plan_call(lm: LoadedModel, method: ReuseMethod, call: CallInput, store: KVStore | None, total: int
              ) -> tuple[Plan, SequenceKV]:
    """The method's plan for ``call`` (a full prefill where keys cannot move) and the sequence KV it runs in, with
    room for ``total`` tokens and the one fed after them."""
    plan = shiftable(method.plan(call, store, lm), store, lm.model)
    cache = plan.make_cache(total + 1) if plan.make_cache is not None else \
        SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=total + 1)
    return plan, cache


@dataclass
class Prefilled:
    """A call's finished prefill, run whole (``Engine.start``) or in chunks (``PrefillTask``): what its running
    sequence starts from."""

    plan: Plan
    cache: SequenceKV
    logits: torch.Tensor  # [vocab] the first token's
    exit_layer: int | None
    num_computed_token_layers: int
    num_shifted_tokens: int
    ttft_ms: float
    compute_ms: float  # the prefill's own work, without the waits between chunks (the compute rate's time)
    prompt_hidden: dict[int, torch.Tensor]  # layer -> [n_prompt, hidden], for layers every prompt row was captured at
    tier_decisions: list  # the shared tier's fetch-or-recompute decisions for the call's lookups
    num_prefill_chunks: int = 1


def as_call(call: CallInput | list[int]) -> CallInput:
    """A call, given as one or as its prompt's token ids (anything else, e.g. text, is a PromptError)."""
    return call if isinstance(call, CallInput) else CallInput(prompt_id_list(call))


def check_model(lm: object) -> None:
    """A ConfigError unless ``lm`` is a loaded model (a model name would fail only at the first call)."""
    if isinstance(lm, (str, bytes)) or hasattr(lm, "__fspath__"):
        raise ConfigError(f"Engine takes a loaded model, not the name or path {str(lm)!r}: "
                          f"Engine(load_model({str(lm)!r}))")
    if not all(hasattr(lm, name) for name in ("model", "config", "tokenizer")):  # a LoadedModel or one alike
        raise ConfigError(f"Engine takes a loaded model (kvrelay.weights.load_model), got {type(lm).__name__}")


def check_fits(lm: LoadedModel, prompt_ids: list[int], num_new: int) -> int:
    """Prompt + new tokens, or a ContextLengthError naming the model's limit."""
    if not prompt_ids:
        raise PromptError("empty prompt: at least one token is needed")
    # an id outside the embedding table would otherwise be an IndexError deep inside torch's embedding lookup
    lowest, highest = min(prompt_ids), max(prompt_ids)
    if lowest < 0 or highest >= lm.config.vocab_size:
        bad = lowest if lowest < 0 else highest
        raise PromptError(f"prompt token id {bad} is outside {lm.name}'s vocabulary [0, {lm.config.vocab_size})")
    total = len(prompt_ids) + num_new
    if total > lm.config.max_position_embeddings:
        raise ContextLengthError(
            f"prompt of {len(prompt_ids)} tokens + {num_new} new tokens = {total} exceeds the context "
            f"length of {lm.name} ({lm.config.max_position_embeddings})"
        )
    return total


def run_plan(lm: LoadedModel, ids: torch.Tensor, plan: Plan, cache: SequenceKV, store: KVStore | None,
             capture_layers: tuple[int, ...] = ()) -> tuple[PrefillResult, int]:
    """Load and patch the plan's reused K/V into ``cache``, then the scheduled prefill of ``ids`` ([n]).
    Returns the prefill's result and the number of reused tokens moved to a new position."""
    num_shifted = load_plan(lm, plan, cache, store)
    plan.schedule.capture_layers = tuple(capture_layers)
    return lm.model.prefill(ids, cache, plan.schedule), num_shifted


def load_plan(lm: LoadedModel, plan: Plan, cache: SequenceKV, store: KVStore | None) -> int:
    """Load and patch the plan's reused K/V into ``cache``; the number of reused tokens moved to a new position."""
    num_shifted = 0
    for load in plan.loads:
        span = store.get(load.span_id)
        num_shifted += cache.load_span(span, load.dst_start, lm.model.rope, load.src_start, load.src_end)
    for patch in plan.patches:
        cache.patch(patch.dst_start, patch.k, patch.v, patch.add, lm.model.rope if patch.keys_without_rope else None)
    return num_shifted
