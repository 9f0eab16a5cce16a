"""TokenIndex keeps its bulk out of the garbage collector's sight: a collection does not walk the index.

Python's cyclic collector walks every object it tracks at each full collection, so an index that held
containers per block (a million at 10,000 spans) made some lookup wait half a second. Dicts of ints are
never tracked; what the index keeps per span that is tracked is a constant, whatever the span's length.
"""

from __future__ import annotations

import gc
import random

from kvrelay.server.index import TokenIndex

SPAN_TOKENS = 64  # 16 blocks of 4: a container per block would be 16 tracked objects per span


def spans(num_spans: int, seed: int = 0) -> list[list[int]]:
    """Random spans, a third of them copies of an earlier one (members with many holders), half of the
    rest opening with one shared passage (groups with many members)."""
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(24)]
    out: list[list[int]] = []
    for k in range(num_spans):
        if out and k % 3 == 0:
            out.append(list(rng.choice(out)))
        elif k % 2:
            out.append(shared + [rng.randrange(50) for _ in range(SPAN_TOKENS - len(shared))])
        else:
            out.append([rng.randrange(50) for _ in range(SPAN_TOKENS)])
    return out


def tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def tracked_per_span(index: TokenIndex, small: int, large: int) -> float:
    """Tracked objects added per span between ``small`` and ``large`` stored spans (lookups included)."""
    data = spans(large)
    counts = []
    for n in (small, large):
        while len(index) < n:
            index.add(f"s{len(index)}", data[len(index)], namespace=f"t{len(index) % 3}")
        index.find(data[n - 1][8:] + data[0][:20], namespace="t0", min_tokens=4)
        counts.append(tracked_objects())
    return (counts[1] - counts[0]) / (large - small)


def test_stored_spans_add_a_constant_number_of_tracked_objects_whatever_their_length():
    per_span = tracked_per_span(TokenIndex(block_len=4), 50, 450)
    assert per_span <= 2.5, per_span  # the span's entry and its prefix hashes; no object per block


def test_removed_spans_leave_no_tracked_objects():
    data = spans(300, seed=1)
    index = TokenIndex(block_len=4)
    empty = tracked_objects()
    for k, ids in enumerate(data):
        index.add(f"s{k}", ids, namespace=f"t{k % 2}")
    for k in range(len(data)):
        index.remove(f"s{k}")
    assert len(index) == 0 and not index._groups
    assert tracked_objects() - empty <= 2, tracked_objects() - empty
