"""A sequence cache whose first positions are another cache's, referenced and never copied.

RKSC's ASKS: the prompt prefix that every branch shares is computed once into one cache; each
branch's cache reads positions [0, prefix_len) from it and keeps only its own tokens, from
``prefix_len`` on, so no branch ever holds a copy of the prefix. An RKSC plan supplies such a
cache to the engine (``Plan.make_cache``); the forward sees an ordinary ``SequenceKV``.
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
        self.ensure_capacity(prefix_len + max(1, capacity))

    def ensure_capacity(self, num_positions: int) -> None:
        if num_positions <= self.capacity:
            return
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

    def add(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().add(layer, self._own(slots), k, v)

    def write_range(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if start < self.prefix_len:
            raise ScheduleError(f"positions below {self.prefix_len} belong to the shared prefix and are read-only")
        super().write_range(layer, start - self.prefix_len, k, v)

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [start, end) at ``layer`` ([Hkv, m, hd] each): a view when the range lies on
        one side of ``prefix_len``, else a transient concatenation (the cache itself holds no copy)."""
        p = self.prefix_len
        if end <= p:
            return self.prefix.kv(layer, start, end)
        own_k, own_v = super().kv(layer, max(start, p) - p, end - p)
        if start >= p:
            return own_k, own_v
        pre_k, pre_v = self.prefix.kv(layer, start, p)
        return torch.cat([pre_k, own_k], dim=1), torch.cat([pre_v, own_v], dim=1)

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
        k, v = self.kv_all(start, end)
        return StoredSpan(tuple(int(t) for t in token_ids), start, k.clone(), v.clone(),
                          fingerprint, dict(hidden or {}), hidden_from)

    def kv_all(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K, V of positions [start, end) ([L, Hkv, m, hd] each), concatenated across the prefix."""
        p = self.prefix_len
        parts_k, parts_v = [], []
        if start < p:
            parts_k.append(self.prefix.k[:, :, start : min(end, p)])
            parts_v.append(self.prefix.v[:, :, start : min(end, p)])
        if end > p:
            parts_k.append(self.k[:, :, max(start, p) - p : end - p])
            parts_v.append(self.v[:, :, max(start, p) - p : end - p])
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)


def kv_bytes(caches: list[SequenceKV]) -> int:
    """Bytes of K/V the caches hold together, each tensor counted once however many share it (a
    cache's tensor may be a view of a larger pooled buffer: its own bytes are counted, not the pool's)."""
    seen: dict[int, int] = {}
    for cache in caches:
        for t in cache.storages:
            ptr = t.untyped_storage().data_ptr()
            seen[ptr] = max(seen.get(ptr, 0), t.nbytes)
    return sum(seen.values())
