"""Chunked prefill: one call's prefill as a task the server advances a token budget at a time.

A long prompt prefilled in one forward stalls every running stream for as long as it takes. As vLLM
and SGLang schedule, the server instead runs a prefill in chunks of a token budget between decode
steps of the running batch: ``Engine.begin`` returns a ``PrefillTask``; each ``advance(budget)``
computes at most that many prompt tokens (the first one plans and loads the reused KV too), and once
``done`` the task's ``sequence()`` is what ``Engine.start`` would have returned.

Which plans chunk: a schedule whose active set is fixed in advance (no layer hook, no exit test, every
token entering at layer 0: ``full``, ``prefix``, ``naive``, ``epic``, ``kvcomm``) computes each of its
active tokens at every layer from its embedding, so it can run as consecutive pieces of its active
tokens, each reading the KV of everything before it from the cache: the same KV and logits as one
forward, up to float rounding. A schedule that selects tokens as it goes (CacheBlend's and
RelayCaching's band, RKSC's exit) reads the new tokens while it selects, so it runs in one piece, unless it
has nothing to select: a band with no span tokens (nothing was matched, as for any fresh long prompt) computes
every token at every layer, ``full``'s work, and chunks like it.
"""

from __future__ import annotations

import time

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine.call import Prefilled, check_fits, load_plan, plan_call, sync_device
from kvrelay.model.schedule import Schedule, StaticSchedule
from kvrelay.model.transformer import PrefillResult
from kvrelay.reuse import CallInput, Plan, ReuseMethod
from kvrelay.reuse.band import BandSchedule


def static_active_idx(schedule: Schedule, num_tokens: int) -> torch.Tensor | None:
    """The tokens a schedule computes at every layer ([m] ascending prompt indices), when its active set is
    fixed in advance; None for a schedule that selects as it goes (it must run in one piece)."""
    empty_band = isinstance(schedule, BandSchedule) and not schedule.span_idx.numel()  # its hook selects nothing
    if schedule.has_layer_hook and not empty_band or schedule.has_exit_test:
        return None
    entries = schedule.entries(num_tokens)
    if set(entries) != {0} or entries[0].hidden is not None:
        return None
    return torch.unique(entries[0].token_idx.to(torch.long).cpu())  # sorted, each once


