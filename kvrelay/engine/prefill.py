"""Chunked prefill: one call's prefill as a task the server advances a token budget at a time.

A long prompt prefilled in one forward stalls every running stream for as long as it takes. As vLLM
and SGLang schedule, the server instead runs a prefill in chunks of a token budget between decode
steps of the running batch: ``Engine.begin`` returns a ``PrefillTask``; each ``advance(budget)``
computes at most that many prompt tokens (the first one plans and loads the reused KV too), and once
``done`` the task's ``sequence()`` is what ``Engine.start`` would have returned.

Which plans chunk how: a schedule whose active set is fixed in advance (no layer hook, no exit test, every
token entering at layer 0: ``full``, ``prefix``, ``naive``, ``epic``, ``kvcomm``, and a band with no span tokens)
computes each of its active tokens at every layer from its embedding, so it runs as consecutive pieces of its
active tokens, each reading the KV of everything before it from the cache: the same KV and logits as one forward,
up to float rounding. A schedule that selects tokens as it goes (CacheBlend's and RelayCaching's band with span
tokens, RKSC's exit) needs every token's state at the layer where it selects, so it runs as pieces of LAYERS
instead: the forward stops after a layer and resumes at the next with its active set and hidden states
(``Transformer.prefill_layers``), the same operations in the same order as one forward, so the same results bit
for bit. A layer that does not fit a piece runs as chunks of its ROWS (``kvrelay.model.row_chunks``: causal
attention makes that exact, up to float rounding; a selecting layer selects once all its rows are projected), so a
long prompt's layer of 8K tokens is no longer the least a piece can be. A piece is measured in the tokens of a whole
forward (token-layers, or row-layers, over the model's layers), the unit the server's cost budget sizes pieces in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine.call import Prefilled, check_fits, load_plan, plan_call, sync_device
from kvrelay.model.prefill_state import LayerForward
from kvrelay.model.schedule import Schedule, StaticSchedule
from kvrelay.model.transformer import PrefillResult
from kvrelay.reuse import CallInput, Plan, ReuseMethod
from kvrelay.reuse.band import BandSchedule


def static_active_idx(schedule: Schedule, num_tokens: int) -> torch.Tensor | None:
    """The tokens a schedule computes at every layer ([m] ascending prompt indices), when its active set is
    fixed in advance; None for a schedule that selects as it goes (it runs in pieces of layers)."""
    empty_band = isinstance(schedule, BandSchedule) and not schedule.span_idx.numel()  # its hook selects nothing
    if schedule.has_layer_hook and not empty_band or schedule.has_exit_test:
        return None
    entries = schedule.entries(num_tokens)
    if set(entries) != {0} or entries[0].hidden is not None:
        return None
    return torch.unique(entries[0].token_idx.to(torch.long).cpu())  # sorted, each once


def _most_rows(num_left: int, cost: Callable[[int], tuple[float, float]], fits: Callable[[float, float], bool]) -> int:
    """The most of the next ``num_left`` rows whose ``cost`` (tokens, attention scores: ``PartialLayer.cost``) still
    ``fits``: cost grows with the rows, so bisect."""
    lo, hi = 0, num_left
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(*cost(mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefillTask:
    """One call's plan, reused-KV load and prefill, run a budget of prompt tokens at a time."""

    def __init__(self, engine, call: CallInput, method: ReuseMethod, options, store: KVStore | None) -> None:
        """``engine``, ``options``: the ``Engine`` and its ``GenerateOptions`` (this module sits below the engine's)."""
        self.engine, self.call, self.method, self.options, self.store = engine, call, method, options, store
        self.total = check_fits(engine.lm, call.prompt_ids, options.num_new_tokens)  # refuse before any work
        self.ids = torch.tensor(call.prompt_ids, dtype=torch.long)
        self.plan: Plan | None = None
        self.cache: SequenceKV | None = None
        self._active: torch.Tensor | None = None  # plans in pieces of tokens: the schedule's active tokens
        self._forward: LayerForward | None = None  # plans in pieces of layers: the forward, stopped between two
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
        # the last piece as run: (its tokens, the keys they attended to summed, its forward's ms; a layer piece's in
        # tokens of a whole forward, its keys the attention scores it computed: ``num_scores``), None after planning
        # alone (the server sizes pieces by what they cost)
        self.last_piece: tuple[float, float, float] | None = None

    @property
    def done(self) -> bool:
        return self._end_s is not None

    @property
    def num_remaining_tokens(self) -> int:
        """Prompt tokens still to compute (before planning: the whole prompt, the most it can be)."""
        if self.done:
            return 0
        if self._forward is not None:  # the prompt's share of the layers left (an upper bound: a band selects)
            fwd = self._forward
            layers_left = fwd.num_layers - fwd.next_layer - (fwd.partial.share_done if fwd.partial else 0.0)
            return max(1, math.ceil(len(self.ids) * layers_left / fwd.num_layers))
        if self._active is None:
            return len(self.call.prompt_ids)
        return int(self._active.numel()) - self._num_done

    def upcoming_positions(self, limit: int) -> list[int] | None:
        """Prompt positions of the next (up to ``limit``) tokens a piece would compute, ascending; None for a plan
        run in pieces of layers (or a task done). Plans the call first if it was not yet (its time counts as the
        task's own, from where ``ttft_ms`` runs)."""
        self._plan_first()
        if self.done or self._active is None:
            return None
        return self._active[self._num_done : self._num_done + limit].tolist()

    def upcoming_layer(self) -> tuple[float, float] | None:
        """For a plan run in pieces of layers: (tokens, attention scores: ``LayerForward.upcoming``) of the rest of its
        next layer, in tokens of a whole forward; None for one run in pieces of tokens (or a task done). Plans the
        call first."""
        self._plan_first()
        if self.done or self._forward is None:
            return None
        return self._per_forward(*self._forward.upcoming())

    def _plan_first(self) -> None:
        if self.done or self._t0 is not None:
            return
        sync_device(self.engine.lm.model.device)
        self._t0 = time.perf_counter()
        self._prepare()
        sync_device(self.engine.lm.model.device)
        self.compute_ms += (time.perf_counter() - self._t0) * 1e3

    def _per_forward(self, num_token_layers: float, num_key_layers: float) -> tuple[float, float]:
        num_layers = self._forward.num_layers
        return num_token_layers / num_layers, num_key_layers / num_layers

    def advance(self, budget_tokens: int, fits: Callable[[float, float], bool] | None = None,
                min_tokens: float = 0.0) -> int:
        """Compute up to ``budget_tokens`` more prompt tokens (at least one piece); the number computed. A plan run
        in pieces of layers takes whole layers while the piece with the next one fits: ``fits(tokens, keys)`` of the
        piece (in tokens of a whole forward; None: while its tokens fit ``budget_tokens``); a layer that does not
        fit runs as chunks of its rows, as many as fit, at least ``min_tokens``' worth (in tokens of a whole
        forward) and one row where it is the piece's first work. It counts the tokens of a whole forward it
        computed (rounded up)."""
        if self.done:
            return 0
        model = self.engine.lm.model
        sync_device(model.device)
        start_s = time.perf_counter()
        if self._t0 is None:
            self._t0 = start_s
            self._prepare()
        self.last_piece, num_keys = None, None
        if self._forward is not None:
            num_tokens, num_keys = self._advance_layers(fits, budget_tokens, min_tokens)
            num = math.ceil(num_tokens)
        else:
            num_tokens = num = min(max(1, int(budget_tokens)), self.num_remaining_tokens)
            piece = self._active[self._num_done : self._num_done + num]
            schedule = StaticSchedule(piece)
            schedule.capture_layers = self.engine.capture_layers
            self._take(model.prefill(self.ids[: int(piece[-1]) + 1], self.cache, schedule))
            self._num_done += num
            num_keys = int(piece.sum()) + num  # position p attends to p + 1 keys
        self.num_chunks += 1
        sync_device(model.device)
        end_s = time.perf_counter()
        self.compute_ms += (end_s - start_s) * 1e3
        # planned beforehand (``upcoming_positions``, ``upcoming_layer``), this is the piece's forward alone
        self.last_piece = (num_tokens, num_keys, (end_s - start_s) * 1e3)
        if self._forward is not None and self._forward.done:
            self._take(model.finish_prefill(self._forward))
            self._forward = None
            self._end_s = end_s
        elif self._forward is None and self._num_done >= self._active.numel():
            self._end_s = end_s
        return num

    def _advance_layers(self, fits: Callable[[float, float], bool] | None, budget_tokens: float,
                        min_tokens: float) -> tuple[float, float]:
        """Run the forward on for a piece: whole layers while the piece with the next one fits, then, where the next
        one does not, the most of its rows that fit (the piece's first work: at least ``min_tokens``' worth, a row at
        least); its (tokens, keys) in tokens of a whole forward."""
        forward, model, spent = self._forward, self.engine.lm.model, [0.0, 0.0]  # token-layers, key-layers run
        num_layers = forward.num_layers

        def fits_with(num: float, num_keys: float) -> bool:
            tokens, keys = self._per_forward(spent[0] + num, spent[1] + num_keys)
            return fits(tokens, keys) if fits is not None else tokens <= budget_tokens

        while not forward.done:
            first = spent[0] == 0
            num, num_keys = forward.upcoming()
            if fits_with(num, num_keys):  # the rest of the layer, whole
                model.prefill_rows(forward)
                spent[0], spent[1] = spent[0] + num, spent[1] + num_keys
                continue
            if forward.partial is None:
                if not first:  # whole layers stay whole where they can: the next piece begins with this one
                    break
                model.start_layer(forward)  # its tokens enter: its rows known (an admission may refuse some)
                continue
            part = forward.partial
            num_left = part.num_left
            num_rows = _most_rows(num_left, part.cost, fits_with)
            if first:  # at least ``min_tokens`` of a whole forward's worth, priced as these rows cost
                num_rows = max(num_rows, _most_rows(num_left, part.cost, lambda t, _: t <= min_tokens * num_layers), 1)
            if not num_rows:
                break
            num_rows = min(num_rows, num_left)
            tokens, scores = part.cost(num_rows)
            model.prefill_rows(forward, num_rows)
            spent[0], spent[1] = spent[0] + tokens, spent[1] + scores
            if num_rows < num_left:  # the next row would not fit
                break
        return self._per_forward(*spent)

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
        if self._active is None:
            plan.schedule.capture_layers = self.engine.capture_layers
            self._forward = lm.model.begin_prefill(self.ids, self.cache, plan.schedule)

    def _take(self, result: PrefillResult) -> None:
        self._result = result
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
        self.cache, self._result, self._captured, self._forward = None, None, {}, None
        self._active, self._num_done = torch.empty(0, dtype=torch.long), 0
        self._end_s = self._end_s or time.perf_counter()
