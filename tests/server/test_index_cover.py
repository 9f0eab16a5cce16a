"""``find_runs``'s cover mode (``cover_tokens``): the windows of repeated text that ``find`` can take nothing from
are left out, and ``find`` takes exactly what it takes from the full list of runs."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.server.index import TokenIndex
from tests.server.test_index_periodic import build_periodic, periodic_scenes, periodic_spans
from tests.server.test_index_properties import build, draw_covered, scenes


def same_choice(index: TokenIndex, query: list[int], namespace: str, min_tokens: int, covered: list,
                prefer: str) -> list:
    full = index.find_runs(query, namespace, prefer)
    cover = index.find_runs(query, namespace, prefer, min_tokens)
    # (not a subset: a run inside a window left out is no longer left out for being inside it)
    chosen = index.choose(query, full, min_tokens, covered, prefer)
    assert index.choose(query, cover, min_tokens, covered, prefer) == chosen
    assert index.find(query, namespace, min_tokens, covered, prefer) == chosen
    return chosen


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes(), st.integers(1, 8), st.sampled_from(["longest", "oldest"]), st.data())
def test_find_is_the_same_with_and_without_cover_on_random_text(scene, min_tokens, prefer, data):
    block_len, spans, query = scene
    index = build(block_len, spans)
    covered = draw_covered(data, query)
    same_choice(index, query, "a", min_tokens, covered, prefer)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(periodic_scenes(), st.integers(1, 12), st.sampled_from(["longest", "oldest"]), st.data())
def test_find_is_the_same_with_and_without_cover_on_periodic_text(scene, min_tokens, prefer, data):
    block_len, spans, query, removed = scene
    index = build_periodic(block_len, spans, removed)
    covered = []
    for _ in range(data.draw(st.integers(0, 2)) if query else 0):  # ranges taken first shift the tiling
        a = data.draw(st.integers(0, len(query)))
        covered.append((a, data.draw(st.integers(a, min(a + 8, len(query))))))
    same_choice(index, query, "", min_tokens, covered, prefer)


def test_cover_leaves_out_the_windows_of_spans_whose_repeats_outreach_older_ones():
    """On a prompt of one repeated token, every span whose run of it is longer than every older span's gave a
    window at every offset (``prefer="oldest"``), though ``find`` takes only the oldest span's; with cover, about
    one window an offset is left, and ``find`` takes the same runs."""
    for period in (1, 3):
        unit, spans = periodic_spans(period, 300, "own", seed=period)
        index = TokenIndex(block_len=16)
        for k, ids in enumerate(spans):
            index.add(f"s{k}", ids)
        n = 4096
        query = (unit * n)[:n]
        full = index.find_runs(query, prefer="oldest")
        cover = index.find_runs(query, prefer="oldest", cover_tokens=16)
        assert len(full) >= 2 * n // period, (period, len(full))  # more than one span gives windows throughout
        assert len(cover) <= n // period + 600, (period, len(full), len(cover))  # one, plus two per span at most
        same_choice(index, query, "", 16, [], "oldest")
