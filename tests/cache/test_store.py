"""The store's bookkeeping on toy spans: exact eviction order, pins, budget, bytes, prefix lookup."""

from dataclasses import dataclass

import pytest

from kvrelay.cache.store import KVStore, block_hashes
from kvrelay.errors import KvRelayError, StoreFullError


@dataclass
class Toy:
    nbytes: int
    token_ids: tuple = ()
    start_pos: int = 0
    fingerprint: str = "fp"


def test_lru_eviction_order_is_exact():
    s = KVStore(budget_bytes=100)
    for name in "abcd":
        s.put(name, Toy(25))
    s.get("a")  # a becomes most recent: b is now the oldest
    assert s.put("e", Toy(25)) == ["b"]
    assert s.put("f", Toy(40)) == ["c", "d"]
    assert s.ids() == ["a", "e", "f"]
    assert s.num_evicted == 3
    assert s.used_bytes == 90


def test_pins_are_never_evicted_and_refcounted():
    s = KVStore(budget_bytes=100)
    s.put("a", Toy(30), pin=True)
    s.put("b", Toy(30))
    s.put("c", Toy(30))
    s.pin("b")
    s.pin("b")
    assert s.put("d", Toy(30)) == ["c"]  # a and b pinned: c goes though a and b are older
    s.unpin("b")
    assert s.is_pinned("b")  # still one pin left
    with pytest.raises(StoreFullError, match="needs 50 bytes"):
        s.put("e", Toy(50))
    assert s.ids() == ["a", "b", "d"]  # a failed put evicts nothing
    s.unpin("b")
    assert s.put("e", Toy(50)) == ["b", "d"]
    with pytest.raises(KvRelayError, match="not pinned"):
        s.unpin("e")


def test_budget_never_exceeded_and_bytes_exact():
    s = KVStore(budget_bytes=1000)
    sizes = [137, 411, 59, 300, 222, 91, 500, 13, 999, 1]
    for i, n in enumerate(sizes):
        s.put(f"s{i}", Toy(n))
        assert s.used_bytes <= 1000
        assert s.used_bytes == sum(s._records[k].nbytes for k in s.ids())
    assert s.peak_bytes <= 1000
    assert s.ids() == ["s8", "s9"] and s.used_bytes == 1000


def test_replacing_a_span_keeps_its_pins_and_recounts_bytes():
    s = KVStore(budget_bytes=100)
    s.put("a", Toy(60), pin=True)
    s.put("a", Toy(90))
    assert s.used_bytes == 90 and s.is_pinned("a")


def test_oversized_span_is_refused():
    with pytest.raises(StoreFullError):
        KVStore(budget_bytes=10).put("x", Toy(11))


def test_prefix_match_is_exact_past_block_boundaries():
    s = KVStore(budget_bytes=10_000, block_len=4)
    s.put("a", Toy(10, tuple(range(10))))
    s.put("b", Toy(10, (0, 1, 2, 3, 4, 5, 99, 98, 97)))
    m = s.match_prefix("fp", list(range(20)))
    assert (m.span_id, m.num_tokens) == ("a", 10)
    m = s.match_prefix("fp", [0, 1, 2, 3, 4, 5, 99, 7])
    assert (m.span_id, m.num_tokens) == ("b", 7)
    m = s.match_prefix("fp", [0, 1, 2, 3, 4, 5])  # query shorter than the spans
    assert m.num_tokens == 6
    assert s.match_prefix("fp", [0, 1, 2, 9, 4]) is None  # first block differs
    assert s.match_prefix("other-model", list(range(10))) is None


def test_prefix_index_forgets_evicted_and_offset_spans():
    s = KVStore(budget_bytes=20, block_len=2)
    s.put("a", Toy(10, (1, 2, 3, 4)))
    s.put("mid", Toy(10, (1, 2, 3, 4), start_pos=7))  # not at position 0: never a prefix
    assert s.match_prefix("fp", [1, 2, 3, 4]).span_id == "a"
    s.put("c", Toy(10, (5, 6)))
    assert "a" not in s and s.match_prefix("fp", [1, 2, 3, 4]) is None
    (kept,) = block_hashes("fp", (5, 6), 2)
    assert len(s._prefixes) == 1 and kept in s._prefixes


def test_block_hashes_chain():
    h1 = block_hashes("fp", [1, 2, 3, 4], 2)
    h2 = block_hashes("fp", [9, 9, 3, 4], 2)
    assert len(h1) == 2 and h1[1] != h2[1]  # same second block, different prefix
    assert block_hashes("fp", [1, 2, 3], 2) == h1[:1]


def test_bad_budget():
    with pytest.raises(KvRelayError, match="budget"):
        KVStore(budget_bytes=0)
