"""``Engine(lm, store)``: the one object that owns a model, a span store and the reuse methods.

Every caller (the pipeline runner, the bench, the server, the Python API) drives a call the same
way, nano-vllm style:

- ``start(call, method)``: plan, load reused KV, scheduled prefill, first token (the TTFT window);
- ``step(sequences)``: one decode step for every running sequence, batched into one forward;
- ``finish(sequence)``: the ``GenerationOutput`` (and the sequence's KV, with ``keep_cache``).

``generate`` and ``generate_batch`` are those three in a loop. The engine asks every method it
may run for its capture layers, so an upstream call always carries the hidden states a downstream
relay needs, whoever drives it. A call's options and running state are kvrelay.engine.sequence's;
the methods the engine holds, kvrelay.engine.methods'.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.engine.call import (
    CallStats,
    GenerationOutput,
    Prefilled,
    as_call,
    check_fits,
    check_model,
    plan_call,
    run_plan,
    sync_device,
)
from kvrelay.engine.constrained import sample_masked
from kvrelay.engine.methods import MethodRegistry
from kvrelay.engine.prefill import PrefillTask
from kvrelay.engine.sequence import GenerateOptions, Sequence, checked_options
from kvrelay.errors import ConfigError
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import Sampler
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.reuse import CallInput, ReuseMethod

log = logging.getLogger(__name__)


class Engine:
    """A model, a span store and the methods that may run on them."""

    def __init__(self, lm: LoadedModel, store: KVStore | None = None,
                 methods: Iterable[str | ReuseMethod] = ("full",), capture_layers: Iterable[int] = ()) -> None:
        """``methods``: those that may run here (more join on first use); ``capture_layers``: layers to
        carry beyond what the methods ask for (e.g. a profiler's)."""
        check_model(lm)
        self.lm = lm
        self.store = store
        self.registry = MethodRegistry(lm, capture_layers)
        # measured prefill token-layers/s on this device (a running mean): a shared tier weighs a fetch
        # against recomputing with it
        self.compute_token_layers_per_s: float | None = None
        if store is not None:
            store.set_fingerprint(lm.fingerprint)
        # one spec given alone (methods="relay") is that method, not one method per character of it
        for spec in (methods,) if isinstance(methods, (str, ReuseMethod)) else methods:
            self.method(spec)

    # ------------------------------------------------------------------ methods (kvrelay.engine.methods)
    def method(self, spec: str | ReuseMethod, keep: bool = True) -> ReuseMethod:
        """The engine's method for ``spec`` (one object per spec string, so stateful methods keep their
        state across calls); its capture layers join the engine's. ``keep``: set it up for good; else (a
        call's own spec) it is one of the ``MAX_ONE_OFF_METHODS`` most recently named."""
        return self.registry.get(spec, keep)

    @property
    def num_methods(self) -> int:
        """Methods held: those set up and the one-off ones."""
        return len(self.registry)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Layers whose input hidden states every call carries (union over the engine's methods)."""
        return self.registry.capture_layers

    # ------------------------------------------------------------------ one call, step by step
    def begin(self, call: CallInput | list[int], method: str | ReuseMethod = "full",
              options: GenerateOptions | None = None, store: KVStore | None = None) -> PrefillTask:
        """``start`` as a task the caller advances a token budget at a time (chunked prefill, between other
        calls' decode steps); ``task.sequence()`` once it is done. A prompt that does not fit raises here."""
        call = as_call(call)
        return PrefillTask(self, call, self.method(method, keep=False), checked_options(options),
                           self.store if store is None else store)

    def start(self, call: CallInput | list[int], method: str | ReuseMethod = "full",
              options: GenerateOptions | None = None, store: KVStore | None = None) -> Sequence:
        """Plan, load reused KV, scheduled prefill and first token. ``stats.ttft_ms`` covers all of it.

        ``store``: the store this call plans from instead of the engine's (e.g. one tenant's namespace view).
        """
        options = checked_options(options)
        store = self.store if store is None else store
        call = as_call(call)
        method = self.method(method, keep=False)
        lm, model = self.lm, self.lm.model
        total = check_fits(lm, call.prompt_ids, options.num_new_tokens)
        ids = torch.tensor(call.prompt_ids, dtype=torch.long)

        if store is not None:
            store.take_decisions()  # drop lookups made outside this call
        sync_device(model.device)
        t0 = time.perf_counter()
        plan, cache = plan_call(lm, method, call, store, total)
        result, num_shifted = run_plan(lm, ids, plan, cache, store, self.capture_layers)
        sync_device(model.device)
        ttft_ms = (time.perf_counter() - t0) * 1e3
        if options.learn:
            method.observe(call, plan, cache, store, lm)
        decisions = store.take_decisions() if store is not None else []
        prompt_hidden = {layer: h for layer, (idx, h) in result.captured.items() if idx.numel() == len(ids)}
        return self.open_sequence(call, method, options, store, Prefilled(
            plan, cache, result.logits, result.exit_layer, result.num_computed_token_layers, num_shifted, ttft_ms,
            ttft_ms, prompt_hidden, decisions))

    def open_sequence(self, call: CallInput, method: ReuseMethod, options: GenerateOptions, store: KVStore | None,
                      done: Prefilled) -> Sequence:
        """The running call after its prefill (whole in ``start``, in chunks in ``PrefillTask.sequence``): its stats,
        the measured compute rate, and its first token sampled (or its forced output's KV)."""
        stats = CallStats(method.name, len(call.prompt_ids), self.lm.config.num_layers, done.plan.num_reused_tokens,
                          done.num_computed_token_layers, done.num_shifted_tokens, done.ttft_ms,
                          fallback=done.plan.fallback, note=done.plan.note, exit_layer=done.exit_layer,
                          tier_decisions=[dataclasses.asdict(d) for d in done.tier_decisions],
                          num_prefill_chunks=done.num_prefill_chunks)
        self._observe_rate(done.num_computed_token_layers, done.compute_ms, store)
        seq = Sequence(call, method, options, done.plan, done.cache, Sampler(options.sampling), done.logits, stats,
                       prompt_hidden=done.prompt_hidden)
        if options.forced_output_ids is not None:
            self._force(seq)
        else:
            self._accept(seq, done.logits)
        return seq

    def step(self, sequences: list[Sequence]) -> list[int | None]:
        """One decode step for every sequence not done: feed its last token, sample the next.

        Returns, per sequence, the token it appended this step (None when it stopped or was done).
        A sequence whose sampling or forward fails is failed alone (``stop_reason`` "error", the exception in
        ``error``); the others go on. When the batched forward raises, the step is rerun one sequence at a
        time, so only the culprit fails.
        """
        live = [s for s in sequences if not s.done]
        out: dict[int, int | None] = {}
        if live:
            t0 = time.perf_counter()
            marks = [_DecodeMark(s) for s in live]
            try:
                logits = self._decode([s.output_ids[-1] for s in live], live)  # [B, vocab]
                sync_device(self.lm.model.device)
            except Exception as exc:  # noqa: BLE001 - contained: the culprit fails, the others step again
                for mark in marks:
                    mark.restore()
                if len(live) == 1:
                    self._fail_sequence(live[0], "decode forward", exc)
                    return [None for _ in sequences]
                log.warning("a batched decode step of %d sequences failed (%s: %s); stepping them one by one",
                            len(live), type(exc).__name__, exc)
                for seq in live:
                    out[id(seq)] = self.step([seq])[0]
                return [out.get(id(s)) for s in sequences]
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            for row, seq in enumerate(live):
                seq.decode_ms += elapsed_ms  # every row waits for the whole batch
                before = len(seq.output_ids)
                try:
                    self._accept(seq, logits[row])
                except Exception as exc:  # noqa: BLE001 - this row's sampling failed: this sequence alone
                    self._fail_sequence(seq, "sampling", exc)
                out[id(seq)] = seq.output_ids[-1] if len(seq.output_ids) > before else None
        return [out.get(id(s)) for s in sequences]

    def finish(self, seq: Sequence) -> GenerationOutput:
        """The call's output. With ``keep_cache`` the output keeps the sequence KV (for ``publish``)."""
        if not seq.done:
            seq.cancel()
        feed_last = seq.options.keep_cache if seq.options.feed_last is None else seq.options.feed_last
        if seq.stop_reason == "length" and feed_last and seq.output_ids:
            t0 = time.perf_counter()
            self._decode([seq.output_ids[-1]], [seq])  # so every output token has KV
            seq.decode_ms += (time.perf_counter() - t0) * 1e3
        stats = seq.stats
        stats.decode_ms, stats.num_generated_tokens = seq.decode_ms, len(seq.output_ids)
        decode_hidden = {layer: torch.stack(rows) for layer, rows in seq.decode_rows.items()}
        output = GenerationOutput(seq.prompt_ids, list(seq.output_ids), self.lm.tokenizer.decode(seq.output_ids),
                                  seq.first_logits, stats, seq.stop_reason, decode_hidden, seq.prompt_hidden,
                                  seq.cache if seq.options.keep_cache else None, list(seq.top1_probs),
                                  seq.stop_token_id)
        seq.cache = None  # the engine holds no reference: the KV is freed unless the output keeps it
        return output

    # ------------------------------------------------------------------ whole calls
    def generate(self, call: CallInput | list[int], method: str | ReuseMethod = "full",
                 options: GenerateOptions | None = None) -> GenerationOutput:
        """One agent call: ``start``, ``step`` until done, ``finish``."""
        seq = self.start(call, method, options)
        while not seq.done:
            self.step([seq])
        out = self.finish(seq)
        if seq.error is not None:
            raise seq.error
        return out

    def generate_batch(self, calls: list[CallInput | list[int]], method: str | ReuseMethod = "full",
                       options: GenerateOptions | None = None) -> list[GenerationOutput]:
        """Several calls: prefilled one by one (each with its own TTFT), decoded in one batch."""
        seqs = [self.start(call, method, options) for call in calls]
        while not all(s.done for s in seqs):
            self.step(seqs)
        outs = [self.finish(s) for s in seqs]
        for seq in seqs:
            if seq.error is not None:
                raise seq.error
        return outs

    def publish(self, span_id: str, out: GenerationOutput, pin: bool = False, store: KVStore | None = None
                ) -> StoredSpan:
        """Store a call's prompt KV + decode KV (+ captured hidden states) as one span at position 0, in
        ``store`` (default: the engine's)."""
        store = self.store if store is None else store
        if store is None:
            raise ConfigError("publish needs an engine with a store")
        if out.cache is None:
            raise ConfigError("publish needs the call's KV: run it with GenerateOptions(keep_cache=True)")
        seq_ids = out.prompt_ids + out.output_ids
        layers = sorted(out.decode_hidden)
        if layers and all(layer in out.prompt_hidden for layer in layers):
            hidden = {layer: torch.cat([out.prompt_hidden[layer], out.decode_hidden[layer]]) for layer in layers}
            hidden_from = 0
        else:  # the prompt's rows are not all known (reused tokens): carry the output's rows only
            hidden, hidden_from = dict(out.decode_hidden), len(out.prompt_ids)
        span = out.cache.export(0, len(seq_ids), seq_ids, self.lm.fingerprint, hidden, hidden_from)
        store.put(span_id, span, pin=pin)
        return span

    # ------------------------------------------------------------------ internals
    def _observe_rate(self, num_token_layers: int, elapsed_ms: float, store: KVStore | None) -> None:
        """Fold one prefill into the measured compute rate and hand it to the store's cost model."""
        if num_token_layers < self.lm.config.num_layers * 16 or elapsed_ms <= 0:
            return  # too small a prefill to say much about throughput
        rate = num_token_layers / (elapsed_ms / 1e3)
        prev = self.compute_token_layers_per_s
        self.compute_token_layers_per_s = rate if prev is None else 0.8 * prev + 0.2 * rate
        if store is not None:
            store.set_compute_rate(self.compute_token_layers_per_s)

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample from ``logits`` ([vocab]) and append, or mark the sequence done."""
        mask = seq.options.logits_mask
        next_id = seq.sampler(logits) if mask is None else sample_masked(seq.sampler, mask, logits)
        seq.top1_probs.append(float(torch.softmax(logits.float(), dim=-1).max()))
        stop_ids = self.lm.tokenizer.stop_ids if seq.options.stop_ids is None else seq.options.stop_ids
        # a constraint that took its end ends the answer on that token even where it is no stop id (ignore_eos)
        if next_id in stop_ids or (mask is not None and getattr(mask, "ended", False)):
            seq.stop_reason, seq.stop_token_id = "stop", next_id
            return
        seq.output_ids.append(next_id)
        if len(seq.output_ids) >= seq.options.sampling.max_new_tokens:
            seq.stop_reason = "length"

    @staticmethod
    def _fail_sequence(seq: Sequence, stage: str, exc: Exception) -> None:
        """Mark ``seq`` failed (its caller reports it); the step goes on for the others."""
        seq.error, seq.stop_reason = exc, "error"
        log.error("%s failed for one sequence (%s: %s); that sequence is failed alone", stage,
                  type(exc).__name__, exc, exc_info=exc)

    def _force(self, seq: Sequence) -> None:
        """The forced output's KV (and captured hidden states) by one more prefill chunk."""
        forced = list(seq.options.forced_output_ids or ())
        seq.stop_reason = "forced"
        if not forced:
            return
        t0 = time.perf_counter()
        schedule = SuffixSchedule(len(seq.prompt_ids))
        schedule.capture_layers = self.capture_layers
        ids = torch.tensor(seq.prompt_ids + forced, dtype=torch.long)
        result = self.lm.model.prefill(ids, seq.cache, schedule)
        seq.output_ids = forced
        seq.decode_rows = {layer: list(h.unbind(0)) for layer, (_, h) in result.captured.items()}
        seq.decode_ms += (time.perf_counter() - t0) * 1e3

    def _decode(self, token_ids: list[int], seqs: list[Sequence]) -> torch.Tensor:
        """Feed ``token_ids[b]`` to ``seqs[b]``; logits [B, vocab]. Captures decode-phase hidden states."""
        return self.lm.model.decode(token_ids, [s.cache for s in seqs], self.capture_layers,
                                    [s.decode_rows for s in seqs])


class _DecodeMark:
    """A sequence's decode state before a step (cache length, captured rows), to undo a forward that raised
    partway so the step can be rerun."""

    def __init__(self, seq: Sequence) -> None:
        self.seq, self.length = seq, seq.cache.length
        self.num_rows = {layer: len(rows) for layer, rows in seq.decode_rows.items()}

    def restore(self) -> None:
        self.seq.cache.length = self.length
        for layer in list(self.seq.decode_rows):
            del self.seq.decode_rows[layer][self.num_rows.get(layer, 0):]
