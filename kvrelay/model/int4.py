"""4-bit weights for matmuls over a few rows (decode steps), read by torch's CPU int4 kernel.

A decode step reads every weight once for one row of activations, so on CPU it is bound by weight bytes:
538 MB a step at fp32 for SmolLM2 (BENCHMARKS.md, "Where a decode step goes"). The shipped GGUF stores
its layer weights as 4-bit blocks (Q4_0/Q4_1: 32 weights share a scale and an offset), which is the form
``torch._weight_int4pack_mm_for_cpu`` reads, at an eighth of the bytes, with the same weight values. That
kernel is only fast with bf16 activations and returns bf16, so a step's logits move from the fp32 path's
(KL ~1e-4, measured in BENCHMARKS.md). Matmuls over more than ``MAX_ROWS`` rows keep the fp32 weights:
long prefills, the KV they store and every fidelity number are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP_SIZE = 32  # weights per 4-bit block (GGUF's Q4_0 and Q4_1)
# Decode batches (the server runs up to 8 rows by default) and the shortest prefills; a decode step is
# faster on the 4-bit weights up to 128 rows at least (BENCHMARKS.md), but prompts of more rows keep fp32
# so that the prompt KV a store holds, and every fidelity number, stay those of the fp32 weights.
MAX_ROWS = 16


class Int4Weight:
    """A weight [N, K] of 4-bit blocks standing in for ``source`` (its fp32 values) on a few rows.

    It applies only while ``source`` is the same tensor, unchanged: loading other weights into the
    model (a new version of the tensor) or re-fusing it sends every matmul back to fp32."""

    def __init__(self, source: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        rows, cols = source.shape
        if q.shape != (rows, cols) or scale.shape != (rows, cols // GROUP_SIZE) or offset.shape != scale.shape:
            raise ValueError(f"4-bit blocks {tuple(q.shape)}, {tuple(scale.shape)} do not cover a weight "
                             f"{tuple(source.shape)} in groups of {GROUP_SIZE}")
        if source.device.type != "cpu":
            raise ValueError(f"4-bit weights run on CPU only, not {source.device}")
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # uint8 [N, K/2]
        # the kernel computes (q - 8) * scale + zero per block
        zero = offset + 8 * scale
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.source_ptr, self.source_version = source.data_ptr(), source._version
        self.num_bytes = self.packed.numel() + self.scales_zeros.numel() * 2

    def stands_for(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.source_ptr and weight._version == self.source_version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] -> [n, N] in x's dtype."""
        out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_zeros)
        return out.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           int4: Int4Weight | None = None) -> torch.Tensor:
    """``F.linear``, through ``int4`` when it stands for ``weight`` and x has at most MAX_ROWS rows."""
    if int4 is None or x.shape[0] > MAX_ROWS or not int4.stands_for(weight):
        return F.linear(x, weight, bias)
    out = int4(x)
    return out if bias is None else out + bias


# (q [N, K], scale [N, K/32], offset [N, K/32]) of one weight, by HF name (kvrelay.weights.gguf.read_int4_blocks)
Int4Blocks = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def int4_of(source: torch.Tensor, names: list[str], blocks: Int4Blocks) -> Int4Weight | None:
    """The 4-bit stand-in of ``source``, the rows of weights ``names`` stacked; None unless all have blocks."""
    parts = [blocks.get(name) for name in names]
    if any(part is None for part in parts):
        return None
    q, scale, offset = (torch.cat([part[i] for part in parts]) for i in range(3))
    return Int4Weight(source, q, scale, offset)
