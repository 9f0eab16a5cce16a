"""Bytes a structure keeps per call of a churning workload: the check that a long-running server's state is bounded.

``retained_bytes_per_call(step, num_calls)`` runs ``step(i)`` for ``num_calls`` warm-up calls, then
``NUM_WINDOWS`` batches of ``num_calls`` more, and returns the least Python heap growth over one batch
(``tracemalloc``, after a collection) divided by ``num_calls``. A structure that keeps one small entry per call (a
dict key per namespace, an id per eviction) keeps tens of bytes per call in every batch; a bounded one keeps none
once warm. ``tracemalloc`` counts every thread's allocations, and in a long test session threads other tests left
(a server's worker, a tier's writer) allocate now and then: the least of several batches is the step's own
retention, since a leak shows in each batch and another thread's burst in some. No timing is involved.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

#: a bounded structure's heap settles to within a few bytes per call; one entry per call is 50 bytes or more
MAX_BOUNDED_BYTES_PER_CALL = 8.0


#: batches measured after the warm-up; the least growth of them is the step's
NUM_WINDOWS = 3


def retained_bytes_per_call(step: Callable[[int], object], num_calls: int = 2000) -> float:
    for i in range(num_calls):
        step(i)
    gc.collect()
    growth_bytes: list[int] = []
    tracemalloc.start()
    try:
        for window in range(1, NUM_WINDOWS + 1):
            before = tracemalloc.get_traced_memory()[0]
            for i in range(window * num_calls, (window + 1) * num_calls):
                step(i)
            gc.collect()
            growth_bytes.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    return min(growth_bytes) / num_calls
