"""The exact-prefix lookup the store and the tier's announcements share, on hand-made token ids."""

from kvrelay.cache.prefix_index import PrefixIndex, PrefixMatch
from kvrelay.cache.store import block_hashes

BLOCK = 4


def _index(spans: dict[str, list[int]], seed: str = "fp") -> PrefixIndex:
    index = PrefixIndex(BLOCK)
    for span_id, ids in spans.items():
        index.add(span_id, block_hashes(seed, ids, BLOCK))
    return index


def _longest(index: PrefixIndex, spans: dict[str, list[int]], query: list[int], seed: str = "fp"):
    return index.longest(block_hashes(seed, query, BLOCK), query, lambda span_id: spans[span_id])


def test_the_match_is_exact_past_the_last_shared_block():
    spans = {"a": list(range(10)), "b": list(range(6)) + [99, 98]}
    index = _index(spans)
    # both share block 0 and block 1's first two tokens; a goes on to token 9, b stops at 6
    assert _longest(index, spans, list(range(9)) + [50]) == PrefixMatch("a", 9)
    assert _longest(index, spans, list(range(6)) + [99, 0]) == PrefixMatch("b", 7)
    # a query shorter than both spans: the whole query, from the most recently added of the two
    assert _longest(index, spans, list(range(5))) == PrefixMatch("b", 5)


def test_no_shared_first_block_is_no_match_and_other_seeds_never_match():
    spans = {"a": list(range(8))}
    index = _index(spans)
    assert _longest(index, spans, [0, 1, 2, 7, 4, 5]) is None  # differs inside the first block
    assert _longest(index, spans, [0, 1, 2]) is None  # not one full block
    assert _longest(index, spans, list(range(8)), seed="other model or namespace") is None


def test_equal_matches_go_to_the_most_recently_added_and_removal_forgets():
    spans = {"old": list(range(8)), "new": list(range(8)), "short": list(range(4))}
    index = _index(spans)
    assert _longest(index, spans, list(range(8))) == PrefixMatch("new", 8)
    index.remove("new", block_hashes("fp", spans["new"], BLOCK))
    assert _longest(index, spans, list(range(8))) == PrefixMatch("old", 8)
    index.remove("old", block_hashes("fp", spans["old"], BLOCK))
    assert _longest(index, spans, list(range(8))) == PrefixMatch("short", 4)
    index.remove("short", block_hashes("fp", spans["short"], BLOCK))
    index.remove("short", block_hashes("fp", spans["short"], BLOCK))  # twice: nothing left to forget
    assert len(index) == 0 and _longest(index, spans, list(range(8))) is None
