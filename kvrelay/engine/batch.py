"""``generate_batch``: B calls that share one prefix by reference, prefilled one by one, decoded together.

RKSC's branches all start with the same root, which their caches read by reference
(``Plan.shared_prefix``). Decoding them one after another (what ``generate`` does per call) runs
every weight matrix once per token per branch; decoding them in one batch runs it once per step
for all B rows, and the root's keys are read once per step for all of them. Prefill stays per
call (each branch prompt's own part is short); each call's TTFT covers its own prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvrelay.cache.shared import SharedPrefixKV
from kvrelay.engine.core import GenerationOutput, check_fits, make_output, run_plan, shiftable, sync_device
from kvrelay.errors import ScheduleError
from kvrelay.model.batch_decode import decode_step_batch
from kvrelay.model.loader import LoadedModel
from kvrelay.model.sampling import Sampler, SamplingConfig
from kvrelay.reuse import CallInput, Plan, ReuseMethod


def generate_batch(lm: LoadedModel, prompts: list[list[int]], method: ReuseMethod,
                   sampling: SamplingConfig | None = None, keep_cache: bool = False,
                   on_prefill: Callable[[int, Plan], None] | None = None, feed_last: bool | None = None
                   ) -> list[GenerationOutput]:
    """Like ``generate`` for each prompt (same outputs up to float rounding of batched matmuls), with
    one batched decode. Every call's plan must read the same shared prefix (``Plan.shared_prefix``,
    same ``shared_len``): a ``ScheduleError`` says which call does not. ``on_prefill(i, plan)`` runs
    right after call i's prefill (e.g. to read its schedule's attention probe). ``feed_last`` (default:
    ``keep_cache``): a call stopped by length gets one more (batched) step so its last output token
    has K/V too."""
    sampling = sampling or SamplingConfig()
    model, device = lm.model, lm.model.device
    totals = [check_fits(lm, ids, sampling.max_new_tokens) for ids in prompts]
    plans = [shiftable(method.plan(CallInput(list(ids)), None, lm), None, model) for ids in prompts]
    first = plans[0]
    for i, plan in enumerate(plans):
        if plan.shared_prefix is None or plan.shared_prefix is not first.shared_prefix \
                or plan.shared_len != first.shared_len:
            raise ScheduleError(f"batched decode needs every call to read one shared prefix; call {i} "
                                f"reads {plan.shared_len} positions of "
                                f"{'none' if plan.shared_prefix is None else 'another cache'}")
        if plan.loads or plan.patches:
            raise ScheduleError(f"batched decode takes no loaded or patched spans (call {i} has some)")
    caches = SharedPrefixKV.batch(first.shared_prefix, first.shared_len, max(totals) + 1 - first.shared_len,
                                  len(prompts))
    prefilled = []
    for i, (ids, plan, cache) in enumerate(zip(prompts, plans, caches, strict=True)):
        sync_device(device)
        t0 = time.perf_counter()
        result, num_shifted = run_plan(lm, torch.tensor(ids, dtype=torch.long), plan, cache, None)
        sync_device(device)
        prefilled.append((result, num_shifted, (time.perf_counter() - t0) * 1e3))
        method.observe(CallInput(list(ids)), plan, cache, None, lm)
        if on_prefill is not None:
            on_prefill(i, plan)
    t1 = time.perf_counter()
    decoded = _decode_batch(lm, caches, [r.logits for r, _, _ in prefilled], sampling,
                            keep_cache if feed_last is None else feed_last)
    sync_device(device)
    decode_ms = (time.perf_counter() - t1) * 1e3  # the whole batch's: every row waits for the batch
    return [make_output(lm, method, ids, plan, result, num_shifted, ttft_ms, decode_ms, output, stop_reason, {},
                        cache if keep_cache else None, top1)
            for ids, plan, cache, (result, num_shifted, ttft_ms), (output, stop_reason, top1)
            in zip(prompts, plans, caches, prefilled, decoded, strict=True)]


def _decode_batch(lm: LoadedModel, caches: list[SharedPrefixKV], first_logits: list[torch.Tensor],
                  sampling: SamplingConfig, feed_last: bool) -> list[tuple[list[int], str, list[float]]]:
    """Per row: output ids (without the stop token), stop reason, top-1 probability per step.
    Finished rows leave the batch; each row samples with its own ``Sampler`` (as ``generate`` would)."""
    num_rows, stop_ids = len(caches), lm.tokenizer.stop_ids
    samplers = [Sampler(sampling) for _ in range(num_rows)]
    outputs: list[list[int]] = [[] for _ in range(num_rows)]
    top1: list[list[float]] = [[] for _ in range(num_rows)]
    stop_reasons = ["length"] * num_rows
    next_ids = [samplers[b](first_logits[b]) for b in range(num_rows)]
    for b in range(num_rows):
        top1[b].append(float(torch.softmax(first_logits[b].float(), dim=-1).max()))
    live = list(range(num_rows))
    while True:
        still = []
        for b in live:
            if next_ids[b] in stop_ids:
                stop_reasons[b] = "stop"
                continue
            outputs[b].append(next_ids[b])
            if len(outputs[b]) < sampling.max_new_tokens:
                still.append(b)
        live = still
        if not live:
            break
        logits = decode_step_batch(lm.model, [next_ids[b] for b in live], [caches[b] for b in live])  # [n, vocab]
        probs_top1 = torch.softmax(logits, dim=-1).max(dim=-1).values.tolist()  # [n]
        for row, b in enumerate(live):
            next_ids[b] = samplers[b](logits[row])
            top1[b].append(probs_top1[row])
    if feed_last:  # so every output token has K/V
        rows = [b for b in range(num_rows) if stop_reasons[b] == "length"]
        if rows:
            decode_step_batch(lm.model, [outputs[b][-1] for b in rows], [caches[b] for b in rows])
    return [(outputs[b], stop_reasons[b], top1[b]) for b in range(num_rows)]
