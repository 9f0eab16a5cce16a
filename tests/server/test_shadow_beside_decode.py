"""A shadow piece beside running streams is small: at most the chunk budget's least piece, and predicted within
``DECODE_STEP_SHARE`` of the turn's decode step (a token at least), paced or not; with no stream decoding a shadow
that is not paced takes a piece predicted within the engine's idle time so far, up to a turn's budget (a paced one
its least piece after its idle grace, as before); under continuous decoding a shadow still completes. The engine
worker driven turn by turn with the chunk budget's fit fixed (no measured time moves it) and the pacer on an
injected clock; each piece beside a decode step is checked against the step the worker handed the shadows in that
very turn, so no assertion depends on timing."""

from __future__ import annotations

import pytest

from kvrelay.server.shadow import DECODE_STEP_SHARE
from tests.server.test_quality_shadow import _job
from tests.server.test_shadow_pacer import Clock, _end, _paced_worker

CHUNK_TOKENS = 64  # a turn's budget; the least piece is an eighth of it, 8 tokens
# a fixed fit (ms = per_token * tokens): so cheap the least piece bounds a piece, or so dear one token does
CHEAP_PER_TOKEN_MS, DEAR_PER_TOKEN_MS = 1e-3, 1e3


def _fixed_fit(worker, monkeypatch, per_token_ms: float):
    budget = worker.chunk_budget
    monkeypatch.setattr(budget, "observe", lambda piece: None)  # the live pieces' measured times do not refit it
    budget.coef_ms = (0.0, per_token_ms, 0.0)
    return budget


def _record_pieces(worker) -> list[tuple[float | None, int, int]]:
    """(the decode step the worker handed ``advance``, tokens the piece computed, tokens it had left) of each shadow
    prompt piece, appended as the turns run."""
    runner, pieces = worker.shadows, []
    advance = runner.advance

    def spy(budget, decode_ms=None):
        shadow = runner._pending[0] if runner._pending else None
        task = shadow.task if shadow is not None else None
        num_left = len(shadow.prompt_ids) if shadow is not None and task is None else (
            task.num_remaining_tokens if task is not None else 0)
        num_chunks = task.num_chunks if task is not None else 0
        ran = advance(budget, decode_ms)
        if shadow is not None and shadow.task is not None and shadow.task.num_chunks > num_chunks:
            pieces.append((decode_ms, int(shadow.task.last_piece[0]), num_left))
        return ran

    runner.advance = spy
    return pieces


def _bound(budget, budget_ms: float, most_tokens: int, num_left: int) -> int:
    """The tokens of a piece predicted within ``budget_ms`` on the fixed linear fit: ``most_tokens`` at most, one at
    least."""
    return min(most_tokens, num_left, max(1, int(budget_ms / budget.coef_ms[1])))


@pytest.mark.parametrize("per_token_ms", [CHEAP_PER_TOKEN_MS, DEAR_PER_TOKEN_MS])
@pytest.mark.parametrize("paced", [False, True])
def test_beside_a_decoding_stream_every_shadow_piece_is_within_the_bound_and_idle_turns_take_a_turns_piece(
        tiny, monkeypatch, paced, per_token_ms):
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock, paced=paced, chunk_tokens=CHUNK_TOKENS, paid=True)
    budget = _fixed_fit(worker, monkeypatch, per_token_ms)
    pieces = _record_pieces(worker)
    job = _job_of(worker, tiny, "a call whose prompt its shadow prefills in many pieces " * 40, 45)
    worker.submit(job)
    while job.seq is None:
        worker.run_turn()
    shadow = worker.shadows._pending[0]
    assert shadow.paced == paced and len(shadow.prompt_ids) > 2 * CHUNK_TOKENS
    for _ in range(40):
        worker.shadows.pacer.busy_credit_ms = 1.0  # a paced piece between decode steps has its short credit
        worker.run_turn()
    beside = [p for p in pieces if p[0] is not None]
    assert len(beside) >= 30  # a piece in (about) every decode turn
    for decode_ms, num_tokens, num_left in beside:
        assert decode_ms > 0 and num_tokens == _bound(budget, DECODE_STEP_SHARE * decode_ms, budget.min_tokens,
                                                      num_left)
    assert max(n for _, n, _ in beside) <= budget.min_tokens < budget.max_tokens
    _end(worker, job)  # its last turn is the engine's first idle one
    for _ in range(3):  # the engine idle, and for no time yet (the clock does not move)
        worker.run_turn()
    idle = [p for p in pieces if p[0] is None]
    assert [n for _, n, _ in idle] == ([] if paced else [1] * 4)  # paced: its idle grace; not: a token a turn
    for idle_s in (3.5, 1e3):  # longer idle spells: larger pieces, up to a turn's budget (paced: its least piece)
        clock.now_s += idle_s
        num_before, idle_ms = len(pieces), worker.shadows.pacer.idle_ms
        least_ms = budget.coef_ms[1] * min(budget.min_tokens, shadow.task.num_remaining_tokens)
        worker.run_turn()
        if paced and least_ms > idle_ms:  # its idle grace: idle as long as its least piece takes
            assert pieces[num_before:] == []
            continue
        [(decode_ms, num_tokens, num_left)] = pieces[num_before:]
        assert decode_ms is None and idle_ms >= idle_s * 1e3
        assert num_tokens == (min(budget.min_tokens, num_left) if paced
                              else _bound(budget, min(budget.turn_ms, idle_ms), budget.max_tokens, num_left))
    assert paced or num_tokens == min(budget.max_tokens, num_left)  # a turn's budget, after a long idle spell
    while not shadow.task.done:
        worker.run_turn()
    while worker.shadows.num_pending:
        worker.run_turn()
    assert len(guard.records) == 1
    worker.stop()


def test_a_shadow_completes_under_continuous_decoding(tiny, monkeypatch):
    """A stream that decodes on and on, and a shadow of a long prompt that is not paced beside it, a token a turn
    (the fit makes every token dearer than the share of a step): the shadow's prompt, continuation and record are
    done while the stream still decodes, with no idle turn."""
    worker, guard = _paced_worker(tiny, Clock(), paced=False, chunk_tokens=CHUNK_TOKENS)
    budget = _fixed_fit(worker, monkeypatch, DEAR_PER_TOKEN_MS)
    pieces = _record_pieces(worker)
    sampled = _job_of(worker, tiny, "a sampled call of a long-lived role " * 6, 4)
    stream = _job_of(worker, tiny, "a long answer", 400, agent="other")
    worker.submit(stream)
    worker.submit(sampled)
    while sampled.seq is None:
        worker.run_turn()
    num_prompt = len(worker.shadows._pending[0].prompt_ids)
    while worker.shadows.num_pending:
        assert not stream.seq.done, "the stream ended before its neighbour's shadow"
        worker.run_turn()
    assert len(guard.records) == 1 and not stream.seq.done
    assert sum(n for _, n, _ in pieces) == num_prompt and all(n == 1 for _, n, _ in pieces)
    assert all(decode_ms is not None for decode_ms, _, _ in pieces) and budget.min_tokens > 1
    _end(worker, stream, sampled)
    worker.stop()


def _job_of(worker, tiny, text: str, max_tokens: int, agent: str = "sampled"):
    return _job(worker, tiny.tokenizer.encode(text), agent, max_tokens)


@pytest.fixture(scope="module")
def tiny():
    from kvrelay.weights.loader import load_model

    return load_model("random:tiny")
