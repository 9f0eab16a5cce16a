"""A tenant whose grammars take long to compile (tools, response_format) delays no other tenant: compiles run on
their own threads, one at a time per tenant (kvrelay.server.grammar_compiles), and a request with nothing to
compile never waits for them. A compile is held open here (the compile function gated), so the overlap is made
certain rather than timed."""

from __future__ import annotations

import threading

import httpx
import pytest

import kvrelay.server.grammar as grammar
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

KEYS = frozenset({"key-a", "key-b"})
NUM_SLOW = 33  # more than asyncio's default executor ever has threads (min(32, cpus + 4))
SLOW = {"type": "json_schema", "json_schema": {"name": "slow", "schema": {"type": "object", "title": "slow"}}}


class GatedCompiles:
    """``constraint_for``, where a grammar titled "slow" waits for ``release`` first."""

    def __init__(self, real) -> None:
        self.real, self.release, self.num_slow_entered = real, threading.Event(), 0
        self._lock = threading.Lock()

    def __call__(self, plan, fmt, tokenizer):
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.name == "slow":
            with self._lock:
                self.num_slow_entered += 1
            assert self.release.wait(timeout=120), "the test never released the compile"
        return self.real(plan, fmt, tokenizer)


@pytest.fixture
def gated(monkeypatch) -> GatedCompiles:
    gate = GatedCompiles(grammar.constraint_for)
    monkeypatch.setattr(grammar, "constraint_for", gate)
    return gate


def _chat(srv: LiveServer, key: str, **body) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)  # bounds a broken server only: each request below is answered without waiting


def _num_at_compile(srv: LiveServer) -> int:
    """Requests compiling their grammar or waiting for their tenant's turn to (GrammarCompiles' own count)."""
    return sum(num_users[0] for _, num_users in srv.app.state.context.compiles._turns.values())


def test_slow_compiles_of_one_tenant_delay_no_other_request(gated):
    srv = LiveServer(api_keys=KEYS)
    answers: list[httpx.Response] = []
    slow = [threading.Thread(target=lambda: answers.append(_chat(srv, "key-a", response_format=SLOW)))
            for _ in range(NUM_SLOW)]
    try:
        for t in slow:
            t.start()
        # every slow request has reached its compile step: compiling, or waiting for its tenant's turn
        srv.wait_until(lambda: _num_at_compile(srv) == NUM_SLOW and gated.num_slow_entered >= 1,
                       "the slow requests queued for their compiles")
        plain = _chat(srv, "key-b")
        assert plain.status_code == 200, plain.text
        other_grammar = _chat(srv, "key-b", response_format={"type": "json_object"})
        assert other_grammar.status_code == 200, other_grammar.text
        assert gated.num_slow_entered == 1  # tenant a's compiles run one at a time
        assert answers == []  # and all of them were still held while tenant b was answered
    finally:
        gated.release.set()
        for t in slow:
            t.join(timeout=120)
        srv.stop()
    assert [r.status_code for r in answers] == [200] * NUM_SLOW


def test_requests_of_one_namespace_waiting_for_the_same_grammar_compile_it_once(gated):
    srv = LiveServer(api_keys=KEYS)
    answers: list[httpx.Response] = []
    same = [threading.Thread(target=lambda: answers.append(_chat(srv, "key-a", response_format=SLOW)))
            for _ in range(3)]
    try:
        for t in same:
            t.start()
        srv.wait_until(lambda: _num_at_compile(srv) == len(same) and gated.num_slow_entered == 1,
                       "the first compile held, the other requests waiting for their turn")
    finally:
        gated.release.set()
        for t in same:
            t.join(timeout=120)
        srv.stop()
    assert [r.status_code for r in answers] == [200] * len(same)
    assert gated.num_slow_entered == 1  # the others took the grammar the first one compiled


def test_a_tenants_waiting_requests_are_bounded_and_a_shut_down_pool_gives_the_turn_back():
    """One compiling and MAX_WAITING_PER_TENANT waiting: one more of that tenant is a 429 (each held its body for
    as long as it waited), another tenant's is compiled. After shutdown a compile is refused and its turn given
    back (it was kept: every later request of the tenant waited for good)."""
    import asyncio

    from kvrelay.server.grammar_compiles import MAX_WAITING_PER_TENANT, GrammarCompiles
    from kvrelay.server.protocol import ApiError

    async def main() -> None:
        compiles, gate = GrammarCompiles(num_threads=2), threading.Event()
        first = asyncio.create_task(compiles.run("a", gate.wait))
        waiting = [asyncio.create_task(compiles.run("a", int, "1")) for _ in range(MAX_WAITING_PER_TENANT)]
        await asyncio.sleep(0)  # one turn of the loop: each task has taken its place (no time passes)
        with pytest.raises(ApiError) as err:
            await compiles.run("a", int, "1")
        assert err.value.status == 429 and err.value.headers == {"Retry-After": "1"}
        assert await compiles.run("b", int, "2") == 2
        gate.set()
        assert await first is True and [await w for w in waiting] == [1] * MAX_WAITING_PER_TENANT
        compiles.shutdown()
        with pytest.raises(RuntimeError):
            await compiles.run("c", int, "3")
        assert "c" not in compiles._turns

    asyncio.run(main())
