"""Reading and writing K/V of chosen positions in vLLM's paged KV cache, layer by layer.

vLLM hands the worker-side connector one paged tensor per attention layer (``register_kv_caches``); a request's
position ``p`` lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``. The layout inside a
block is the attention backend's. This file knows the CPU backend's (``CPU_ATTN``): a layer is
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``; each (block, head) holds ``block_size * head_dim`` key
elements, then as many value elements. Values are row-major by position (``[block_size, head_dim]``); keys are
laid out as the backend's kernel for this CPU and dtype writes them: transposed (``[head_dim, block_size]``, the
``vec``/``vec16`` kernels) or by position (``plain``). The connector finds out which by letting the kernel write
a scratch block and reading it back each way (``connector``); a layout that reads back as neither is refused,
never read wrongly. Keys are stored after RoPE, as kvrelay's spans hold them.
"""

from __future__ import annotations

import re

import torch

from kvrelay.cache.kv import BUFFERS
from kvrelay.errors import ConfigError

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_order(layer_names: list[str]) -> list[str]:
    """Attention layer names in model order (by the ``layers.N.`` in each name)."""
    def index(name: str) -> int:
        m = _LAYER_INDEX.search(name)
        if m is None:
            raise ConfigError(f"kvrelay connector: cannot tell the layer index of attention layer {name!r}")
        return int(m[1])

    return sorted(layer_names, key=index)


KEY_LAYOUTS = ("transposed", "plain")


