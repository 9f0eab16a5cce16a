"""xgrammar's mask and its matcher disagreeing (the matcher refuses a token its own bitmask allowed) must never
fail the request: the engine samples another token, and the answer is a schema-valid call.

The disagreement is planted (a matcher that refuses the first tokens offered on the first steps), as seen once
with smolagents on SmolLM2 ("the grammar refused token 2683 its own mask allowed", a 500): the tokens it
refuses are ones the mask allowed, since the engine samples only those."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from jsonschema import Draft202012Validator
from starlette.testclient import TestClient

from kvrelay.server import grammar
from tests.server.inproc import MODEL, make_app

ARGS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                         "note": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "note", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": ARGS}}]


class Disagreeing:
    """A real matcher that refuses the first ``num_per_step`` tokens offered on each of its first ``num_steps``
    steps where its mask allows more than ``num_per_step`` tokens (so a token is left to accept), and every token
    on step ``refuse_all_at``."""

    def __init__(self, compiled, num_steps: int, num_per_step: int, refuse_all_at: int | None = None) -> None:
        self.inner = REAL_MATCHER(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.num_steps, self.num_per_step, self.refuse_all_at = num_steps, num_per_step, refuse_all_at
        self.step, self.num_planted_steps, self.num_refused_now = 0, 0, 0
        self.refused: list[tuple[int, int]] = []  # (step, token id)

    def _num_allowed(self) -> int:
        # one per tokenizer object (another test module's app may have added its own): any of this size serves
        vocab = next(v for v in grammar._VOCABULARIES.values() if v.size == self.vocab_size)
        words = grammar.xgr.allocate_token_bitmask(1, vocab.size)
        self.inner.fill_next_token_bitmask(words)
        return int(np.unpackbits((words[0] & vocab.keep_words).numpy().view(np.uint8)).sum())

    def accept_token(self, token_id: int) -> bool:
        planted = (self.num_planted_steps < self.num_steps and self.num_refused_now < self.num_per_step
                   and (self.num_refused_now > 0 or self._num_allowed() > self.num_per_step))
        if planted or self.step == self.refuse_all_at:
            self.num_refused_now += 1
            self.refused.append((self.step, token_id))
            return False
        if self.num_refused_now:
            self.num_planted_steps += 1
        self.step, self.num_refused_now = self.step + 1, 0
        return self.inner.accept_token(token_id)

    def __getattr__(self, name):
        return getattr(self.inner, name)


REAL_MATCHER = grammar.xgr.GrammarMatcher if grammar.xgr is not None else None
pytestmark = pytest.mark.skipif(grammar.xgr is None, reason="needs the tools extra (xgrammar)")


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


def _plant(monkeypatch, **kw) -> list[Disagreeing]:
    made: list[Disagreeing] = []

    def factory(compiled):
        made.append(Disagreeing(compiled, **kw))
        return made[-1]

    monkeypatch.setattr(grammar.xgr, "GrammarMatcher", factory)
    return made


def _forced_call(client: TestClient, temperature: float):
    # seeded: a sampled answer is the same on every run, so the test does not depend on chance
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Forecast?"}], "tools": TOOLS,
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80, "temperature": temperature,
        "seed": 0})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_token_the_matcher_refuses_after_its_mask_allowed_it_is_sampled_again(client, monkeypatch, temperature):
    made = _plant(monkeypatch, num_steps=4, num_per_step=2)
    reply = _forced_call(client, temperature)
    assert reply.status_code == 200, reply.text
    (matcher,) = made
    steps = [step for step, _ in matcher.refused]
    assert len(steps) == 8 and len(set(steps)) == 4, matcher.refused  # two refused on each of four steps
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    Draft202012Validator(ARGS).validate(json.loads(call["function"]["arguments"]))


def test_past_the_resamples_the_most_likely_accepted_token_is_taken(client, monkeypatch):
    from kvrelay.engine.constrained import MAX_RESAMPLES

    made = _plant(monkeypatch, num_steps=2, num_per_step=MAX_RESAMPLES + 3)
    reply = _forced_call(client, 1.0)
    assert reply.status_code == 200, reply.text
    assert len(made[0].refused) == 2 * (MAX_RESAMPLES + 3)
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    Draft202012Validator(ARGS).validate(json.loads(call["function"]["arguments"]))


def test_a_grammar_that_accepts_nothing_fails_that_request_alone_and_says_so(client, monkeypatch):
    _plant(monkeypatch, num_steps=0, num_per_step=0, refuse_all_at=3)
    reply = _forced_call(client, 0.0)
    assert reply.status_code != 200
    assert "refused every token its mask allowed" in reply.json()["error"]["message"]
    monkeypatch.undo()
    assert _forced_call(client, 0.0).status_code == 200  # the server goes on
