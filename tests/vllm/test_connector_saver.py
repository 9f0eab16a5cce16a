"""The connector's saves off vLLM's step: the K/V is read in the caller's thread before its request is reported
done (vLLM then frees and reuses the blocks), and stored in the saver's thread. No vLLM: a CPU paged KV as
vLLM's, on the random tiny model's shape."""

from __future__ import annotations

import threading

import pytest
import torch

from kvrelay.model.config import ModelConfig
from kvrelay.tier.backends.base import span_key
from kvrelay.vllm.hub import ConnectorConfig, Hub
from kvrelay.vllm.paged import PagedKV
from kvrelay.vllm.saver import BackgroundSaver
from kvrelay.vllm.worker import SaveJob, WorkerSide
from kvrelay.weights.loader import load_model

NEEDS_VLLM = False  # runs in the main venv
BLOCK = 16


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return load_model("random:tiny").config


def filled_paged(cfg: ModelConfig, num_tokens: int, block_ids: list[int]) -> tuple[PagedKV, list[torch.Tensor],
                                                                                     torch.Tensor, torch.Tensor]:
    layers = [torch.zeros(8, cfg.num_kv_heads, BLOCK, 2 * cfg.head_dim) for _ in range(cfg.num_layers)]
    paged = PagedKV(layers, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(cfg.num_layers, cfg.num_kv_heads, num_tokens, cfg.head_dim, generator=gen)
    v = torch.randn(k.shape, generator=gen)
    paged.write(paged.slots(block_ids, 0, num_tokens), k, v)
    return paged, layers, k, v


def test_a_save_is_read_before_its_blocks_are_released_and_stored_off_the_callers_thread(config):
    paged, layers, k, v = filled_paged(config, 40, [5, 2, 7])
    hub = Hub(ConnectorConfig(), "fp-test")
    hub.catalog.index.add("span-a", list(range(40)), "s1")
    saver = BackgroundSaver(WorkerSide(hub, paged, config, None))
    try:
        with hub.lock:  # the store needs the hub's lock: held here, a store in the saver's thread cannot finish
            saver.submit(SaveJob("req-1", "span-a", "s1", list(range(40)), [5, 2, 7]))
            assert saver.take_read() == {"req-1"}  # its blocks go back to vLLM
            assert saver.take_read() == set()
            # stored off this thread: in this one the lock (reentrant) would not have stopped it
            assert not hub.store.contains("span-a", "s1")
            for layer in layers:  # vLLM reuses the freed blocks for another request
                layer.fill_(7.0)
        saver.wait_stored("s1", "span-a")
        span = hub.store.get("span-a", "s1")
        assert span.token_ids == tuple(range(40))
        assert torch.equal(span.k, k) and torch.equal(span.v, v)  # what the blocks held when they were released
        assert hub.catalog.index.find(list(range(40)), "s1", 16)
        assert saver.worker.take_report() == ([("s1", "span-a")], [])
    finally:
        saver.close()


def test_a_save_that_cannot_be_read_still_releases_its_blocks_and_is_forgotten(config):
    paged, _, _, _ = filled_paged(config, 20, [0, 1])
    hub = Hub(ConnectorConfig(), "fp-test")
    hub.catalog.index.add("span-b", list(range(40)), "s1")
    saver = BackgroundSaver(WorkerSide(hub, paged, config, None))
    try:
        saver.submit(SaveJob("req-2", "span-b", "s1", list(range(40)), [0, 99, 1]))  # block 99 is not there
        assert saver.take_read() == {"req-2"}
        saver.wait_stored("s1", "span-b")
        assert not hub.store.contains("span-b", "s1") and not hub.catalog.index.find(list(range(40)), "s1", 16)
        assert saver.worker.take_report() == ([], [("s1", "span-b")])
    finally:
        saver.close()


def test_a_copy_of_a_requests_blocks_reads_as_the_request(config):
    """vLLM's scheduler block may hold several of the kernel's: the copy keeps them in the request's order."""
    gen = torch.Generator().manual_seed(1)
    layers = [torch.randn(12, config.num_kv_heads, BLOCK, 2 * config.head_dim, generator=gen)
              for _ in range(config.num_layers)]
    for layout in ("transposed", "plain"):
        paged = PagedKV(layers, 2 * BLOCK, config.num_kv_heads, config.head_dim, layout)  # 2 kernel blocks each
        copy = paged.copy_blocks([4, 1, 3], 70)
        assert copy.layers[0].shape[0] == 6  # 70 positions: 3 scheduler blocks, 6 kernel blocks
        expected = paged.read(paged.slots([4, 1, 3], 0, 70))
        got = copy.read(copy.slots([0, 1, 2], 0, 70))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        for num_tokens in (70, 64, 96, 1):  # a last block part full, whole blocks, a last kernel block part full
            fast, slow = copy.read_copied(num_tokens), copy.read(copy.slots([0, 1, 2], 0, num_tokens))
            assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), (layout, num_tokens)
            assert fast[0].is_contiguous() and fast[0].shape == (config.num_layers, config.num_kv_heads, num_tokens,
                                                                  config.head_dim)


class PausedTier:
    """A shared tier backend whose span writes wait until ``go`` is set (``entered`` says one is waiting)."""

    def __init__(self, backend) -> None:
        self.backend, self.url = backend, backend.url
        self.entered, self.go = threading.Event(), threading.Event()
        self.written: list[str] = []

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        self.entered.set()
        assert self.go.wait(60), "the test never let the tier write go on"
        self.backend.put(key, value, meta)
        self.written.append(key)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


def test_a_saves_shared_tier_write_holds_no_lock_the_scheduler_side_matches_under(config, tmp_path):
    paged, _, k, _ = filled_paged(config, 40, [5, 2, 7])
    hub = Hub(ConnectorConfig(store=f"disk:{tmp_path}"), "fp-test")
    tier = hub.store.backend = PausedTier(hub.store.backend)
    hub.catalog.index.add("span-c", list(range(40)), "s1")
    saver = BackgroundSaver(WorkerSide(hub, paged, config, None))
    try:
        saver.submit(SaveJob("req-3", "span-c", "s1", list(range(40)), [5, 2, 7]))
        assert tier.entered.wait(60)  # the saver's thread is inside the tier's write, paused there
        # the scheduler side's locks are free meanwhile: its matching (and polling of the tier) goes on
        assert hub.lock.acquire(blocking=False), "the hub's lock is held across the tier write"
        try:
            assert hub.catalog._lock.acquire(blocking=False), "the catalog's lock is held across the tier write"
            hub.catalog._lock.release()
            assert hub.catalog.index.find(list(range(40)), "s1", 16)
        finally:
            hub.lock.release()
        assert torch.equal(hub.store.get("span-c", "s1").k, k)  # in memory already: a load here finds it ...
        waited = threading.Event()
        threading.Thread(target=lambda: (saver.wait_stored("s1", "span-c"), waited.set()), daemon=True).start()
        assert waited.wait(60), "a load waits for the shared tier's write"  # ... and need not wait for the tier
        assert not tier.written
        tier.go.set()
        saver.close()  # the saver's thread done: the tier written
        assert tier.written == [span_key("s1", "fp-test", "span-c")]  # then written through, once
        assert saver.worker.take_report() == ([("s1", "span-c")], [])
    finally:
        tier.go.set()
        saver.close()
