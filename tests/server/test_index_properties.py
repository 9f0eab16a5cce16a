"""TokenIndex against a brute-force matcher: the guarantee, real runs, namespaces, and linear work.

Small alphabets make long shared runs, many holders of one block and repeats inside one span common.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.server.index import TokenIndex, TokenMatch


def maximal_runs(q: list[int], src: tuple[int, ...], min_len: int) -> list[tuple[int, int, int]]:
    """Every maximal run (query start, query end, src start) of ``min_len`` or more tokens, all diagonals."""
    runs = []
    for diag in range(-len(src) + 1, len(q)):
        i = max(diag, 0)
        while i < len(q) and i - diag < len(src):
            if q[i] != src[i - diag]:
                i += 1
                continue
            start = i
            while i < len(q) and i - diag < len(src) and q[i] == src[i - diag]:
                i += 1
            if i - start >= min_len:
                runs.append((start, i, start - diag))
    return runs


def longest_shared(piece: list[int], spans: list[tuple[int, ...]]) -> int:
    """The longest run of ``piece`` found in any of ``spans`` (brute force)."""
    best = 0
    for src in spans:
        for start, end, _ in maximal_runs(piece, src, 1):
            best = max(best, end - start)
    return best


def is_real(m: TokenMatch, q: list[int], index: TokenIndex) -> bool:
    src = index.token_ids(m.span_id)
    return m.num_tokens > 0 and list(q[m.start:m.end]) == list(src[m.src_start:m.src_start + m.num_tokens])


def assert_runs_hold(index: TokenIndex, query: list[int], runs: list[TokenMatch], spans: dict[str, list[int]],
                     min_len: int) -> None:
    """Every run is real and every maximal shared run of ``min_len`` tokens or more with one of ``spans`` (span id ->
    its tokens) lies inside one of ``runs``: the matcher's guarantee, against brute force."""
    for m in runs:
        assert m.span_id in index and is_real(m, query, index), m
    for span_id, ids in spans.items():
        for start, end, src_start in maximal_runs(query, tuple(ids), min_len):
            assert any(m.start <= start and end <= m.end for m in runs), (span_id, start, end, src_start, runs)


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=40)


@st.composite
def scenes(draw):
    """A block length, spans in two namespaces (some are copies or edits of others: many holders) and a query."""
    block_len = draw(st.integers(1, 4))
    alphabet = draw(st.integers(2, 4))
    sym = st.integers(0, alphabet - 1)
    spans: list[tuple[str, list[int]]] = []
    for _ in range(draw(st.integers(1, 12))):
        if spans and draw(st.booleans()):  # a copy of an earlier span, cut or edited: shares its blocks
            base = list(draw(st.sampled_from(spans))[1])
            cut = draw(st.integers(0, len(base)))
            ids = draw(st.lists(sym, max_size=6)) + base[cut:] + base[:cut] + draw(st.lists(sym, max_size=6))
        else:
            ids = draw(st.lists(sym, min_size=0, max_size=40))
        spans.append((draw(st.sampled_from(["a", "b"])), ids))
    query = draw(st.lists(sym, min_size=0, max_size=60))
    if spans and draw(st.booleans()):  # quote a span inside the query
        _, ids = draw(st.sampled_from(spans))
        at = draw(st.integers(0, len(query)))
        query = query[:at] + ids + query[at:]
    return block_len, spans, query


def draw_covered(data, query: list[int]) -> list[tuple[int, int]]:
    """None, or one prompt range ``find`` is told is taken already."""
    if not query or not data.draw(st.booleans()):
        return []
    a = data.draw(st.integers(0, len(query)))
    return [(a, data.draw(st.integers(a, len(query))))]


def build(block_len: int, spans: list[tuple[str, list[int]]]) -> TokenIndex:
    index = TokenIndex(block_len=block_len)
    for k, (namespace, ids) in enumerate(spans):
        index.add(f"s{k}", ids, namespace)
    return index


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes(), st.sampled_from(["longest", "oldest"]))
def test_every_long_run_is_inside_a_candidate_and_candidates_are_real(scene, prefer):
    block_len, spans, query = scene
    index = build(block_len, spans)
    runs = index.find_runs(query, "a", prefer)
    for m in runs:
        assert index._spans[m.span_id].namespace == "a"
        assert is_real(m, query, index), m
    guaranteed = 2 * block_len - 1
    for k, (namespace, ids) in enumerate(spans):
        if namespace != "a":
            continue
        for start, end, src_start in maximal_runs(query, tuple(ids), guaranteed):
            assert any(m.start <= start and end <= m.end for m in runs), (f"s{k}", start, end, src_start, runs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes(), st.integers(1, 6), st.sampled_from(["longest", "oldest"]), st.data())
