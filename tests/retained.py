"""Bytes a structure keeps per call of a churning workload: the check that a long-running server's state is bounded.

``retained_bytes_per_call(step, num_calls)`` runs ``step(i)`` for ``num_calls`` warm-up calls, then
``NUM_WINDOWS`` batches of ``num_calls`` more, and returns the least Python heap growth over one batch divided by
``num_calls``, counting only what the calls of ``step`` allocated (``tracemalloc`` traces whose stack holds
``step``'s file; threads other tests left running, a server's worker or a tier's poller, allocate too, and their
allocations are not the step's). A structure that keeps one small entry per call (a dict key per namespace, an id
per eviction) keeps tens of bytes per call in every batch; a bounded one keeps none once warm. No timing is involved.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

#: a bounded structure's heap settles to within a few bytes per call; one entry per call is 50 bytes or more
MAX_BOUNDED_BYTES_PER_CALL = 8.0


#: batches measured after the warm-up; the least growth of them is the step's
NUM_WINDOWS = 3


#: frames kept per allocation: enough to reach ``step``'s frame from the allocation inside the structure
NUM_TRACE_FRAMES = 100


def retained_bytes_per_call(step: Callable[[int], object], num_calls: int = 2000) -> float:
    for i in range(num_calls):
        step(i)
    gc.collect()
    steps_only = [tracemalloc.Filter(True, step.__code__.co_filename, all_frames=True)]

    def traced_bytes() -> int:
        return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(steps_only).statistics("filename"))

    growth_bytes: list[int] = []
    tracemalloc.start(NUM_TRACE_FRAMES)
    try:
        for window in range(1, NUM_WINDOWS + 1):
            before = traced_bytes()
            for i in range(window * num_calls, (window + 1) * num_calls):
                step(i)
            gc.collect()
            growth_bytes.append(traced_bytes() - before)
    finally:
        tracemalloc.stop()
    return min(growth_bytes) / num_calls
