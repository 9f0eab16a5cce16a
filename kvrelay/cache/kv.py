"""Per-sequence KV cache and stored spans (the tensors; the store's bookkeeping is in store.py).

A sequence cache holds one slot per position: slot ``p`` holds the K/V of the token at position
``p``. Capacity grows by doubling, so appending n tokens one at a time copies O(n) in total.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from kvrelay.cache.refs import SpanRef, SplitPlans, attend_split
from kvrelay.cache.span_pages import copies_in_own_pages
from kvrelay.errors import ScheduleError
from kvrelay.model.config import ModelConfig
from kvrelay.model.layers import attention
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.split_attention import attention_parts


@dataclass
class StoredSpan:
    """KV of a contiguous run of tokens as computed in some context, ready to be reused elsewhere."""

    token_ids: tuple[int, ...]
    start_pos: int  # original position of the first token (keys are rotated for start_pos + i)
    k: torch.Tensor  # [num_layers, num_kv_heads, n, head_dim] post-RoPE
    v: torch.Tensor  # [num_layers, num_kv_heads, n, head_dim]
    fingerprint: str
    # layer -> [n - hidden_from, hidden]: that layer's input for tokens [hidden_from, n) (e.g. only
    # the decoded output, when the prompt's rows were not all computed)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_from: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.k.shape != self.v.shape or self.k.shape[2] != n:
            raise ValueError(f"span K/V shapes {tuple(self.k.shape)}/{tuple(self.v.shape)} do not match {n} tokens")
        for layer, h in self.hidden.items():
            if h.shape[0] != n - self.hidden_from:
                raise ValueError(f"span hidden state at layer {layer} has {h.shape[0]} rows, "
                                 f"expected {n - self.hidden_from} (tokens {self.hidden_from}..{n})")

    def hidden_rows(self, layer: int, start: int, end: int) -> torch.Tensor | None:
        """Layer input of span tokens [start, end), or None where not carried."""
        h = self.hidden.get(layer)
        if h is None or start < self.hidden_from:
            return None
        return h[start - self.hidden_from : end - self.hidden_from]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v, *self.hidden.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class BufferPool:
    """Sequence K/V buffers kept for reuse once nothing references them, on the CPU.

    A fresh buffer is backed by the OS on first touch: loading 2,093 reused tokens into a new cache
    spent more time in page faults than in the copy (benchmarks: loads). A buffer is reused only
    when no tensor or view still points at its storage, so reuse can never alias live K/V; idle
    buffers beyond ``max_idle_bytes`` are dropped, largest first. (CUDA has its own caching allocator.)
    """

    def __init__(self, max_idle_bytes: int = 512 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._buffers: list[torch.Tensor] = []  # flat base tensors, in use or idle
        self._lock = threading.Lock()

    @staticmethod
    def _idle(buf: torch.Tensor) -> bool:
        # references to the storage: ``buf`` itself, the temporary storage object, and every live view
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``: a view of an idle buffer that fits, else a new one."""
        numel = math.prod(shape)
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        # normal tensors: one made under inference mode could not be written outside it later
        with self._lock, torch.inference_mode(False):
            idle = [b for b in self._buffers if self._idle(b)]
            fits = [b for b in idle if b.dtype == dtype and b.numel() >= numel]
            buf = min(fits, key=torch.Tensor.numel) if fits else torch.empty(numel, dtype=dtype)
            if not fits:
                self._buffers.append(buf)
            budget = self.max_idle_bytes  # idle buffers kept smallest first; those past the budget dropped
            dropped = {id(b) for b in sorted(idle, key=torch.Tensor.numel) if b is not buf
                       and (budget := budget - b.nbytes) < 0}
            self._buffers = [b for b in self._buffers if id(b) not in dropped]
            return buf[:numel].view(shape)

    def clear(self) -> None:
        self._buffers = []


BUFFERS = BufferPool()