class PrefillTask:
    """One call's plan, reused-KV load and prefill, run a budget of prompt tokens at a time."""

    def __init__(self, engine, call: CallInput, method: ReuseMethod, options, store: KVStore | None) -> None:
        """``engine``, ``options``: the ``Engine`` and its ``GenerateOptions`` (this module sits below the engine's)."""
        self.engine, self.call, self.method, self.options, self.store = engine, call, method, options, store
        self.total = check_fits(engine.lm, call.prompt_ids, options.num_new_tokens)  # refuse before any work
        self.ids = torch.tensor(call.prompt_ids, dtype=torch.long)
        self.plan: Plan | None = None
        self.cache: SequenceKV | None = None
        self._active: torch.Tensor | None = None  # chunked plans: the schedule's active tokens
        self._num_done = 0  # of them, computed so far
        self._result: PrefillResult | None = None  # the last piece's (its logits are the first token's)
        self._num_computed_token_layers = 0
        self._captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._num_shifted = 0
        self._decisions: list = []
        self._t0: float | None = None
        self._end_s: float | None = None
        self.compute_ms = 0.0  # time spent in this task's own work (planning, loads, prefill pieces)
        self.num_chunks = 0
        # the last piece of a chunked plan as run: (its tokens, the keys they attended to summed, its forward's ms);
        # None after a one-piece plan or planning alone (the server sizes chunks by what pieces cost)
        self.last_piece: tuple[int, int, float] | None = None

    @property
    def done(self) -> bool:
        return self._end_s is not None

    @property
    def num_remaining_tokens(self) -> int:
        """Prompt tokens still to compute (before planning: the whole prompt, the most it can be)."""
        if self.done:
            return 0
        if self._active is None:
            return len(self.call.prompt_ids)
        return int(self._active.numel()) - self._num_done

    def upcoming_positions(self, limit: int) -> list[int] | None:
        """Prompt positions of the next (up to ``limit``) tokens a piece would compute, ascending; None for a plan
        that runs in one piece (or a task done). Plans the call first if it was not yet (its time counts as the
        task's own, from where ``ttft_ms`` runs)."""
        if self.done:
            return None
        if self._t0 is None:
            sync_device(self.engine.lm.model.device)
            self._t0 = time.perf_counter()
            self._prepare()
            sync_device(self.engine.lm.model.device)
            self.compute_ms += (time.perf_counter() - self._t0) * 1e3
        if self._active is None:
            return None
        return self._active[self._num_done : self._num_done + limit].tolist()

    def advance(self, budget_tokens: int) -> int:
        """Compute up to ``budget_tokens`` more prompt tokens (at least one piece); the number computed. A plan
        that cannot chunk runs whole on its first call."""
        if self.done:
            return 0
        model = self.engine.lm.model
        sync_device(model.device)
        start_s = time.perf_counter()
        if self._t0 is None:
            self._t0 = start_s
            self._prepare()
        self.last_piece, num_keys = None, None
        if self._active is None:  # one piece: the method's own schedule over the whole prompt
            self.plan.schedule.capture_layers = self.engine.capture_layers
            self._take(model.prefill(self.ids, self.cache, self.plan.schedule))
            num = len(self.call.prompt_ids)
            self._num_done = num
        else:
            num = min(max(1, int(budget_tokens)), self.num_remaining_tokens)
            if num > 0:
                piece = self._active[self._num_done : self._num_done + num]
                schedule = StaticSchedule(piece)
                schedule.capture_layers = self.engine.capture_layers
                self._take(model.prefill(self.ids[: int(piece[-1]) + 1], self.cache, schedule))
                self._num_done += num
                num_keys = int(piece.sum()) + num  # position p attends to p + 1 keys
        sync_device(model.device)
        end_s = time.perf_counter()
        self.compute_ms += (end_s - start_s) * 1e3
        if num_keys is not None:  # planned beforehand (``upcoming_positions``), this is the piece's forward alone
            self.last_piece = (num, num_keys, (end_s - start_s) * 1e3)
        if self._active is None or self._num_done >= self._active.numel():
            self._end_s = end_s
        return num

    def _prepare(self) -> None:
        lm = self.engine.lm
        if self.store is not None:
            self.store.take_decisions()  # drop lookups made outside this call
        plan, self.cache = plan_call(lm, self.method, self.call, self.store, self.total)
        self._num_shifted = load_plan(lm, plan, self.cache, self.store)
        self.plan = plan
        self._decisions = self.store.take_decisions() if self.store is not None else []
        self._active = static_active_idx(plan.schedule, len(self.call.prompt_ids))
        if self._active is not None and (not self._active.numel() or int(self._active[-1]) != len(self.ids) - 1):
            self._active = None  # the schedule's own forward raises what is wrong with it

    def _take(self, result: PrefillResult) -> None:
        self._result = result
        self.num_chunks += 1
        self._num_computed_token_layers += result.num_computed_token_layers
        for layer, (idx, h) in result.captured.items():
            self._captured.setdefault(layer, []).append((idx, h))

    def sequence(self):
        """The running call once the prefill is done, its first token sampled: what ``Engine.start`` returns."""
        if not self.done or self.cache is None:
            raise RuntimeError("the prefill is not done (advance it first) or was cancelled")
        if self.options.learn:
            self.method.observe(self.call, self.plan, self.cache, self.store, self.engine.lm)
        prompt_hidden = {}
        for layer, pieces in self._captured.items():
            idx = torch.cat([i for i, _ in pieces])
            if idx.numel() == len(self.ids):
                prompt_hidden[layer] = torch.cat([h for _, h in pieces])
        ttft_ms = (self._end_s - self._t0) * 1e3
        return self.engine.open_sequence(self.call, self.method, self.options, self.store, Prefilled(
            self.plan, self.cache, self._result.logits, self._result.exit_layer, self._num_computed_token_layers,
            self._num_shifted, ttft_ms, self.compute_ms, prompt_hidden, self._decisions, self.num_chunks))

    def cancel(self) -> None:
        """Drop the task's KV (the client went away before its first token); it computes nothing more."""
        self.cache, self._result, self._captured = None, None, {}
        self._active, self._num_done = torch.empty(0, dtype=torch.long), 0
        self._end_s = self._end_s or time.perf_counter()
