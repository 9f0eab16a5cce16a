"""A worker turn's prefill: which prefills advance, and by how much, within the turn's cost budget.

Chunked prefill, as vLLM and SGLang schedule: a long prompt runs in pieces between decode steps, so it never stalls
the running streams for more than one piece. ``ChunkBudget`` sizes each piece by its predicted time, learned from
the pieces run, to what ``prefill_chunk_tokens`` tokens cost at the start of a prompt: pieces deep in a long prompt,
whose tokens attend to more keys, get fewer tokens. A plan that selects tokens as it goes (a band with span tokens)
runs in pieces of layers (kvrelay.engine.prefill): its piece takes layers while they fit the same budget, priced by
the same model (a layer's tokens and keys over the model's layers: the tokens of a whole forward with that work). A
layer that does not fit a piece runs as chunks of its rows (kvrelay.model.row_chunks), each the most rows that fit,
priced the same way (a row's token and the keys it attends to, over the model's layers), never less than the
budget's ``min_tokens`` of a whole forward.

The budget goes to the request with the fewest tokens left first (a short request is not held behind a long one's
pieces); one that got no budget for ``MAX_SKIPPED_TURNS`` turns goes first, so a long prompt is never starved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvrelay.engine.prefill import PrefillTask
from kvrelay.server.chunk_budget import ChunkBudget, PieceCost, attended_keys
from kvrelay.server.job import Job
from kvrelay.server.request_ids import request_context

log = logging.getLogger("kvrelay.server.prefill")
MAX_SKIPPED_TURNS = 4  # a prefill that got no budget this many turns goes first


def advance_prefills(jobs: list[Job], budget: ChunkBudget, finished: Callable[[Job], None],
                     failed: Callable[[Job, Exception], None]) -> None:
    """Advance the prefills of ``jobs`` within one turn's budget, in order (fewest tokens left first, a starved one
    before all); a piece is at least the budget's ``min_tokens`` (or one layer, or what is left), so one that fits
    no more this turn waits for the next. ``finished(job)`` once a prefill is done; ``failed(job, exc)`` for one
    whose piece raised (the others go on)."""
    spent, first = 0.0, True  # the turn's budget used, as a share of it
    order = sorted(jobs, key=lambda j: (j.num_skipped_turns < MAX_SKIPPED_TURNS, j.task.num_remaining_tokens))
    for job in order:
        try:
            piece = next_piece(job.task, budget, budget.turn_ms * (1 - spent), first)
            if piece is None:
                job.num_skipped_turns += 1
                continue
            first, job.num_skipped_turns = False, 0
            with request_context(job.request_id):
                job.task.advance(*piece)
            if job.task.last_piece is not None:
                predicted_ms = budget.predict_ms(*job.task.last_piece[:2])
                log.debug("prefill piece: %.1f tokens, %.0f keys, %.0f ms (predicted %.0f ms; turn budget %.0f ms)",
                          *job.task.last_piece, predicted_ms, budget.turn_ms)
                budget.observe(PieceCost(*job.task.last_piece))
                spent += budget.predict_ms(*job.task.last_piece[:2]) / budget.turn_ms
            if job.task.done:
                finished(job)
        except Exception as exc:  # noqa: BLE001 - the caller answers it, this request alone
            failed(job, exc)


def next_piece(task: PrefillTask, budget: ChunkBudget, budget_ms: float,
               first: bool) -> tuple[int, Callable[[float, float], bool] | None] | tuple[
                   int, Callable[[float, float], bool], int] | None:
    """``task.advance``'s arguments for its next piece within ``budget_ms`` of the turn, or None when it waits: no
    budget left, or (not the turn's first piece) not even the least piece fits. Plans the call on its first piece."""
    if budget_ms <= 0:
        return None
    positions = task.upcoming_positions(budget.max_tokens)
    if positions is not None:  # a piece of tokens
        num = budget.num_tokens(positions, budget_ms)
        if not first and budget.predict_ms(num, attended_keys(positions[:num])) > budget_ms:
            return None
        return num, None
    layer = task.upcoming_layer()
    if layer is None:  # nothing left to compute
        return budget.max_tokens, None
    if not first and budget.predict_ms(*least_of_layer(layer, budget.min_tokens)) > budget_ms:
        return None
    return (budget.max_tokens, lambda num_tokens, num_keys: budget.predict_ms(num_tokens, num_keys) <= budget_ms,
            budget.min_tokens)


def least_of_layer(layer: tuple[float, float], min_tokens: float) -> tuple[float, float]:
    """The least piece of a layer costing ``layer`` (tokens, keys, in tokens of a whole forward): all of it, or the
    first ``min_tokens``' worth of its rows, at its mean keys per row (a layer too costly for a piece runs in chunks
    of rows, kvrelay.model.row_chunks)."""
    num, num_keys = layer
    if num <= min_tokens:
        return num, num_keys
    return min_tokens, num_keys * min_tokens / num
