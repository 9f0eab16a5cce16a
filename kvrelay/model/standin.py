"""A weight's stand-in: another form of the same values that a matmul may use while the weight is unchanged.

The 4-bit decode blocks (``int4``) and oneDNN's packed layout (``packed``) are built once from a model
weight. Each stays valid only while that weight is the same tensor object over the same memory with the
same version: loading other weights into the model, moving it or re-fusing it sends the matmul back to the
weight itself.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar

import torch


@contextlib.contextmanager
def flag_on(flag: ContextVar[bool]) -> Iterator[None]:
    """``flag`` reads True inside (this thread or task only): which stand-ins a block of code uses."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


class StandIn:
    """The identity of the weight a stand-in was built from (subclasses hold the other form)."""

    def __init__(self, source: torch.Tensor) -> None:
        self._source = weakref.ref(source)
        # ``param.data = ...`` and ``Module.to`` swap the memory without a new version
        self._source_memory = (source.data_ptr(), source.dtype, source.device)
        # inference tensors keep no version counter (a model built under inference_mode): their in-place
        # writes go unseen
        self._source_version = None if source.is_inference() else source._version

    def stands_for(self, weight: torch.Tensor) -> bool:
        if weight is not self._source() or (weight.data_ptr(), weight.dtype, weight.device) != self._source_memory:
            return False
        return self._source_version is None or weight._version == self._source_version
