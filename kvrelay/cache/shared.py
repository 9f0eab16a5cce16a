"""A sequence cache whose first positions are another cache's, referenced and never copied.

RKSC's ASKS: the prompt prefix that every branch shares is computed once into one cache; each
branch's cache reads positions [0, prefix_len) from it and keeps only its own tokens, from
``prefix_len`` on. Attention then runs over two key segments (see ``Transformer._attend``), so
no branch ever holds a copy of the prefix.
"""

from __future__ import annotations

import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.errors import ScheduleError


class SharedPrefixKV(SequenceKV):
    """Positions [0, prefix_len) come from ``prefix`` (read-only); positions >= prefix_len are own."""

    def __init__(self, prefix: SequenceKV, prefix_len: int, capacity: int = 64) -> None:
        if not 0 < prefix_len <= prefix.length:
            raise ScheduleError(f"shared prefix of {prefix_len} tokens, but the prefix cache holds {prefix.length}")
        prefix.check_filled(prefix_len)
        self.prefix, self.prefix_len = prefix, prefix_len
        self.num_layers, self.shape_tail = prefix.num_layers, prefix.shape_tail
        self.dtype, self.device = prefix.dtype, prefix.device
        self.capacity = prefix_len  # positions addressable without growing
        self.length = prefix_len
        # own rows: row r holds position prefix_len + r
        self.k = self.v = torch.empty(0)
        self.filled = torch.empty(0, dtype=torch.bool)
        # set by ``batch``: the common own-row storage [L, B, Hkv, cap, hd] and this cache's row in it
        self.batch_k: torch.Tensor | None = None
        self.batch_v: torch.Tensor | None = None
        self.batch_filled: torch.Tensor | None = None
        self.batch_row = 0
        self.ensure_capacity(prefix_len + max(1, capacity))

    @classmethod
    def batch(cls, prefix: SequenceKV, prefix_len: int, own_capacity: int, num: int) -> list[SharedPrefixKV]:
        """``num`` caches over one prefix whose own rows are slots of one common tensor, so that
        ``decode_step_batch`` reads them without gathering. Their capacity is fixed (a view cannot
        grow): ``own_capacity`` positions past ``prefix_len`` each."""
        if num < 1 or own_capacity < 1:
            raise ScheduleError(f"a cache batch needs num >= 1 and own_capacity >= 1, got {num}, {own_capacity}")
        h_kv, head_dim = prefix.shape_tail
        # zeros, not empty: a batched step multiplies every row's padding slots by a zero probability,
        # and 0 x (uninitialised NaN) would be NaN
        big_k = torch.zeros(prefix.num_layers, num, h_kv, own_capacity, head_dim, dtype=prefix.dtype,
                            device=prefix.device)  # [L, B, Hkv, cap, hd]
        big_v = torch.zeros_like(big_k)
        big_filled = torch.zeros(prefix.num_layers, num, own_capacity, dtype=torch.bool, device=prefix.device)
        caches = []
        for row in range(num):
            cache = cls(prefix, prefix_len, capacity=1)
            cache.k, cache.v, cache.filled = big_k[:, row], big_v[:, row], big_filled[:, row]  # views
            cache.capacity = prefix_len + own_capacity
            cache.batch_k, cache.batch_v, cache.batch_filled, cache.batch_row = big_k, big_v, big_filled, row
            caches.append(cache)
        return caches

    def ensure_capacity(self, num_positions: int) -> None:
        if num_positions <= self.capacity:
            return
        if self.batch_k is not None:
            raise ScheduleError(f"batched cache full: {num_positions} positions past its capacity of {self.capacity}")
        own_cap = max(num_positions - self.prefix_len, 2 * (self.capacity - self.prefix_len))
        h_kv, head_dim = self.shape_tail
        k = torch.empty(self.num_layers, h_kv, own_cap, head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        filled = torch.zeros(self.num_layers, own_cap, dtype=torch.bool, device=self.device)
        old = self.capacity - self.prefix_len
        if old:
            k[:, :, :old], v[:, :, :old], filled[:, :old] = self.k, self.v, self.filled
        self.k, self.v, self.filled, self.capacity = k, v, filled, self.prefix_len + own_cap

    def _own(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.numel() and int(slots.min()) < self.prefix_len:
            raise ScheduleError(f"positions below {self.prefix_len} belong to the shared prefix and are read-only")
        return slots - self.prefix_len

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write(layer, self._own(slots), k, v)

    def write_range(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if start < self.prefix_len:
            raise ScheduleError(f"positions below {self.prefix_len} belong to the shared prefix and are read-only")
        super().write_range(layer, start - self.prefix_len, k, v)

    def kv(self, layer: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        p = self.prefix_len
        segs = []
        if start < p:
            segs += self.prefix.kv(layer, start, min(end, p))
        if end > p:
            segs += super().kv(layer, max(start, p) - p, end - p)
        return segs

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().gather(layer, self._own(slots))

    @property
    def storages(self) -> list[torch.Tensor]:
        return [*self.prefix.storages, self.k, self.v]

    def check_filled(self, num_positions: int) -> None:
        own = self.filled[:, : num_positions - self.prefix_len]
        if not bool(own.all()):
            layer, row = (~own).nonzero()[0].tolist()
            raise ScheduleError(f"schedule left position {row + self.prefix_len} without K/V at layer {layer}")

    def load_span(self, *args, **kwargs) -> int:
        raise ScheduleError("a shared-prefix cache takes no loaded spans: its prefix is shared, the rest computed")

    def patch(self, *args, **kwargs) -> None:
        raise ScheduleError("a shared-prefix cache takes no patches")

    def export(self, start: int, end: int, token_ids: list[int] | tuple[int, ...], fingerprint: str,
               hidden: dict[int, torch.Tensor] | None = None, hidden_from: int = 0) -> StoredSpan:
        """A contiguous copy of positions [start, end) (prefix rows included) as a span."""
        if end > self.length:
            raise ValueError(f"export [{start}, {end}) past the sequence length {self.length}")
        segments = self.kv_all(start, end)
        k = torch.cat([k for k, _ in segments], dim=2)  # [L, Hkv, end - start, hd]
        v = torch.cat([v for _, v in segments], dim=2)
        return StoredSpan(tuple(int(t) for t in token_ids), start, k, v,
                          fingerprint, dict(hidden or {}), hidden_from)

    def kv_all(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V of positions [start, end) as segments ([L, Hkv, m, hd] each)."""
        p, segs = self.prefix_len, []
        if start < p:
            segs.append((self.prefix.k[:, :, start : min(end, p)], self.prefix.v[:, :, start : min(end, p)]))
        if end > p:
            segs.append((self.k[:, :, max(start, p) - p : end - p], self.v[:, :, max(start, p) - p : end - p]))
        return segs


def kv_bytes(caches: list[SequenceKV]) -> int:
    """Bytes of K/V storage the caches hold together, each tensor counted once however many share it."""
    seen: dict[int, int] = {}
    for cache in caches:
        for t in cache.storages:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
