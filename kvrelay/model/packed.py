"""Weights packed once into oneDNN's blocked layout, for the CPU matrix products of every forward.

On CPU ``F.linear`` calls the BLAS torch was built with. On this project's AMD EPYC VMs that ran a
1,024-token prefill's products at about 200 GFLOP/s on two cores and SmolLM2's 49152 x 576 output
projection of one row in 7 ms; oneDNN's fp32 kernel, given each weight reordered once into its own
layout, ran the same products 2-5x faster from 8 rows up, and that one-row output projection 5x faster
(research/packed_matmul.py; the smaller products of one row are within 20% either way).
The precision is the same: fp32 products summed in another order move SmolLM2's real logits by up to
1.1e-4 from transformers' (3e-6 of their size; on the plain path they were equal, see
research/real_weights_parity.py), with the same argmax. These are the two ops torch's own compiler uses
for frozen weights on CPU (``mkldnn._reorder_linear_weight`` and ``mkldnn._linear_pointwise``).

The packed form is a second copy of each weight it serves (a model's weight bytes again). It is used only
where no gradient is wanted (every forward here runs under inference mode), only on the CPU, and for bf16
only where this CPU's oneDNN takes bf16. ``KVRELAY_PACKED_WEIGHTS=0`` turns it off for a process;
``unpacked()`` for a block of code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterable
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from kvrelay.model.standin import StandIn, flag_on

log = logging.getLogger(__name__)
ENV_VAR = "KVRELAY_PACKED_WEIGHTS"
_OFF: ContextVar[bool] = ContextVar("kvrelay_unpacked", default=False)
_PACKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> PackedWeight
_LOCK = threading.Lock()
_failed: set[torch.dtype] = set()  # dtypes whose packing failed in this process (they stay on F.linear)


@functools.cache
def _supported() -> tuple[torch.dtype, ...]:
    """The dtypes this torch and CPU can pack for oneDNN (none without its ops)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return ()
    bf16 = hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


@functools.cache
def _env_on() -> bool:
    """Read once: ``packed_for`` runs on every matmul (``_env_on.cache_clear()`` after changing it)."""
    return os.environ.get(ENV_VAR, "1") != "0"


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether weights of ``dtype`` get packed in this process (the torch can, nothing turned it off)."""
    return _env_on() and dtype in _supported() and dtype not in _failed


def unpacked() -> contextlib.AbstractContextManager:
    """Matmuls inside run on the weights as they are (``F.linear``): for A/B measurements."""
    return flag_on(_OFF)


class PackedWeight(StandIn):
    """A weight [N, K] in oneDNN's layout, standing in for ``source`` while it is unchanged (``StandIn``)."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__(source)
        with torch.inference_mode():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(source.detach(), None)  # opaque mkldnn tensor

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, K] -> [n, N]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _eligible(weight: torch.Tensor) -> bool:
    # Not an inference tensor: it keeps no version counter, so an in-place write to it would go unseen and
    # the packed copy would be stale. (Models are built outside inference mode; see layers.fuse_linears.)
    return (weight.device.type == "cpu" and weight.dim() == 2 and not weight.is_inference()
            and available(weight.dtype))


def packed_for(weight: torch.Tensor) -> PackedWeight | None:
    """``weight``'s packed stand-in, packed on first use (and again after the weight changed); None where
    packing does not apply (gradients wanted, not CPU, an inference tensor, a dtype this CPU cannot pack,
    turned off)."""
    if _OFF.get() or torch.is_grad_enabled():
        return None
    found = _PACKS.get(weight)
    if found is not None and found.stands_for(weight) and available(weight.dtype):
        return found
    if not _eligible(weight):
        if found is not None:  # moved to another device or dtype, or packing turned off: drop the copy
            with _LOCK:
                _PACKS.pop(weight, None)
        return None
    with _LOCK:
        found = _PACKS.get(weight)  # another thread may have packed it meanwhile
        if found is not None and found.stands_for(weight):
            return found
        try:
            found = _PACKS[weight] = PackedWeight(weight)
        except RuntimeError as exc:  # this oneDNN cannot take the dtype (or ran out of memory): F.linear
            _failed.add(weight.dtype)
            log.warning("oneDNN weight packing failed for %s (%s); those matmuls use F.linear", weight.dtype, exc)
            return None
    return found


def num_packed(weights: Iterable[torch.Tensor]) -> int:
    """How many of ``weights`` have a packed copy that still stands for them (packs nothing)."""
    return sum(found is not None and found.stands_for(w) and available(w.dtype)
               for w in weights for found in [_PACKS.get(w)])


def pack(weights: Iterable[torch.Tensor]) -> int:
    """Pack ``weights`` now (a model's load), so no call pays for it; returns how many are packed."""
    with torch.inference_mode():
        return sum(packed_for(w) is not None for w in weights)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (x [n, K], weight [N, K] -> [n, N]), through the packed weight where it applies."""
    packed = packed_for(weight) if x.dim() == 2 and x.dtype == weight.dtype else None
    return F.linear(x, weight, bias) if packed is None else packed(x, bias)
