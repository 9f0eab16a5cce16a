"""Shadow references: the server measures its own fidelity on a sample of live requests.

For a request the quality guard samples, the engine worker also runs ``full`` on the very same prompt ids and
compares it with what the request's own method computed:

- first-token KL(full || method) and top-1 agreement, from the first-token logits;
- the KL over the first ``CONTINUATION_TOKENS`` tokens of the method's own continuation: those tokens are fed
  to ``full`` as one chunk after its prompt, and its logits at each of them are compared with the live
  request's decode-step logits at the same positions (kept for sampled requests only, by a ``LogitsTap``).

A shadow is work nobody waits for, so it runs at the lowest priority: the worker advances it one piece at a time
only in turns where no live prefill is waiting, and outside every request's TTFT, each piece sized by the worker's
``ChunkBudget`` by predicted time, as live pieces are. Between the decode steps of running streams a piece is small:
the least piece, fewer tokens where even that is predicted to take more than ``DECODE_STEP_SHARE`` of the turn's
decode step (a ``full`` prefill piece deep in a long prompt costs many decode steps, and every stream's next token
waits for it). With no request decoding, a piece of a shadow that is not paced is predicted within the time the
engine has been idle, a turn's budget at most: an agent chain sends its next call within milliseconds of the last
answer, and finds one small piece in flight, not a turn's budget; a longer idle spell grows the pieces to a turn's
budget within a few of them. So a stream beside a shadow waits for about one small forward per token, and a shadow
still advances at least a token a turn under continuous decoding. For a namespace whose roles do not live
through their warm-up (the guard's ``paced``), a ``ShadowPacer`` (kvrelay.server.shadow_pacer) holds the shadows to
a share of the live compute: a call is drawn at a rate learned to spend the share, the same for every call whatever
its length (within a credit that bounds a run of lucky draws), a piece runs between decode steps only on a short
credit and in idle time only once the engine has been idle as long as the piece takes, and a paced piece is the
least the budget gives, so a stream's next token, or a new request's first, waits for at most that.
Its KV is private: it is planned without a store (nothing is read, published or counted as reuse) and freed once
compared; before that, a ``ShadowTeacher`` hands it to the ladder's learning rungs as their
own dense prefill of the call. Its compute time, teaching included, is what it costs, counted per shadow and
exported (``kvrelay.server.quality_metrics``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.engine import Engine, GenerateOptions, Sequence
from kvrelay.engine.prefill import PrefillTask
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.server.chunk_budget import ChunkBudget, attended_keys
from kvrelay.server.prefill_turn import next_piece
from kvrelay.server.shadow_pacer import ShadowPacer
from kvrelay.server.shadow_teacher import ShadowTeacher

log = logging.getLogger("kvrelay.server")
CONTINUATION_TOKENS = 4  # tokens of the method's own continuation compared with full's logits on them
MAX_PENDING_SHADOWS = 8  # sampled requests whose reference waits or runs; a sample beyond it is not taken
_LEAST_MS = 1e-6  # a paced piece's budget: the chunk budget gives it its least piece
# Between decode steps a shadow piece is predicted to take at most this share of the turn's decode step (one token
# where even that is predicted to take more): a stream's next token waits for it, and a turn's budget deep in a long
# prompt is many decode steps. A share of the step, not a time, so it needs no per-model or per-machine setting; a
# forward of a few tokens costs about a decode step on a CPU whatever the share (docs/quality.md), so a smaller one
# would slow the shadow more than it shortens the stream's wait.
DECODE_STEP_SHARE = 0.5


def kl_nats(full_logits: torch.Tensor, method_logits: torch.Tensor) -> torch.Tensor:
    """KL(full || method) per row of [..., vocab] logits, in nats (float64: fp32's own rounding floor is ~1e-8)."""
    log_p = torch.log_softmax(full_logits.double(), -1)
    log_q = torch.log_softmax(method_logits.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


class LogitsTap:
    """A ``LogitsMask`` that keeps the raw logits of a sequence's first ``num_steps`` samples (before the request's
    own constraint, which it wraps and otherwise leaves alone)."""

    def __init__(self, inner: Any, num_steps: int) -> None:
        self.inner, self.num_steps = inner, num_steps
        self.logits: list[torch.Tensor] = []  # [vocab] fp32 each

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if len(self.logits) < self.num_steps:
            self.logits.append(logits.detach().float().clone())
        return logits if self.inner is None else self.inner.apply(logits)

    def advance(self, token_id: int) -> None:
        if self.inner is not None:
            self.inner.advance(token_id)


@dataclass(frozen=True)
class ShadowResult:
    """One comparison with ``full``, as recorded into the guard."""

    namespace: str
    role: str
    rung: str
    first_token_kl: float
    top1_agree: bool
    continuation_kl: float | None  # None: the request generated no token past its first
    num_continuation_tokens: int
    shadow_cost_ms: float


@dataclass(eq=False)  # by identity: two shadows of one prompt are two (their tensors have no equality)
class ShadowJob:
    """One sampled request's reference: its ``full`` prefill, then the continuation chunk once the live request
    has decoded far enough (or ended)."""

    namespace: str
    role: str
    rung: str
    prompt_ids: list[int]
    method_first_logits: torch.Tensor  # [vocab] fp32: the live request's first-token logits
    live: Sequence  # the live request's sequence (its output ids; its KV is never touched)
    tap: LogitsTap
    paced: bool = False  # drawn by the pacer (kvrelay.server.shadow_pacer), charged ``charged_ms``
    charged_ms: float = 0.0
    spent_ms: float = 0.0  # its pieces' time, as the pacer counted it
    task: PrefillTask | None = None
    cost_ms: float = 0.0
    created_s: float = field(default_factory=time.perf_counter)

    @property
    def continuation_ready(self) -> bool:
        return self.live.done or len(self.tap.logits) >= CONTINUATION_TOKENS


class ShadowRunner:
    """The worker's shadow references: ``offer`` right after a live request's first token, ``advance`` in turns
    with no live prefill waiting. ``guard`` is the quality guard (``should_shadow``, ``record``)."""

    def __init__(self, engine: Engine, guard: Any, on_result=None, teacher: ShadowTeacher | None = None,
                 pacer: ShadowPacer | None = None) -> None:
        """``on_result(ShadowResult)``: called after each recorded comparison (metrics); ``teacher``: hands each
        finished reference's KV to the ladder's learning rungs (``kvrelay.server.shadow_teacher``); ``pacer``: the
        share of the engine shadows may take and when (None: every free turn, a turn's budget per piece)."""
        self.engine, self.guard, self.on_result, self.teacher = engine, guard, on_result, teacher
        self.pacer = pacer
        self.engine.method("full")
        self._pending: deque[ShadowJob] = deque()
        self.num_runs = 0
        self.num_failed = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _movable(self) -> list[ShadowJob]:
        """The pending shadows that can advance, in order (one waiting only for its live continuation cannot)."""
        return [s for s in self._pending if s.task is None or not s.task.done or s.continuation_ready]

    def offer(self, namespace: str, role: str, rung: str, seq: Sequence, budget: ChunkBudget) -> ShadowJob | None:
        """After ``seq``'s first token: when the guard samples (namespace, role), queue its reference and tap the
        sequence's next decode logits. The sequence must not have decoded past its first token yet. A paced
        namespace's call is offered to the pacer with its reference's predicted time (``budget``'s fit), drawn at
        the pacer's rate (the same for every call, whatever its length), and charged that time when taken."""
        if len(self._pending) >= MAX_PENDING_SHADOWS:
            return None
        paced = self.pacer is not None and self.guard.paced(namespace)
        cost_ms = reference_ms(len(seq.prompt_ids), budget) if paced else 0.0
        # ``rung``: what the call runs; a method the request named is counted apart from the role's rung
        if self.pacer is None:
            sampled = self.guard.should_shadow(namespace, role, True, rung)
        else:
            # the pacer is asked only for a call the guard wants: its rate is learned over those
            sampled = self.guard.should_shadow(namespace, role,
                                               (lambda: self.pacer.affordable(cost_ms)) if paced else True, rung)
        if not sampled:
            return None
        if paced:
            self.pacer.take(cost_ms)
        tap = LogitsTap(seq.options.logits_mask, CONTINUATION_TOKENS)
        seq.options = dataclasses.replace(seq.options, logits_mask=tap)
        shadow = ShadowJob(namespace, role, rung, list(seq.prompt_ids), seq.first_logits.detach().float().clone(),
                           seq, tap, paced=paced, charged_ms=cost_ms)
        self._pending.append(shadow)
        return shadow

    def note_turn(self, live_ms: float | None, idle: bool) -> None:
        """The worker's turn: its live work took ``live_ms`` (None: it had none); ``idle``: no live work is left."""
        if self.pacer is None:
            return
        if live_ms is not None:
            self.pacer.live_turn(live_ms)
        if idle:
            self.pacer.idle()

    def ready_in_s(self, budget: ChunkBudget) -> float | None:
        """Seconds until a shadow piece may run (0: now); None when no shadow can advance."""
        waits = [self._wait_s(shadow, budget) for shadow in self._movable()]
        return min(waits) if waits else None

    def _wait_s(self, shadow: ShadowJob, budget: ChunkBudget) -> float:
        if not shadow.paced:
            return 0.0
        piece_ms = self._next_ms(shadow, budget)
        return math.inf if piece_ms is None else self.pacer.ready_in_s(piece_ms)  # None: dropped

    def advance(self, budget: ChunkBudget, decode_ms: float | None = None) -> bool:
        """One piece of shadow work within one turn of ``budget``: of the first pending shadow that may run now (a
        paced one when the pacer lets it start), a piece of its prompt, or (prompt done, continuation known) its
        continuation chunk, the comparison and the record. ``decode_ms``: the turn's decode step, while requests
        decode (None: none does). A prompt piece is, while requests decode, at most the least piece and predicted
        within ``DECODE_STEP_SHARE`` of ``decode_ms`` (a token at least); with none decoding, a paced shadow's least
        piece (after the pacer's idle grace), or for one that is not paced the most tokens predicted within the
        engine's idle time so far, a turn's budget at most (a token at least; without a pacer, a turn's budget).
        True when something ran."""
        shadow = next((s for s in self._movable() if self._wait_s(s, budget) <= 0), None)
        if shadow is None:
            return False
        start_s = time.perf_counter()
        try:
            if shadow.task is None or not shadow.task.done:
                self._prefill(shadow, budget, decode_ms)
            else:  # pending until recorded: a reader of ``num_pending`` (the gauge, a test waiting for its
                # shadow) sees 0 only once the comparison and its lessons are done
                self._compare(shadow)
                self._pending.remove(shadow)
        except Exception:  # a reference that breaks is dropped; live requests never see it
            self._drop(shadow)
        finally:
            if self.pacer is not None:
                piece_ms = (time.perf_counter() - start_s) * 1e3
                self.pacer.spent(piece_ms, shadow.paced)
                if shadow.paced:
                    shadow.spent_ms += piece_ms
                    if shadow not in self._pending:  # ended: the difference from what it was charged
                        self.pacer.settle(shadow.spent_ms - shadow.charged_ms)
        return True

    def _drop(self, shadow: ShadowJob) -> None:
        log.exception("a shadow reference failed; it is dropped")
        self.num_failed += 1
        if shadow in self._pending:
            self._pending.remove(shadow)
        if shadow.task is not None:
            shadow.task.cancel()

    def _next_ms(self, shadow: ShadowJob, budget: ChunkBudget) -> float | None:
        """``_predict_ms``, or None when planning the (paced) shadow failed: it is dropped, its charge settled."""
        try:
            return self._predict_ms(shadow, budget)
        except Exception:  # noqa: BLE001 - a reference that breaks is dropped; live requests never see it
            self._drop(shadow)
            self.pacer.settle(shadow.spent_ms - shadow.charged_ms)
            return None

    def _task(self, shadow: ShadowJob) -> PrefillTask:
        if shadow.task is None:
            # no store: nothing is looked up, published or counted as reuse; room for the continuation chunk
            options = GenerateOptions(SamplingConfig(max_new_tokens=CONTINUATION_TOKENS, temperature=0.0),
                                      keep_cache=True, learn=False)
            shadow.task = self.engine.begin(shadow.prompt_ids, "full", options, store=_NO_STORE)
        return shadow.task

    def _predict_ms(self, shadow: ShadowJob, budget: ChunkBudget) -> float:
        """The predicted time of a paced ``shadow``'s next piece (its least piece), from token counts: a shadow not
        begun is not planned (no KV is held for it before it runs)."""
        num_prompt = len(shadow.prompt_ids)
        if shadow.task is not None and shadow.task.done:  # the continuation chunk after the prompt
            return budget.predict_ms(CONTINUATION_TOKENS,
                                     attended_keys(list(range(num_prompt, num_prompt + CONTINUATION_TOKENS))))
        start = num_prompt - shadow.task.num_remaining_tokens if shadow.task is not None else 0
        num = min(budget.min_tokens, num_prompt - start)
        return budget.predict_ms(num, attended_keys(list(range(start, start + num))))

    def _prefill(self, shadow: ShadowJob, budget: ChunkBudget, decode_ms: float | None) -> None:
        task = self._task(shadow)
        if decode_ms is not None:
            task.advance(*_small_piece(task, budget, DECODE_STEP_SHARE * decode_ms, budget.min_tokens))
        elif shadow.paced:
            task.advance(*next_piece(task, budget, _LEAST_MS, first=True))
        elif self.pacer is None:
            task.advance(*next_piece(task, budget, budget.turn_ms, first=True))
        else:  # a call that comes now waits for this piece: no longer than the engine has been idle
            idle_ms = self.pacer.idle_ms or 0.0  # None: a request is being prepared, live work in a moment
            task.advance(*_small_piece(task, budget, min(budget.turn_ms, idle_ms), budget.max_tokens))
        shadow.cost_ms = task.compute_ms
        if task.last_piece is not None:
            log.debug("shadow piece: %.1f tokens, %.0f keys, %.0f ms (predicted %.0f ms; turn budget %.0f ms)",
                      *task.last_piece, budget.predict_ms(*task.last_piece[:2]), budget.turn_ms)

    def _compare(self, shadow: ShadowJob) -> ShadowResult:
        """The continuation chunk, the comparison, the record; the shadow's KV is freed."""
        ref = shadow.task.sequence()  # full's first-token logits; its greedy token is not used
        shadow.task = None
        if self.teacher is not None:  # the prompt's dense KV, before the continuation chunk extends the cache
            shadow.cost_ms += self.teacher.teach_safely(shadow.namespace, shadow.live.call, ref.cache,
                                                        shadow.live.method)
        num_prompt = len(shadow.prompt_ids)
        continuation = list(shadow.live.output_ids[: min(len(shadow.tap.logits), CONTINUATION_TOKENS)])
        continuation_kl = None
        start_s = time.perf_counter()
        if continuation:
            ids = torch.tensor(shadow.prompt_ids + continuation, dtype=torch.long)
            result = self.engine.lm.model.prefill(ids, ref.cache, SuffixSchedule(num_prompt), all_logits=True)
            full_logits = result.logits.reshape(len(continuation), -1)  # [num_continuation, vocab]
            method_logits = torch.stack(shadow.tap.logits[: len(continuation)])  # [num_continuation, vocab]
            continuation_kl = float(kl_nats(full_logits, method_logits).mean())
        ref.cache = None
        shadow.cost_ms += (time.perf_counter() - start_s) * 1e3
        first_kl = float(kl_nats(ref.first_logits, shadow.method_first_logits))
        agree = int(ref.first_logits.argmax()) == int(shadow.method_first_logits.argmax())
        result = ShadowResult(shadow.namespace, shadow.role, shadow.rung, first_kl, agree, continuation_kl,
                              len(continuation), shadow.cost_ms)
        self.guard.record(shadow.namespace, shadow.role, shadow.rung, first_kl, agree, continuation_kl,
                          shadow.cost_ms)
        self.num_runs += 1
        if self.on_result is not None:
            self.on_result(result)
        return result

    def drop_all(self) -> None:
        """Free every pending shadow (the worker stops)."""
        for shadow in self._pending:
            if shadow.task is not None:
                shadow.task.cancel()
        self._pending.clear()


def _small_piece(task: PrefillTask, budget: ChunkBudget, budget_ms: float, most_tokens: int) -> tuple:
    """``task.advance``'s arguments for the most tokens, up to ``most_tokens``, predicted within ``budget_ms``, one at
    least (so a shadow advances every turn however short the step or the idle spell); a plan run in pieces of layers
    (not ``full``'s) gets its least piece."""
    positions = task.upcoming_positions(most_tokens)
    if positions is None:
        return next_piece(task, budget, _LEAST_MS, first=True)
    return budget.num_tokens(positions, budget_ms, least_tokens=1), None


def reference_ms(num_prompt: int, budget: ChunkBudget) -> float:
    """A paced reference's predicted time by ``budget``'s (linear) fit: its prompt in least pieces, then the
    continuation chunk."""
    fixed_ms, per_token_ms, per_key_ms = budget.coef_ms
    num_pieces = -(-num_prompt // budget.min_tokens)
    num_tokens = num_prompt + CONTINUATION_TOKENS
    num_keys = num_tokens * (num_tokens + 1) // 2  # attended_keys of positions 0..num_tokens-1, without the list
    return (num_pieces + 1) * fixed_ms + per_token_ms * num_tokens + per_key_ms * num_keys


class _NoStore:
    """Passed as a shadow's store so the engine does not fall back to its own: ``full`` reads nothing from it."""

    def take_decisions(self) -> list:
        return []

    def set_compute_rate(self, rate: float) -> None:
        pass


_NO_STORE = _NoStore()
