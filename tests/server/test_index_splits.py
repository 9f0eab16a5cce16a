"""A group of many members is visited by class (``index_splits``): the same runs as member by member.

Groups reach the class path at ``SPLIT_MIN_MEMBERS`` members; here the threshold is lowered to 1 so that
every group of hypothesis' small scenes takes it, and the answers are compared with the path that checks
every member (the threshold out of reach), removals included (a removed span stays its groups' reference).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.server import index_sweep
from kvrelay.server.index import TokenIndex, TokenMatch
from tests.server import test_index_properties as properties

HASH_BASE = 1_000_003


def build(block_len: int, spans: list[tuple[str, list[int]]], removed: list[int]) -> TokenIndex:
    index = TokenIndex(block_len=block_len, hash_base=HASH_BASE)
    for k, (namespace, ids) in enumerate(spans):
        index.add(f"s{k}", ids, namespace)
    for k in removed:
        index.remove(f"s{k}")
    return index


@pytest.fixture
def split_threshold(monkeypatch):
    def set_to(num_members: int) -> None:
        monkeypatch.setattr(index_sweep, "SPLIT_MIN_MEMBERS", num_members)
    return set_to


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(properties.scenes(), st.integers(1, 6), st.data())
def test_classes_give_what_members_one_by_one_give(split_threshold, scene, min_tokens, data):
    block_len, spans, query = scene
    removed = data.draw(st.lists(st.integers(0, len(spans) - 1), max_size=4, unique=True))
    out = []
    for threshold in (1, 10**9):
        split_threshold(threshold)
        index = build(block_len, spans, removed)
        out.append((index.find_runs(query, "a", "oldest"), index.find(query, "a", min_tokens, prefer="oldest")))
    assert out[0] == out[1]


def test_the_guarantee_holds_on_the_class_path(split_threshold):
    split_threshold(1)
    properties.test_every_long_run_is_inside_a_candidate_and_candidates_are_real()
    properties.test_find_leaves_no_long_shared_stretch_free()


def test_spans_that_share_a_system_prompt_cost_what_a_few_do():
    """Stored calls of one agent open with its system prompt and then differ: a prompt holding that prompt
    was checked against every one of them (work linear in their number); now per class of ends."""
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(300)]
    work = []
    for num_spans in (20, 2000):
        index = TokenIndex(block_len=16)
        spans = [system + [rng.randrange(1000, 50000) for _ in range(200)] for _ in range(num_spans)]
        for k, ids in enumerate(spans):
            index.add(f"s{k}", ids)
        query = system + spans[num_spans // 2][300:450] + system[100:]
        found = index.find(query, min_tokens=16, prefer="oldest")
        # the system prompt from the span that stored it first, the rest from the one that holds it
        assert found == [TokenMatch(0, 300, "s0", 0), TokenMatch(300, 450, f"s{num_spans // 2}", 300),
                         TokenMatch(450, 650, "s0", 100)], found
        work.append(index.last_work)
    assert work[1] <= work[0] * 1.5, work
