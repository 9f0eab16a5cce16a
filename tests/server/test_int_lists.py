"""IntLists against plain Python lists: the same nodes in the same order after any appends and removals."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.server.int_lists import IntLists

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 30)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_matches_plain_lists(steps):
    lists, model = IntLists(), {}
    where: dict[int, int] = {}  # node -> the key whose list holds it
    for add, key, node in steps:
        if add and node not in where:
            lists.append(key, node)
            model.setdefault(key, []).append(node)
            where[node] = key
        elif not add and node in where:
            key = where.pop(node)
            model[key].remove(node)
            assert lists.remove(key, node) == (not model[key])
            if not model[key]:
                del model[key]
        for k in range(4):
            expected = model.get(k, [])
            assert list(lists.nodes(k)) == expected
            assert (k in lists) == bool(expected)
            if expected:
                assert (lists.head[k], lists.tail[k]) == (expected[0], expected[-1])
    assert len(lists) == len(model)
    if not model:  # nothing left behind
        assert not (lists.head or lists.tail or lists.next or lists.prev)


def test_the_collector_never_tracks_them():
    lists = IntLists()
    for node in range(1000):
        lists.append(node % 7, node)
    for node in range(0, 1000, 3):
        lists.remove(node % 7, node)
    assert not any(gc.is_tracked(d) for d in (lists.head, lists.tail, lists.next, lists.prev))
