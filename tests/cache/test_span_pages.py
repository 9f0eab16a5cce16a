"""Stored spans in pages of their own (cache.span_pages): one mapping per exported span, unmapped when it dies."""

import gc
import mmap
import weakref
from pathlib import Path

import pytest
import torch

from kvrelay.cache import span_pages
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.span_pages import MIN_OWN_PAGES_BYTES, copies_in_own_pages
from kvrelay.cache.store import KVStore
from kvrelay.model.config import ModelConfig
from tests.helpers import generate, publish, tiny_lm

# 8 layers x 4 KV heads x 64 dims x 4 bytes = 8 KiB of K per token: a 40-token span is 640 KiB of K and V
CFG = ModelConfig(family="llama", vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=8,
                  num_heads=4, num_kv_heads=4, head_dim=64, max_position_embeddings=256)


@pytest.fixture
def mappings(monkeypatch) -> list[weakref.ref]:
    """Weak references to every mapping ``copies_in_own_pages`` makes, in order."""
    made: list[weakref.ref] = []
    real = span_pages.map_anonymous

    def counted(num_bytes: int) -> mmap.mmap:
        pages = real(num_bytes)
        made.append(weakref.ref(pages))
        return pages

    monkeypatch.setattr(span_pages, "map_anonymous", counted)
    return made


def filled_cache(num_tokens: int) -> SequenceKV:
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=num_tokens)
    cache.k[:, :, :num_tokens].normal_(generator=torch.Generator().manual_seed(0))
    cache.v[:, :, :num_tokens].normal_(generator=torch.Generator().manual_seed(1))
    cache.length = num_tokens
    return cache


def base_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_export_copies_k_v_and_hidden_into_one_mapping(mappings):
    cache = filled_cache(48)
    hidden = {2: torch.randn(40, 32, dtype=torch.bfloat16), 5: torch.randn(40, 32, dtype=torch.bfloat16)}
    span = cache.export(4, 44, list(range(40)), "fp", hidden)
    assert len(mappings) == 1
    tensors = [span.k, span.v, *span.hidden.values()]
    assert len({base_address(t) for t in tensors}) == 1  # views of the one mapping
    assert all(t.is_contiguous() for t in tensors)
    assert torch.equal(span.k, cache.k[:, :, 4:44]) and torch.equal(span.v, cache.v[:, :, 4:44])
    assert span.hidden.keys() == hidden.keys()
    assert all(torch.equal(span.hidden[layer], hidden[layer]) for layer in hidden)
    assert span.hidden[2].dtype == torch.bfloat16
    cache.k.zero_()  # a copy: the sequence cache may be reused or freed
    assert span.k.abs().sum() > 0


def test_mapping_is_released_with_the_span_evicted_from_a_store(mappings):
    store = KVStore(budget_bytes=1 << 20)  # fits one 40-token span (640 KiB), not two
    store.put("a", filled_cache(40).export(0, 40, list(range(40)), "fp"))
    assert mappings[0]() is not None
    store.put("b", filled_cache(40).export(0, 40, list(range(100, 140)), "fp"))  # evicts "a"
    gc.collect()
    assert "a" not in store and mappings[0]() is None  # unmapped: its pages went back to the OS
    assert mappings[1]() is not None


def test_a_view_of_the_span_keeps_its_mapping():
    copies = copies_in_own_pages([torch.ones(MIN_OWN_PAGES_BYTES // 4), torch.arange(10)])
    k_rows = copies[0][:5]
    del copies
    gc.collect()
    assert k_rows.tolist() == [1.0] * 5  # still mapped: read after the span's other tensors died


def test_small_spans_stay_on_the_heap(mappings):
    span = filled_cache(4).export(0, 4, list(range(4)), "fp")  # 64 KiB of K and V, under MIN_OWN_PAGES_BYTES
    assert span.nbytes < MIN_OWN_PAGES_BYTES
    assert mappings == [] and base_address(span.k) != base_address(span.v)


def test_a_failed_mapping_falls_back_to_the_heap(monkeypatch):
    def refused(num_bytes: int) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")  # vm.max_map_count reached

    monkeypatch.setattr(span_pages, "map_anonymous", refused)
    cache = filled_cache(40)
    span = cache.export(0, 40, list(range(40)), "fp")
    assert torch.equal(span.k, cache.k[:, :, :40]) and base_address(span.k) != base_address(span.v)


def test_engine_publish_stores_the_span_in_its_own_mapping(mappings, monkeypatch):
    """The server's path: every span it stores is published by the engine."""
    monkeypatch.setattr(span_pages, "MIN_OWN_PAGES_BYTES", 0)  # the tiny model's spans are a few KiB
    lm = tiny_lm()
    store = KVStore(budget_bytes=1 << 30)
    span = publish(store, "a", generate(lm, list(range(1, 20)), keep_cache=True), lm)
    assert len(mappings) == 1 and store.get("a") is span
    assert base_address(span.k) == base_address(span.v)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the mapping's flags from /proc (Linux)")
def test_the_mapping_is_private():
    """Shared memory (an anonymous mmap.mmap's default) would let a forked child write into the parent's spans."""
    copy = copies_in_own_pages([torch.ones(MIN_OWN_PAGES_BYTES // 4)])[0]
    address = base_address(copy)
    for line in Path("/proc/self/maps").read_text().splitlines():
        bounds, perms = line.split()[:2]
        low, high = (int(x, 16) for x in bounds.split("-"))
        if low <= address < high:
            assert perms == "rw-p"
            return
    pytest.fail(f"no mapping holds address {address:#x}")