def test_find_leaves_no_long_shared_stretch_free(scene, min_tokens, prefer, data):
    block_len, spans, query = scene
    index = build(block_len, spans)
    covered = draw_covered(data, query)
    found = index.find(query, "a", min_tokens, covered, prefer)
    taken = sorted([(m.start, m.end) for m in found] + covered)
    for m in found:
        assert is_real(m, query, index) and m.num_tokens >= min_tokens
        assert index._spans[m.span_id].namespace == "a"
        assert all(m.end <= a or b <= m.start for a, b in covered if b > a)
    for before, after in zip(found, found[1:], strict=False):
        assert before.end <= after.start  # non-overlapping, in query order
    # every free stretch shares less than max(min_tokens, 2B - 1) tokens with the namespace's spans
    free, cursor = [], 0
    for a, b in taken + [(len(query), len(query))]:
        if a > cursor:
            free.append(query[cursor:a])
        cursor = max(cursor, b)
    in_a = [tuple(ids) for namespace, ids in spans if namespace == "a"]
    bound = max(min_tokens, 2 * block_len - 1)
    for piece in free:
        assert longest_shared(piece, in_a) < bound, (piece, found)


def test_a_run_in_an_older_span_is_found_however_many_newer_spans_hold_its_block():
    """Issue 54 point 7: the old index checked a block's 4 newest holders only."""
    block_len = 8
    run = list(range(100, 115))  # 15 tokens = 2B - 1: covers the old span's aligned block [8, 16)
    index = TokenIndex(block_len=block_len)
    index.add("old", [900] * 1 + list(range(93, 100)) + run[:] + [901])  # run at src 8..22: block [8, 16)
    for k in range(6):  # newer spans hold the same block, with different tokens around it
        index.add(f"new{k}", [950 + k] * 8 + run[:8] + [960 + k] * 8)
    query = [1, 2, 3] + run + [4]
    assert index.find(query, min_tokens=8) == [TokenMatch(3, 18, "old", 8)]
    assert index.find(query, min_tokens=8, prefer="oldest") == [TokenMatch(3, 18, "old", 8)]


def test_work_is_linear_on_identical_tokens():
    """Issue 54 point 6: each offset of n identical tokens re-extended its diagonal (quadratic). The work
    counter adds query offsets, groups and members checked, tokens compared and hash probes."""
    for prefer in ("longest", "oldest"):
        per_token = []
        for n in (1024, 4096, 16384):
            index = TokenIndex(block_len=16)
            index.add("all", [7] * n)
            index.add("short", [7] * 300)
            index.add("framed", [1, 2, 3] + [7] * 500)
            index.add("tail", [7] * 64 + [5])
            found = index.find([7] * n, min_tokens=16, prefer=prefer)
            assert found == [TokenMatch(0, n, "all", 0)]
            per_token.append(index.last_work / n)
        assert max(per_token) <= 30, (prefer, per_token)  # a fixed constant, whatever n
        assert per_token[-1] <= per_token[0] * 1.1, (prefer, per_token)


def test_work_does_not_grow_with_identical_holders():
    """Spans with the same tokens around a block are one member: a thousand copies cost what one does."""
    rng_ids = [(k * 7919) % 1000 for k in range(256)]
    work = []
    for copies in (1, 1000):
        index = TokenIndex(block_len=16)
        for k in range(copies):
            index.add(f"copy{k}", rng_ids)
        assert index.find([5] + rng_ids, min_tokens=16) == [TokenMatch(1, 257, f"copy{copies - 1}", 0)]
        work.append(index.last_work)
    assert work[1] == work[0], work


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(scenes(), st.integers(1, 3), st.sampled_from(["longest", "oldest"]), st.data())
def test_the_guarantee_holds_after_removals_and_re_adds(monkeypatch, scene, split_min, prefer, data):
    """Spans removed and stored again (the store evicts and agents repeat themselves), with groups filed by
    where their members leave the reference from a few members on: every long run with a live span is found, no
    run names a removed span, and once every span is gone the index holds nothing."""
    from kvrelay.server import index_splits

    monkeypatch.setattr(index_splits, "SPLIT_MIN_MEMBERS", split_min)
    block_len, spans, query = scene
    index = build(block_len, spans)
    live = {f"s{k}": (ns, ids) for k, (ns, ids) in enumerate(spans)}
    for span_id in data.draw(st.lists(st.sampled_from(sorted(live)), max_size=len(live), unique=True)):
        index.remove(span_id)
        ns, ids = live.pop(span_id)
        if data.draw(st.booleans()):  # stored again, under its id or a new one
            new_id = span_id if data.draw(st.booleans()) else f"{span_id}-again"
            index.add(new_id, ids, ns)
            live[new_id] = (ns, ids)
    runs = index.find_runs(query, "a", prefer)
    for m in runs:
        assert m.span_id in live and live[m.span_id][0] == "a", m
        assert is_real(m, query, index), m
    for span_id, (ns, ids) in live.items():
        if ns != "a":
            continue
        for start, end, _ in maximal_runs(query, tuple(ids), 2 * block_len - 1):
            assert any(m.start <= start and end <= m.end for m in runs), (span_id, start, end, runs)
    for span_id in list(live):
        index.remove(span_id)
    assert leftovers(index) == {}


def leftovers(obj: object, path: str = "index") -> dict[str, dict]:
    """The non-empty dicts an index keeps, through its lists and splits (ints are never tracked by the garbage
    collector, so a leak of them shows only here)."""
    from kvrelay.server.index_splits import Splits
    from kvrelay.server.int_lists import IntLists

    names = getattr(obj, "__slots__", None) or vars(obj)
    out: dict[str, dict] = {}
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, dict) and value:
            out[f"{path}.{name}"] = value
        elif isinstance(value, (IntLists, Splits)):
            out.update(leftovers(value, f"{path}.{name}"))
    return out
