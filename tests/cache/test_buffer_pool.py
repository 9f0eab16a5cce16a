"""The sequence K/V buffer pool: reuse only what nothing references, and a bound on idle memory."""

import torch

from kvrelay.cache.kv import BUFFERS, BufferPool, SequenceKV
from tests.cache.test_kv import CFG

CPU = torch.device("cpu")


def test_a_released_buffer_is_reused():
    pool = BufferPool()
    a = pool.take((4, 8), torch.float32, CPU)
    ptr = a.data_ptr()
    del a
    assert pool.take((2, 8), torch.float32, CPU).data_ptr() == ptr  # fits: reused, not allocated


def test_a_buffer_with_a_live_view_is_never_handed_out():
    pool = BufferPool()
    a = pool.take((4, 8), torch.float32, CPU)
    row = a[1]  # e.g. K/V a method kept without copying
    ptr = a.untyped_storage().data_ptr()
    del a
    b = pool.take((4, 8), torch.float32, CPU)
    assert b.untyped_storage().data_ptr() != ptr
    b.fill_(7.0)
    assert not bool((row == 7.0).any())


def test_a_smaller_or_other_dtype_buffer_is_not_reused():
    pool = BufferPool()
    small = pool.take((2, 8), torch.float32, CPU)
    ptr = small.data_ptr()
    del small
    assert pool.take((4, 8), torch.float32, CPU).data_ptr() != ptr
    assert pool.take((2, 8), torch.float64, CPU).data_ptr() != ptr


def test_idle_buffers_beyond_the_bound_are_dropped():
    pool = BufferPool(max_idle_bytes=3 * 64 * 4)
    held = [pool.take((64,), torch.float32, CPU) for _ in range(6)]
    ptrs = [t.data_ptr() for t in held]
    del held
    taken = pool.take((1,), torch.float32, CPU)  # reuses one idle buffer and trims the rest to the bound
    idle = [b for b in pool._buffers if BufferPool._idle(b)]
    assert sum(b.numel() * b.element_size() for b in idle) <= pool.max_idle_bytes
    assert len(pool._buffers) == 4  # the one taken + 3 idle within the bound
    assert {b.data_ptr() for b in pool._buffers} <= set(ptrs) and taken.data_ptr() in ptrs


def test_live_caches_never_share_memory_and_a_dropped_one_is_reused():
    caches = [SequenceKV(CFG, torch.float32, "cpu", capacity=16) for _ in range(3)]
    storages = {t.untyped_storage().data_ptr() for c in caches for t in (c.k, c.v)}
    assert len(storages) == 6
    freed = caches.pop().k.untyped_storage().data_ptr()
    again = SequenceKV(CFG, torch.float32, "cpu", capacity=16)
    assert freed in {again.k.untyped_storage().data_ptr(), again.v.untyped_storage().data_ptr()}
    assert len(storages | {t.untyped_storage().data_ptr() for t in (again.k, again.v)}) == 6


def test_a_buffer_first_used_under_inference_mode_is_writable_outside_it():
    BUFFERS.clear()
    with torch.inference_mode():
        first = SequenceKV(CFG, torch.float32, "cpu", capacity=16)
        ptrs = {first.k.untyped_storage().data_ptr(), first.v.untyped_storage().data_ptr()}
        del first
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=16)
    assert cache.k.untyped_storage().data_ptr() in ptrs  # the inference-mode cache's buffer, reused
    cache.k[:, :, :2] = 1.0  # would raise "Inplace update to inference tensor outside InferenceMode"
