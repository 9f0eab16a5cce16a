"""4-bit weights for decode steps, read by torch's CPU int4 kernel.

A decode step reads every weight once for one row of activations per sequence, so on CPU it is bound by
weight bytes: 538 MB a step at fp32 for SmolLM2. A
GGUF's 4-bit blocks (Q4_0/Q4_1/Q4_K: 32 weights share a scale and an offset) are the form
``torch._weight_int4pack_mm_for_cpu`` reads, at an eighth of the bytes: the same 4-bit values, but the
kernel takes scales, zeros and activations in bf16 only and returns bf16, so a step's logits move from
the fp32 path's (KL ~1e-4, research/int4_decode.py). Only ``Transformer.decode``
runs inside ``decode_steps``; every prefill, whatever its length, keeps the fp32 weights, so the prompt
KV a store holds and every fidelity number are those of the fp32 path.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from kvrelay.model.standin import StandIn, flag_on

GROUP_SIZE = 32  # weights sharing a scale and an offset (GGUF's Q4_0, Q4_1 and Q4_K sub-blocks)
_PACK_ROWS = 16  # the kernel's weight packing takes rows in multiples of 16

# (q [N, K], scale [N, K/32], offset [N, K/32]) of one weight, by HF name (kvrelay.weights.gguf.read_int4_blocks)
Int4Blocks = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

_DECODING: ContextVar[bool] = ContextVar("kvrelay_int4_decoding", default=False)


def decode_steps() -> contextlib.AbstractContextManager:
    """Matmuls inside run on the 4-bit stand-ins (a decorator of ``Transformer.decode``)."""
    return flag_on(_DECODING)


def decoding() -> bool:
    """True inside ``decode_steps``."""
    return _DECODING.get()


class Int4Weight(StandIn):
    """A weight [N, K] of 4-bit blocks standing in for ``source`` (its fp32 values) in decode steps, while
    ``source`` is unchanged (``StandIn``)."""

    def __init__(self, source: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        rows, cols = source.shape
        if q.shape != (rows, cols) or scale.shape != (rows, cols // GROUP_SIZE) or offset.shape != scale.shape:
            raise ValueError(f"4-bit blocks {tuple(q.shape)}, {tuple(scale.shape)} do not cover a weight "
                             f"{tuple(source.shape)} in groups of {GROUP_SIZE}")
        if source.device.type != "cpu":
            raise ValueError(f"4-bit weights run on CPU only, not {source.device}")
        super().__init__(source)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # uint8 [N, K/2]
        zero = offset + 8 * scale  # the kernel computes (q - 8) * scale + zero per group
        # bf16 is the only type the kernel takes them in
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] -> [n, N] in x's dtype."""
        out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_zeros)
        return out.to(x.dtype)


def int4_of(source: torch.Tensor, names: list[str], blocks: Int4Blocks) -> Int4Weight | None:
    """The 4-bit stand-in of ``source``, the rows of weights ``names`` stacked; None unless all have blocks
    (and the kernel takes the shape)."""
    parts = [blocks.get(name) for name in names]
    if any(part is None for part in parts) or source.shape[0] % _PACK_ROWS:
        return None
    q, scale, offset = (torch.cat([part[i] for part in parts]) for i in range(3))
    return Int4Weight(source, q, scale, offset)
