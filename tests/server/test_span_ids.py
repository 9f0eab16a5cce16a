"""Span ids say nothing about other tenants: random per span, not a count shared by every namespace."""

from __future__ import annotations

import re

from kvrelay.cache.store import KVStore
from kvrelay.server.catalog import _OUTPUT_SPAN, SpanCatalog


def test_span_ids_are_random_per_span_and_still_say_where_the_output_starts():
    catalog = SpanCatalog(KVStore(1 << 20), "fp")
    ids = [catalog.new_span_id(7) for _ in range(64)]
    assert len(set(ids)) == len(ids)
    origin = {i.split("-")[1] for i in ids}
    assert len(origin) == 1  # one process, one origin (replicas on a shared tier differ by it)
    # the part that differs from span to span: 16 random hex digits, not a counter whose gaps count others' spans
    parts = [i.split("-")[2] for i in ids]
    assert all(re.fullmatch(r"[0-9a-f]{16}", p) for p in parts)
    assert sorted(parts) != parts or sorted(parts, reverse=True) != parts
    assert all(int(_OUTPUT_SPAN.match(i)[1]) == 7 for i in ids)  # a completion's span: its output starts at 7
    assert _OUTPUT_SPAN.match(catalog.new_span_id()) is None
