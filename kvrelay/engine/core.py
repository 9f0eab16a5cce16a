"""``generate(lm, call, method)``: plan, load reused KV, scheduled prefill, decode; ``publish`` after.

TTFT runs from call start (planning, store lookups, loading and re-rotating reused KV, the
scheduled prefill) to the first-token logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.cache.shared import SharedPrefixKV
from kvrelay.cache.store import KVStore
from kvrelay.errors import ContextLengthError
from kvrelay.model.loader import LoadedModel
from kvrelay.model.sampling import Sampler, SamplingConfig
from kvrelay.model.schedule import Schedule, SuffixSchedule
from kvrelay.model.transformer import PrefillResult
from kvrelay.reuse import CallInput, Plan, ReuseMethod, get_method


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
        """Reused token-layers / prompt token-layers (DESIGN.md)."""
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

    @property
    def confidence(self) -> float:
        """Mean top-1 probability over the generated tokens (RKSC's branch confidence); 0 with none."""
        return sum(self.top1_probs) / len(self.top1_probs) if self.top1_probs else 0.0


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shiftable(plan: Plan, store: KVStore | None, model) -> Plan:
    """A plan that moves reused keys under a RoPE whose rotations do not compose becomes a full
    prefill, and says so (counted as a fallback in the stats)."""
    if model.rope.can_shift:
        return plan
    if plan.patches:  # patched keys were rotated for their positions by the method
        return Plan(Schedule(), fallback=f"RoPE type {model.rope.rope_type!r} cannot rotate patched keys; "
                                         "recomputed with a full prefill")
    for load in plan.loads:
        if store.get(load.span_id).start_pos + load.src_start != load.dst_start:
            return Plan(Schedule(), fallback=f"RoPE type {model.rope.rope_type!r} cannot move keys "
                                             f"(span {load.span_id!r}); recomputed with a full prefill")
    return plan


def generate(lm: LoadedModel, call: CallInput | list[int], method: ReuseMethod | str = "full",
             store: KVStore | None = None, sampling: SamplingConfig | None = None,
             capture_layers: tuple[int, ...] = (), keep_cache: bool = False,
             forced_output_ids: list[int] | None = None, learn: bool = True,
             feed_last: bool | None = None) -> GenerationOutput:
    """One agent call.

    With ``keep_cache``, the output keeps the sequence KV so that ``publish`` can store it. With
    ``forced_output_ids``, the output is those ids (not sampled): their KV is computed by one more
    prefill chunk, as decoding them would (up to float rounding), for deterministic workloads.
    With ``learn`` (default), a stateful method (KVCOMM's anchor pools) learns from this prefill
    after the first token; the bench turns it off for repeated timing runs of one call.
    ``feed_last`` (default: ``keep_cache``) runs one more decode step when generation stops at
    ``max_new_tokens``, so that the last output token has KV too (what ``publish`` stores).
    """
    sampling = sampling or SamplingConfig()
    call = call if isinstance(call, CallInput) else CallInput(list(call))
    method = get_method(method) if isinstance(method, str) else method
    model, config = lm.model, lm.config
    prompt_ids = call.prompt_ids
    num_new = len(forced_output_ids) if forced_output_ids is not None else sampling.max_new_tokens
    total = check_fits(lm, prompt_ids, num_new)
    device = model.device
    ids = torch.tensor(prompt_ids, dtype=torch.long)

    sync_device(device)
    t0 = time.perf_counter()
    plan = shiftable(method.plan(call, store, lm), store, model)
    if plan.shared_prefix is not None:
        cache = SharedPrefixKV(plan.shared_prefix, plan.shared_len, capacity=total + 1 - plan.shared_len)
    else:
        cache = SequenceKV(config, model.dtype, device, capacity=total + 1)
    result, num_shifted = run_plan(lm, ids, plan, cache, store, capture_layers)
    sync_device(device)
    ttft_ms = (time.perf_counter() - t0) * 1e3
    if learn:
        method.observe(call, plan, cache, store, lm)

    t1 = time.perf_counter()
    top1_probs: list[float] = []
    if forced_output_ids is not None:
        output, stop_reason, decode_hidden = _force(model, ids, cache, forced_output_ids, capture_layers)
    else:
        output, stop_reason, decode_hidden = _decode(lm, cache, result.logits, sampling, capture_layers,
                                                     feed_last=keep_cache if feed_last is None else feed_last,
                                                     top1_probs=top1_probs)
    sync_device(device)
    decode_ms = (time.perf_counter() - t1) * 1e3

    return make_output(lm, method, prompt_ids, plan, result, num_shifted, ttft_ms, decode_ms, output, stop_reason,
                       decode_hidden, cache if keep_cache else None, top1_probs)


def check_fits(lm: LoadedModel, prompt_ids: list[int], num_new: int) -> int:
    """Prompt + new tokens, or a ContextLengthError naming the model's limit."""
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed")
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
    num_shifted = 0
    for load in plan.loads:
        span = store.get(load.span_id)
        num_shifted += cache.load_span(span, load.dst_start, lm.model.rope, load.src_start, load.src_end)
    for patch in plan.patches:
        cache.patch(patch.dst_start, patch.k, patch.v, patch.add)
    plan.schedule.capture_layers = tuple(capture_layers)
    return lm.model.prefill(ids, cache, plan.schedule), num_shifted


def make_output(lm: LoadedModel, method: ReuseMethod, prompt_ids: list[int], plan: Plan, result: PrefillResult,
                num_shifted: int, ttft_ms: float, decode_ms: float, output: list[int], stop_reason: str,
                decode_hidden: dict[int, torch.Tensor], cache: SequenceKV | None, top1_probs: list[float]
                ) -> GenerationOutput:
    prompt_hidden = {layer: h for layer, (idx, h) in result.captured.items() if idx.numel() == len(prompt_ids)}
    stats = CallStats(method.name, len(prompt_ids), lm.config.num_layers, plan.num_reused_tokens,
                      result.num_computed_token_layers, num_shifted, ttft_ms, decode_ms, len(output),
                      plan.fallback, plan.note, result.exit_layer)
    return GenerationOutput(prompt_ids, output, lm.tokenizer.decode(output), result.logits, stats, stop_reason,
                            decode_hidden, prompt_hidden, cache, top1_probs)


def _decode(lm: LoadedModel, cache: SequenceKV, logits: torch.Tensor, sampling: SamplingConfig,
            capture_layers: tuple[int, ...], feed_last: bool, top1_probs: list[float]
            ) -> tuple[list[int], str, dict[int, torch.Tensor]]:
    model, sampler = lm.model, Sampler(sampling)
    captured: dict[int, list[torch.Tensor]] = {}
    output: list[int] = []
    next_id = sampler(logits)
    top1_probs.append(float(torch.softmax(logits.float(), dim=-1).max()))
    stop_reason = "length"
    while True:
        if next_id in lm.tokenizer.stop_ids:
            stop_reason = "stop"
            break
        output.append(next_id)
        if len(output) >= sampling.max_new_tokens:
            break
        logits = model.decode_step(next_id, cache, capture_layers, captured)
        next_id = sampler(logits)
        top1_probs.append(float(torch.softmax(logits, dim=-1).max()))
    if stop_reason == "length" and feed_last:
        model.decode_step(output[-1], cache, capture_layers, captured)  # so every output token has KV
    return output, stop_reason, {layer: torch.stack(rows) for layer, rows in captured.items()}


def _force(model, prompt: torch.Tensor, cache: SequenceKV, forced: list[int], capture_layers: tuple[int, ...]
           ) -> tuple[list[int], str, dict[int, torch.Tensor]]:
    if not forced:
        return [], "forced", {}
    schedule = SuffixSchedule(len(prompt))
    schedule.capture_layers = tuple(capture_layers)
    result = model.prefill(torch.cat([prompt, torch.tensor(forced, dtype=torch.long)]), cache, schedule)
    return list(forced), "forced", {layer: h for layer, (_, h) in result.captured.items()}


def publish(store: KVStore, span_id: str, out: GenerationOutput, lm: LoadedModel, pin: bool = False) -> StoredSpan:
    """Store a call's prompt KV + decode KV (+ captured hidden states) as one span at position 0."""
    if out.cache is None:
        raise ValueError("publish needs generate(..., keep_cache=True)")
    seq_ids = out.prompt_ids + out.output_ids
    layers = sorted(out.decode_hidden)
    if layers and all(layer in out.prompt_hidden for layer in layers):
        hidden = {layer: torch.cat([out.prompt_hidden[layer], out.decode_hidden[layer]]) for layer in layers}
        hidden_from = 0
    else:  # the prompt's rows are not all known (reused tokens): carry the output's rows only
        hidden, hidden_from = dict(out.decode_hidden), len(out.prompt_ids)
    span = out.cache.export(0, len(seq_ids), seq_ids, lm.fingerprint, hidden, hidden_from)
    store.put(span_id, span, pin=pin)
    return span
