"""A group of many members is visited by class (``index_splits``): the same runs as member by member.

Groups are filed for the class path at ``SPLIT_MIN_MEMBERS`` members; here the threshold is lowered to 1 so that
every group of hypothesis' small scenes takes it, and the answers (``find_runs`` and ``find``) are compared
with the path that checks every member (the threshold out of reach), removals included (a removed span stays
its groups' reference): equal answers carry the property tests' guarantee over to the class path.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.server import index_splits
from kvrelay.server.index import TokenIndex, TokenMatch
from tests.server import test_index_properties as properties

HASH_BASE = 1_000_003


def build(block_len: int, spans: list[tuple[str, list[int]]], removals: list[tuple[int, int]]) -> TokenIndex:
    """Add the spans in order; after adding span ``when``, remove span ``victim`` (if added by then)."""
    index = TokenIndex(block_len=block_len, hash_base=HASH_BASE)
    for k, (namespace, ids) in enumerate(spans):
        index.add(f"s{k}", ids, namespace)
        for when, victim in removals:
            if when == k and victim <= k:
                index.remove(f"s{victim}")
    return index


@pytest.fixture
def split_threshold(monkeypatch):
    def set_to(num_members: int) -> None:
        monkeypatch.setattr(index_splits, "SPLIT_MIN_MEMBERS", num_members)
    return set_to


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(properties.scenes(), st.integers(1, 6), st.data())
def test_classes_give_what_members_one_by_one_give(split_threshold, scene, min_tokens, data):
    block_len, spans, query = scene
    # removals between additions: a group is filed after some of its members' first spans are gone
    span_numbers = st.integers(0, len(spans) - 1)
    removals = data.draw(st.lists(st.tuples(span_numbers, span_numbers), max_size=5))
    out = []
    for threshold in (data.draw(st.sampled_from([1, 2, 3])), 10**9):
        split_threshold(threshold)
        index = build(block_len, spans, removals)
        out.append((index.find_runs(query, "a", "oldest"), index.find(query, "a", min_tokens, prefer="oldest")))
    assert out[0] == out[1]


def test_spans_that_share_a_system_prompt_cost_what_a_few_do():
    """Stored calls of one agent open with its system prompt and then differ: a prompt holding that prompt
    was checked against every one of them (work linear in their number); now per class of ends."""
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(300)]
    work = []
    for num_spans in (20, 600):
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


def test_a_group_filed_after_its_first_spans_are_gone_still_names_the_oldest(split_threshold):
    """Members are read in order of creation and the reading stops once no later member can hold an older
    span; a member whose first span is gone holds a newer one, so the bound is taken over the members after
    it too (else the reading stops before an older member)."""
    block = [5, 6, 7, 8]  # previous block [5, 6], the group's block [7, 8]
    spans = [("a", [1, 1]), ("x", [2, 2]), ("w", [3, 3]), ("y", [4, 4]), ("a2", [1, 1]), ("x2", [2, 2]),
             ("w2", [3, 3]), ("z", [9, 9])]
    query = [0] + block + [0, 0]  # every member's run ends with the block
    out = []
    for threshold in (5, 10**9):
        split_threshold(threshold)
        index = TokenIndex(block_len=2)
        for span_id, after in spans:
            if span_id == "z":  # the fifth member: the group is filed now, its first three held by newer spans
                for gone in ("a", "x", "w"):
                    index.remove(gone)
            index.add(span_id, block + after)
        out.append(index.find_runs(query, prefer="oldest"))
    assert out[1] == [TokenMatch(1, 5, "y", 0)]  # y is the oldest span left
    assert out[0] == out[1]
