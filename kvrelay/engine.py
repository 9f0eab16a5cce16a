"""``generate(lm, prompt_ids, method)``: plan, load reused KV, scheduled prefill, decode, publish.

TTFT runs from call start (planning, store lookups, loading and re-rotating reused KV, the
scheduled prefill) to the first-token logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.errors import ContextLengthError
from kvrelay.model.loader import LoadedModel
from kvrelay.model.sampling import Sampler, SamplingConfig
from kvrelay.model.schedule import Schedule
from kvrelay.reuse import Plan, ReuseMethod, get_method


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

    @property
    def num_prompt_token_layers(self) -> int:
        return self.num_prompt_tokens * self.num_layers

    @property
    def reuse_rate(self) -> float:
        """Reused token-layers / prompt token-layers (DESIGN.md)."""
        return 1.0 - self.num_computed_token_layers / self.num_prompt_token_layers

    @property
    def recompute_frac(self) -> float:
        """Recomputed token-layers of reused spans / their token-layers (0 with nothing reused)."""
        reused_token_layers = self.num_reused_tokens * self.num_layers
        if reused_token_layers == 0:
            return 0.0
        new_token_layers = (self.num_prompt_tokens - self.num_reused_tokens) * self.num_layers
        return (self.num_computed_token_layers - new_token_layers) / reused_token_layers

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
    stop_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    span_id: str | None = None  # where the sequence's KV was published, if it was
    decode_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n_out, hidden]


def _shiftable(plan: Plan, store: KVStore | None, model) -> Plan:
    """A plan that moves reused keys under a RoPE whose rotations do not compose becomes a full
    prefill, and says so (counted as a fallback in the stats)."""
    if model.rope.can_shift:
        return plan
    for load in plan.loads:
        if store.get(load.span_id).start_pos + load.src_start != load.dst_start:
            return Plan(Schedule(), fallback=f"RoPE type {model.rope.rope_type!r} cannot move keys "
                                             f"(span {load.span_id!r}); recomputed with a full prefill")
    return plan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(lm: LoadedModel, prompt_ids: list[int], method: ReuseMethod | str = "full",
             store: KVStore | None = None, sampling: SamplingConfig | None = None,
             capture_layers: tuple[int, ...] = (), publish_as: str | None = None,
             pin: bool = False) -> GenerationOutput:
    """One agent call. With ``publish_as``, the sequence's KV (prompt + output) goes to ``store``."""
    sampling = sampling or SamplingConfig()
    method = get_method(method) if isinstance(method, str) else method
    model, config = lm.model, lm.config
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed")
    total = len(prompt_ids) + sampling.max_new_tokens
    if total > config.max_position_embeddings:
        raise ContextLengthError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {sampling.max_new_tokens} = {total} "
            f"exceeds the context length of {lm.name} ({config.max_position_embeddings})"
        )
    if publish_as is not None and store is None:
        raise ValueError("publish_as needs a store")
    device = model.device
    ids = torch.tensor(prompt_ids, dtype=torch.long)

    _sync(device)
    t0 = time.perf_counter()
    plan = _shiftable(method.plan(prompt_ids, store, lm), store, model)
    cache = SequenceKV(config, model.dtype, device, capacity=total + 1)
    num_shifted = 0
    for load in plan.loads:
        span = store.get(load.span_id)
        num_shifted += cache.load_span(span, load.dst_start, model.rope, load.src_start, load.src_end)
    result = model.prefill(ids, cache, plan.schedule)
    _sync(device)
    ttft_ms = (time.perf_counter() - t0) * 1e3

    sampler = Sampler(sampling)
    captured: dict[int, list[torch.Tensor]] = {}
    output: list[int] = []
    next_id = sampler(result.logits)
    stop_reason = "length"
    t1 = time.perf_counter()
    while True:
        if next_id in lm.tokenizer.stop_ids:
            stop_reason = "stop"
            break
        output.append(next_id)
        if len(output) >= sampling.max_new_tokens:
            break
        next_id = sampler(model.decode_step(next_id, cache, capture_layers, captured))
    if stop_reason == "length" and publish_as is not None:
        model.decode_step(output[-1], cache, capture_layers, captured)  # so every output token has KV
    _sync(device)
    decode_ms = (time.perf_counter() - t1) * 1e3

    decode_hidden = {layer: torch.stack(rows) for layer, rows in captured.items()}
    stats = CallStats(method.name, len(prompt_ids), config.num_layers, plan.num_reused_tokens,
                      result.num_computed_token_layers, num_shifted, ttft_ms, decode_ms, len(output),
                      plan.fallback)
    span_id = None
    if publish_as is not None:
        seq_ids = prompt_ids + output
        hidden = {}
        for layer in capture_layers:  # a layer's hidden states are kept only if every row is known
            got = result.captured.get(layer)
            if got is not None and got[0].numel() == len(prompt_ids) and layer in decode_hidden:
                hidden[layer] = torch.cat([got[1], decode_hidden[layer]])
        store.put(publish_as, cache.export(0, len(seq_ids), seq_ids, lm.fingerprint, hidden), pin=pin)
        span_id = publish_as
    return GenerationOutput(prompt_ids, output, lm.tokenizer.decode(output), result.logits, stats,
                            stop_reason, span_id, decode_hidden)
