"""TokenIndex: exact positions of shared runs on toy token lists (no torch, no model)."""

from __future__ import annotations

import random
import subprocess
import sys

from kvrelay.server.index import PolyHash, TokenIndex, TokenMatch


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_substring_hash_equals_direct_hash_at_every_range():
    rng = random.Random(0)
    ids = [rng.randrange(50000) for _ in range(60)]
    hasher = PolyHash()
    prefix = hasher.prefix(ids)
    for a in range(0, 60, 7):
        for b in range(a, 61, 5):
            assert hasher.sub(prefix, a, b) == hasher.sub(hasher.prefix(ids[a:b]), 0, b - a)
    assert PolyHash().base != PolyHash().base  # random per index: collisions cannot be crafted


def test_run_found_at_any_offset_and_extended_both_ways():
    idx = TokenIndex(block_len=4)
    span = [900, 901] + seq(100, 20) + [902]
    idx.add("s", span)
    query = [1, 2, 3, 4, 5] + seq(100, 20) + [7]  # the shared run sits at query offset 5, span offset 2
    assert idx.find(query, min_tokens=4) == [TokenMatch(5, 25, "s", 2)]
    # a piece shorter than the span, unaligned on both sides
    query2 = [7, 7, 7] + seq(103, 9) + [8]
    assert idx.find(query2, min_tokens=4) == [TokenMatch(3, 12, "s", 5)]


def test_runs_of_two_blocks_minus_one_are_always_found():
    rng = random.Random(1)
    span = [rng.randrange(1000, 2000) for _ in range(64)]
    idx = TokenIndex(block_len=8)
    idx.add("s", span)
    for src_start in range(0, 64 - 15):
        run = span[src_start : src_start + 15]
        query = [1, 2, 3] + run + [4]
        assert idx.find(query, min_tokens=8) == [TokenMatch(3, 18, "s", src_start)], src_start


def test_longest_non_overlapping_with_trimming():
    idx = TokenIndex(block_len=4)
    idx.add("long", seq(0, 30))
    idx.add("other", seq(20, 20))  # overlaps the end of "long" and continues
    query = seq(0, 40)
    # "long" [0, 30) is longest; "other" [20, 40) keeps its free piece [30, 40) at src offset 10
    assert idx.find(query, min_tokens=4) == [TokenMatch(0, 30, "long", 0), TokenMatch(30, 40, "other", 10)]
    # a covered prefix is skipped and the remaining piece keeps its source offset; it ranks by its own length
    # (18 free tokens), behind "other"'s 20
    assert idx.find(query, min_tokens=4, covered=[(0, 12)]) == [
        TokenMatch(12, 20, "long", 12), TokenMatch(20, 40, "other", 0)]
    # pieces under min_tokens are dropped
    assert idx.find(query, min_tokens=12) == [TokenMatch(0, 30, "long", 0)]


def test_two_runs_from_different_spans_in_one_prompt():
    idx = TokenIndex(block_len=4)
    idx.add("sys", seq(500, 12))
    idx.add("doc", seq(800, 16))
    query = seq(500, 12) + [1, 2] + seq(804, 8) + [3]
    assert idx.find(query, min_tokens=4) == [TokenMatch(0, 12, "sys", 0), TokenMatch(14, 22, "doc", 4)]


def test_namespaces_never_see_each_other():
    idx = TokenIndex(block_len=4)
    idx.add("a", seq(0, 12), namespace="tenant-a")
    assert idx.find(seq(0, 12), namespace="tenant-b", min_tokens=4) == []
    assert idx.find(seq(0, 12), namespace="tenant-a", min_tokens=4) == [TokenMatch(0, 12, "a", 0)]


def test_removed_spans_leave_the_index():
    idx = TokenIndex(block_len=4)
    idx.add("a", seq(0, 12))
    idx.add("b", seq(0, 12))
    idx.remove("b")
    assert idx.find(seq(0, 12), min_tokens=4) == [TokenMatch(0, 12, "a", 0)]
    idx.remove("a")
    idx.remove("a")  # unknown ids are ignored
    assert idx.find(seq(0, 12), min_tokens=4) == []
    assert not idx._groups and len(idx) == 0


def test_newest_span_wins_among_equals():
    idx = TokenIndex(block_len=4)
    idx.add("old", seq(0, 8))
    idx.add("new", seq(0, 8))
    assert idx.find([9] + seq(0, 8), min_tokens=4) == [TokenMatch(1, 9, "new", 0)]
    assert idx.find([9] + seq(0, 8), min_tokens=4, prefer="oldest") == [TokenMatch(1, 9, "old", 0)]


def test_no_torch_import():
    code = "import sys, kvrelay.server.index; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefer_oldest_takes_a_text_where_it_was_first_stored():
    idx = TokenIndex(block_len=4)
    idx.add("first", [900] + seq(100, 20) + [901])  # the text alone (e.g. the user's question)
    idx.add("later", [902] + seq(50, 3) + seq(100, 20) + seq(60, 2) + [903])  # the text inside a template
    query = [1] + seq(50, 3) + seq(100, 20) + seq(60, 2) + [2]
    assert idx.find(query, min_tokens=4) == [TokenMatch(1, 26, "later", 1)]
    assert idx.find(query, min_tokens=4, prefer="oldest") == [TokenMatch(4, 24, "first", 1)]
    # what the oldest does not hold is still filled from the others, where long enough
    assert idx.find(query, min_tokens=2, prefer="oldest") == [
        TokenMatch(1, 4, "later", 1), TokenMatch(4, 24, "first", 1), TokenMatch(24, 26, "later", 24)]


def test_a_candidate_is_settled_before_runs_that_start_after_it():
    """Candidates are settled in order of start, B offsets late: a run whose first aligned block sits B - 1
    tokens after its start must be checked before a run that starts later and ends as far, or it is taken
    for contained in that run."""
    idx = TokenIndex(block_len=4)
    idx.add("older", seq(12, 6))  # its block [12..15] at offset 0: the run [2, 8)
    idx.add("newer", seq(10, 8))  # its block [14..17] at offset 4 reaches back 3 tokens: the run [1, 8)
    query = [99] + seq(11, 7) + [90, 91, 92, 93]
    assert TokenMatch(1, 8, "newer", 1) in idx.find_runs(query, prefer="longest")
    assert idx.find_runs(query, prefer="oldest") == [TokenMatch(1, 8, "newer", 1), TokenMatch(2, 8, "older", 0)]


def test_repeats_one_token_longer_in_a_newer_span_are_not_taken_for_inside_the_older():
    """Spans that start with a repeated token share a group; a member's run on such text ends exactly where
    its repeats do, which drops the later members that end no further. One token further is a new run."""
    for extra in (0, 1, 5):
        idx = TokenIndex(block_len=4)
        idx.add("old", [7] * 10 + [5])
        idx.add("new", [7] * (10 + extra) + [6])
        query = [8] + [7] * 30
        oldest = idx.find_runs(query, prefer="oldest")
        assert TokenMatch(1, 11, "old", 0) in oldest
        assert (TokenMatch(1, 11 + extra, "new", 0) in oldest) == (extra > 0), (extra, oldest)
        longest = idx.find_runs(query, prefer="longest")  # the newer span wins among equals
        assert TokenMatch(1, 11 + extra, "new", 0) in longest, (extra, longest)
        assert TokenMatch(1, 11, "old", 0) not in longest, (extra, longest)
