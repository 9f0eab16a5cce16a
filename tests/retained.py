"""Bytes a structure keeps per call of a churning workload: the check that a long-running server's state is bounded.

``retained_bytes_per_call(step, num_calls)`` runs ``step(i)`` for ``num_calls`` warm-up calls, then ``num_calls``
more, and returns the Python heap growth over the second batch (``tracemalloc``, after a collection) divided by
``num_calls``. A structure that keeps one small entry per call (a dict key per namespace, an id per eviction) keeps
tens of bytes per call; a bounded one keeps none once warm. No timing is involved: the count is the heap's own.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

#: a bounded structure's heap settles to within a few bytes per call; one entry per call is 50 bytes or more
MAX_BOUNDED_BYTES_PER_CALL = 8.0


def retained_bytes_per_call(step: Callable[[int], object], num_calls: int = 2000) -> float:
    for i in range(num_calls):
        step(i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(num_calls, 2 * num_calls):
            step(i)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / num_calls
