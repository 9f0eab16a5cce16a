"""A stored span's tensors in one anonymous memory mapping of their own, returned to the OS when the span dies.

Why: a span store churns through tensors of many sizes that live until evicted. Copied into malloc'd memory (what
``Tensor.clone`` gets on the CPU), they land in glibc's arena heaps once glibc's dynamic mmap threshold has risen
past their size (it rises to the size of any mmap'd block freed, up to 32 MiB), and a freed span leaves a hole that
later spans of other sizes only partly refill: a server's RSS then keeps rising while its store stays at its
budget (measured in docs/serving.md, "Memory over weeks"). A mapping per span has no holes: evicting the span
unmaps exactly its pages.

Only the span's tensors move here, not the forward's transient activations: a fixed ``M_MMAP_THRESHOLD`` would map
those too, and the page faults of every fresh mapping made prefill measurably slower (same section).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

#: spans smaller than this stay on the heap: glibc's own default mmap threshold, below which a mapping's syscall and
#: page-table entry cost more than the little a small hole can waste
MIN_OWN_PAGES_BYTES = 128 << 10

#: each tensor starts on a boundary this wide in the mapping (any dtype's element size divides it; SIMD loads like it)
ALIGN_BYTES = 64


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def map_anonymous(num_bytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``num_bytes`` (a seam: tests count the calls). Private: the default for an
    anonymous ``mmap.mmap`` is shared memory, which a forked child would write through."""
    return mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE)


def copies_in_own_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors``, all views of one fresh anonymous mapping (unmapped once none is referenced).

    Falls back to ``clone`` (the heap) for tensors not on the CPU, for a total under ``MIN_OWN_PAGES_BYTES``, and
    when the mapping cannot be made (``vm.max_map_count`` reached, say): the copies are then just as correct.
    """
    offsets, total_bytes = [], 0
    for t in tensors:
        offsets.append(total_bytes)
        total_bytes += _aligned(t.numel() * t.element_size())
    if total_bytes < MIN_OWN_PAGES_BYTES or any(t.device.type != "cpu" for t in tensors):
        return [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    try:
        pages = map_anonymous(total_bytes)
    except OSError:
        return [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    flat = torch.frombuffer(pages, dtype=torch.uint8)  # the storage holds ``pages``: munmap when its last view goes
    out = []
    for t, offset in zip(tensors, offsets, strict=True):
        dst = flat[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out.append(dst)
    return out