# A loaded span is read in place by attention from this many tokens on: each span read in place costs every
# layer a part of split attention (a kernel call, its share of the merge, the queries rotated back when
# moved), ~30-60 us on this project's 2-core CPU whatever the span's length, while copying costs ~0.06-0.09 us
# a token and layer (~0.2 moved, the keys rotated). Measured both ways: gsm8k-chain3's spans (60-190 tokens)
# lose ~8 ms a call read in place, copy-agents:5's (409-1,684) gain up to ~5 ms. Shorter spans are copied
# whole when loaded (copied a layer at a time instead, the per-layer calls cost ~2 ms more on a gsm8k-chain3
# call than they saved).
IN_PLACE_MIN_TOKENS = 256


class SequenceKV:
    """The K/V of one sequence, by position, for every layer.

    On the CPU a long loaded span is not copied: its positions are read where the store holds them
    (``cache.refs``) wherever the forward attends through ``attend``, and a layer's rows are copied into
    the cache only when something writes over them there, or reads that layer otherwise (``kv``,
    ``gather``, a decode step). A short span is copied when loaded. ``k``, ``v`` and ``export`` copy
    every layer first, so nothing outside this class sees a loaded row missing.
    """

    # loaded spans read in place (their index is the id in ``_ref_at``); a subclass without loads keeps these
    _refs: tuple[SpanRef, ...] = ()
    _ref_at: torch.Tensor | None = None  # int32 [capacity]: the ref reading each position, -1 for none
    _plans: SplitPlans | None = None  # the split attention's plans, shared by the layers with the same mask
    _hit: tuple[torch.Tensor, list[int]] | None = None  # (slots, the refs they hit): see ``_refs_hit``

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 256) -> None:
        self.num_layers = config.num_layers
        self.shape_tail = (config.num_kv_heads, config.head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity = 0
        self.length = 0  # positions in use: [0, length)
        self.k = self.v = torch.empty(0)
        self.filled = torch.empty(0, dtype=torch.bool)
        self.ensure_capacity(max(1, capacity))

    def ensure_capacity(self, num_positions: int) -> None:
        if num_positions <= self.capacity:
            return
        new_cap = max(num_positions, 2 * self.capacity)
        h_kv, head_dim = self.shape_tail
        # Uninitialised is safe: attention reads only slots the schedule filled (``check_filled``).
        shape = (self.num_layers, h_kv, new_cap, head_dim)
        k, v = (BUFFERS.take(shape, self.dtype, self.device) for _ in range(2))
        filled = torch.zeros(self.num_layers, new_cap, dtype=torch.bool, device=self.device)
        if self.capacity:  # rows read in place stay so: only the cache's own rows move
            k[:, :, : self.capacity] = self._k
            v[:, :, : self.capacity] = self._v
            filled[:, : self.capacity] = self.filled
        if self._ref_at is not None:
            self._ref_at = torch.cat([self._ref_at, self._ref_at.new_full((new_cap - self.capacity,), -1)])
        self.k, self.v, self.filled, self.capacity = k, v, filled, new_cap

    @property
    def k(self) -> torch.Tensor:
        """Keys [num_layers, num_kv_heads, capacity, head_dim], every loaded row copied in."""
        self._flush_all()
        return self._k

    @k.setter
    def k(self, value: torch.Tensor) -> None:
        self._k = value

    @property
    def v(self) -> torch.Tensor:
        """Values, as ``k``."""
        self._flush_all()
        return self._v

    @v.setter
    def v(self, value: torch.Tensor) -> None:
        self._v = value

    def _copy_in(self, ref: SpanRef, layer: int) -> None:
        rows = slice(ref.dst_start, ref.dst_end)
        ref.copy_layer(layer, self._k[layer, :, rows], self._v[layer, :, rows])

    def _flush(self, layer: int) -> None:
        """Copy every loaded row of one layer still read in place into the cache."""
        for ref in self._refs:
            if layer in ref.layers:
                self._copy_in(ref, layer)

    def _flush_all(self) -> None:
        for layer in range(self.num_layers):
            self._flush(layer)

    def _in_place(self, layer: int) -> list[SpanRef]:
        return [ref for ref in self._refs if layer in ref.layers]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_kv_heads, n, head_dim] for positions ``slots`` ([n])."""
        self._copy_on_write(layer, slots)
        self._k[layer].index_copy_(1, slots, k)
        self._v[layer].index_copy_(1, slots, v)
        self.filled[layer].index_fill_(0, slots, True)

    def add(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add k, v ([num_kv_heads, n or 1, head_dim]) to the K/V at (filled) positions ``slots`` ([n]) of one
        layer."""
        self._copy_on_write(layer, slots)
        n = slots.numel()
        self._k[layer].index_add_(1, slots, k.expand(-1, n, -1))
        self._v[layer].index_add_(1, slots, v.expand(-1, n, -1))

    def _copy_on_write(self, layer: int, slots: torch.Tensor) -> None:
        """Copy on write: the rows of ``layer`` still read in place from the refs ``slots`` hit come in first."""
        if self._ref_at is not None and self._in_place(layer):
            for ref_id in self._refs_hit(slots):
                if layer in self._refs[ref_id].layers:
                    self._copy_in(self._refs[ref_id], layer)

    def _refs_hit(self, slots: torch.Tensor) -> list[int]:
        """The refs (by id) reading any of ``slots``; remembered for the last ``slots`` tensor, which a
        forward passes at every layer until its active set changes."""
        if self._hit is not None and self._hit[0] is slots:
            return self._hit[1]
        hit = self._ref_at.index_select(0, slots)
        ids = hit[hit >= 0].unique().tolist() if bool((hit >= 0).any()) else []
        self._hit = (slots, ids)
        return ids

    def write_range(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Contiguous write (the decode hot path): k, v: [num_kv_heads, n, head_dim]."""
        n = k.shape[1]
        for ref in self._in_place(layer):
            if ref.dst_start < start + n and start < ref.dst_end:
                self._copy_in(ref, layer)
        self._k[layer, :, start : start + n] = k
        self._v[layer, :, start : start + n] = v
        self.filled[layer, start : start + n] = True

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [start, end) at ``layer``: [num_kv_heads, m, head_dim] each, views (no copy)."""
        self._flush(layer)
        return self._k[layer, :, start:end], self._v[layer, :, start:end]

    def attend(self, layer: int, q: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               num_keys: int) -> torch.Tensor:
        """Attention of q [H, n, hd] over positions [0, num_keys) at ``layer`` -> [n, H * hd]; ``mask`` bool
        [n, num_keys] (None: ``causal``, or every key visible). Rows read in place stay in place."""
        refs = self._in_place(layer)
        if not refs:
            k_all, v_all = self.kv(layer, 0, num_keys)  # [Hkv, num_keys, hd] each
            return attention(q, k_all, v_all, mask, causal)
        if self._plans is None:
            self._plans = SplitPlans()
        plan = self._plans.get(refs, mask, causal, num_keys, q, self.shape_tail[0])
        queries, keys, values = attend_split(plan, q, self._k[layer], self._v[layer], layer)
        return attention_parts(queries, keys, values, list(plan.masks), q.shape[0])

    def kv_all(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K, V of positions [start, end): [L, Hkv, m, hd] each, views."""
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K/V at positions ``slots`` ([n]) of one layer: [num_kv_heads, n, head_dim] each."""
        self._flush(layer)
        return self._k[layer].index_select(1, slots), self._v[layer].index_select(1, slots)

    @property
    def storages(self) -> list[torch.Tensor]:
        """The tensors holding this cache's K/V (for memory accounting; shared ones are listed too)."""
        return [self._k, self._v]

    def check_filled(self, num_positions: int) -> None:
        ok = self.filled[:, :num_positions]
        if not bool(ok.all()):
            layer, pos = (~ok).nonzero()[0].tolist()
            raise ScheduleError(
                f"schedule left position {pos} without K/V at layer {layer}: a token that is never "
                "active at a layer must have been loaded from a reused span"
            )

    def load_span(self, span: StoredSpan, dst_start: int, rope: RotaryEmbedding,
                  src_start: int = 0, src_end: int | None = None) -> int:
        """Load span tokens [src_start, src_end) at positions from ``dst_start``, keys re-rotated for them.

        Returns the number of positions moved (0 when the span keeps its original positions). On the CPU
        in fp32 the rows are read in place (see the class), elsewhere copied now.
        """
        src_end = len(span) if src_end is None else src_end
        n = src_end - src_start
        self.ensure_capacity(dst_start + n)
        delta = dst_start - (span.start_pos + src_start)
        if delta and not rope.can_shift:
            raise ScheduleError(
                f"RoPE type {rope.rope_type!r} does not compose, so keys cannot move by {delta} "
                "positions; recompute this span instead"
            )
        for ref in self._refs:  # positions loaded twice: the earlier load's rows go into the cache first
            if ref.layers and ref.dst_start < dst_start + n and dst_start < ref.dst_end:
                for layer in sorted(ref.layers):
                    self._copy_in(ref, layer)
        in_place = self.device.type == "cpu" and self.dtype == span.k.dtype == span.v.dtype == torch.float32 \
            and span.k.device.type == "cpu" and n >= IN_PLACE_MIN_TOKENS
        rows = slice(dst_start, dst_start + n)
        self.filled[:, rows] = True
        if in_place:
            ref = SpanRef(span, src_start, dst_start, n, delta, rope, set(range(self.num_layers)))
            if self._ref_at is None:
                self._ref_at = torch.full((self.capacity,), -1, dtype=torch.int32)
            self._ref_at[rows] = len(self._refs)
            self._refs, self._hit = (*self._refs, ref), None
            return n if delta else 0
        k = span.k[:, :, src_start:src_end].to(self.device, self.dtype)  # [L, Hkv, n, hd]
        v = span.v[:, :, src_start:src_end].to(self.device, self.dtype)
        if delta:  # rotated straight into the cache: no temporaries of the keys' size
            rope.shift_keys_into(k, delta, self._k[:, :, rows])
        else:
            self._k[:, :, rows] = k
        self._v[:, :, rows] = v
        return n if delta else 0

    def patch(self, dst_start: int, k: torch.Tensor, v: torch.Tensor, add: bool,
              rope: RotaryEmbedding | None = None) -> None:
        """Add to (``add``) or set positions [dst_start, dst_start + n); k, v: [L, Hkv, n, hd]. With ``rope``, ``k``
        is without RoPE and is rotated for those positions as it is written."""
        n = k.shape[2]
        self.ensure_capacity(dst_start + n)
        self._flush_all()
        rows = slice(dst_start, dst_start + n)
        if add:
            if not bool(self.filled[:, rows].all()):
                raise ScheduleError(f"offsets patched onto positions {dst_start}..{dst_start + n} with no loaded K/V")
            if rope is not None:
                rope.add_keys_at(k.to(self.device), dst_start, self.k[:, :, rows])
            else:
                self.k[:, :, rows] += k.to(self.device, self.dtype)
            self.v[:, :, rows] += v.to(self.device, self.dtype)
        else:
            if rope is not None:
                k = rope.shift_keys(k, torch.arange(dst_start, dst_start + n, device=k.device))
            self.k[:, :, rows] = k.to(self.device, self.dtype)
            self.v[:, :, rows] = v.to(self.device, self.dtype)
            self.filled[:, rows] = True

    def export(self, start: int, end: int, token_ids: list[int] | tuple[int, ...], fingerprint: str,
               hidden: dict[int, torch.Tensor] | None = None, hidden_from: int = 0) -> StoredSpan:
        """A copy of positions [start, end) as a span (the sequence cache may then be freed)."""
        if end > self.length:
            raise ValueError(f"export [{start}, {end}) past the sequence length {self.length}")
        hidden = dict(hidden or {})
        # in pages of their own, not the heap: a long-running store's evictions leave no holes (cache.span_pages)
        k, v, *hidden_rows = copies_in_own_pages([self.k[:, :, start:end], self.v[:, :, start:end], *hidden.values()])
        return StoredSpan(
            token_ids=tuple(int(t) for t in token_ids),
            start_pos=start,
            k=k,
            v=v,
            fingerprint=fingerprint,
            hidden=dict(zip(hidden, hidden_rows, strict=True)),
            hidden_from=hidden_from,
        )