class PagedKV:
    """A model's paged K/V (one tensor per layer, in model order) seen as K/V by position of one request."""

    def __init__(self, layers: list[torch.Tensor], block_size: int, num_kv_heads: int, head_dim: int,
                 key_layout: str = "transposed") -> None:
        if key_layout not in KEY_LAYOUTS:
            raise ConfigError(f"kvrelay connector: key layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
        if not layers:
            raise ConfigError("kvrelay connector: vLLM registered no KV cache layers")
        shape = tuple(layers[0].shape)
        if len(shape) != 4 or shape[1] != num_kv_heads or shape[3] != 2 * head_dim:
            raise ConfigError(
                f"kvrelay connector: paged KV of shape {shape} is not the CPU backend's [blocks, {num_kv_heads} "
                f"kv heads, block size, 2 x {head_dim}]; only vLLM's CPU attention layout is supported")
        self.kernel_block_size = shape[2]
        if block_size % self.kernel_block_size:
            raise ConfigError(f"kvrelay connector: block size {block_size} is not a multiple of the kernel's "
                              f"{self.kernel_block_size}")
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.layers, self.key_layout = layers, key_layout
        self.ratio = block_size // self.kernel_block_size  # kernel blocks per scheduler block
        kbs = self.kernel_block_size
        self.transposed = key_layout == "transposed"
        self.keys, self.values = [], []
        for kv in layers:
            halves = kv.view(kv.shape[0], num_kv_heads, 2, kbs * head_dim)  # [blocks, Hkv, key | value, kbs * hd]
            self.values.append(halves[:, :, 1].view(kv.shape[0], num_kv_heads, kbs, head_dim))
            self.keys.append(halves[:, :, 0].view(kv.shape[0], num_kv_heads, head_dim, kbs) if self.transposed
                             else halves[:, :, 0].view(kv.shape[0], num_kv_heads, kbs, head_dim))
        self.dtype = layers[0].dtype

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def slots(self, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, row) of positions [start, end) of a request with ``block_ids``: [n] each."""
        pos = torch.arange(start, end)
        if end > len(block_ids) * self.block_size:
            raise ValueError(f"positions up to {end} do not fit {len(block_ids)} blocks of {self.block_size}")
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_size]
        within = pos % self.block_size
        return blocks * self.ratio + within // self.kernel_block_size, within % self.kernel_block_size

    def read(self, slots: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's K and V at ``slots``: [L, Hkv, n, hd] each."""
        blocks, rows = slots
        ks, vs = [], []
        for keys, values in zip(self.keys, self.values, strict=True):
            # advanced indices on both sides of the slices: the indexed dim comes first, [n, Hkv, hd]
            k = keys[blocks, :, :, rows] if self.transposed else keys[blocks, :, rows]
            ks.append(k.transpose(0, 1))  # [Hkv, n, hd]
            vs.append(values[blocks, :, rows].transpose(0, 1))
        return torch.stack(ks), torch.stack(vs)

    def runs(self, block_ids: list[int], start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Positions [start, end) of a request with ``block_ids`` as runs within kernel blocks, in order:
        (kernel block, first row, number of rows, offset from ``start``)."""
        if end > len(block_ids) * self.block_size:
            raise ValueError(f"positions up to {end} do not fit {len(block_ids)} blocks of {self.block_size}")
        kbs, out, pos = self.kernel_block_size, [], start
        while pos < end:
            row = pos % kbs
            num = min(kbs - row, end - pos)
            out.append((block_ids[pos // self.block_size] * self.ratio + pos % self.block_size // kbs, row, num,
                        pos - start))
            pos += num
        return out

    def read_range(self, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's K and V at positions [start, end) of a request, [L, Hkv, n, hd] each: ``read``'s
        result, copied a run of rows of a kernel block at a time (strided copies, no gather by index: several
        times faster for the few long runs a request's positions make)."""
        runs = self.runs(block_ids, start, end)
        shape = (self.num_layers, self.num_kv_heads, end - start, self.head_dim)
        k, v = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
        for layer, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            for block, row, num, offset in runs:
                rows, dst = slice(row, row + num), slice(offset, offset + num)
                k[layer, :, dst] = keys[block, :, :, rows].transpose(1, 2) if self.transposed else keys[block, :, rows]
                v[layer, :, dst] = values[block, :, rows]
        return k, v

    def copy_blocks(self, block_ids: list[int], num_tokens: int) -> PagedKV:
        """A copy of the blocks holding positions [0, ``num_tokens``) of a request with ``block_ids``, as a paged KV
        of its own whose blocks are 0, 1, ... in order, every layer's in one tensor (``stacked``). Copying whole
        blocks is a memory copy per layer, several times faster than ``read``'s gather by position (which
        transposes the keys), so it is what runs while vLLM holds the blocks; ``read_copied`` runs later."""
        if num_tokens > len(block_ids) * self.block_size:
            raise ValueError(f"{num_tokens} positions do not fit {len(block_ids)} blocks of {self.block_size}")
        num_blocks = -(-num_tokens // self.block_size)
        first = torch.tensor(block_ids[:num_blocks], dtype=torch.long) * self.ratio
        kernel_blocks = (first[:, None] + torch.arange(self.ratio)).flatten()  # [num_blocks * ratio]
        # [L, kernel blocks, Hkv, kbs, 2 * hd]
        # a buffer kept from an earlier copy: a fresh one of this size costs more in page faults than the copy
        stacked = BUFFERS.take((self.num_layers, kernel_blocks.numel(), *self.layers[0].shape[1:]), self.dtype,
                               torch.device("cpu"))
        for layer, out in zip(self.layers, stacked, strict=True):
            torch.index_select(layer, 0, kernel_blocks, out=out)
        copy = PagedKV(list(stacked.unbind(0)), self.block_size, self.num_kv_heads, self.head_dim, self.key_layout)
        copy.stacked = stacked
        return copy

    stacked: torch.Tensor | None = None  # a ``copy_blocks`` copy: every layer's blocks, [L, blocks, Hkv, kbs, 2 hd]

    def read_copied(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, ``num_tokens``) of a ``copy_blocks`` copy: ``read``'s result ([L, Hkv, n, hd] each, new
        tensors), from every layer at once (strided copies of whole blocks, no gather by index)."""
        if self.stacked is None:
            raise ValueError("read_copied reads a copy_blocks copy")
        num_layers, num_blocks, h_kv, kbs, _ = self.stacked.shape
        if num_tokens > num_blocks * kbs:
            raise ValueError(f"{num_tokens} positions do not fit the copy's {num_blocks} blocks of {kbs}")
        halves = self.stacked.view(num_layers, num_blocks, h_kv, 2, kbs * self.head_dim)
        # each [L, Hkv, blocks, kbs, hd]: position b * kbs + r of a head is [b, r]
        values = halves[:, :, :, 1].unflatten(-1, (kbs, self.head_dim)).transpose(1, 2)
        keys = halves[:, :, :, 0].unflatten(-1, (self.head_dim, kbs)).permute(0, 2, 1, 4, 3) if self.transposed \
            else halves[:, :, :, 0].unflatten(-1, (kbs, self.head_dim)).transpose(1, 2)
        full, rest = divmod(num_tokens, kbs)
        out = []
        for src in (keys, values):
            dst = torch.empty((num_layers, h_kv, num_tokens, self.head_dim), dtype=self.dtype)
            dst[:, :, : full * kbs].view(num_layers, h_kv, full, kbs, self.head_dim).copy_(src[:, :, :full])
            if rest:
                dst[:, :, full * kbs:].copy_(src[:, :, full, :rest])
            out.append(dst)
        return out[0], out[1]

    def write(self, slots: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's K and V ([L, Hkv, n, hd] each) into ``slots``."""
        blocks, rows = slots
        for layer, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            if self.transposed:
                keys[blocks, :, :, rows] = k[layer].transpose(0, 1).to(self.dtype)
            else:
                keys[blocks, :, rows] = k[layer].transpose(0, 1).to(self.dtype)
            values[blocks, :, rows] = v[layer].transpose(0, 1).to(self.dtype)
