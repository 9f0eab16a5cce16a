"""The reuse methods an engine holds, and the layers every call carries for them.

A method is one object per spec string, so a stateful method (KVCOMM's anchor pools) keeps its state across calls.
Methods set up at construction (or by ``Engine.method``) are kept for good; a method a call names on its own (a
request's ``kvrelay.method`` spec, a method object passed in) is one of the ``MAX_ONE_OFF_METHODS`` most recently
named. Every method's capture layers join the engine's, so an upstream call carries the hidden states a downstream
method needs, whoever drives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvrelay.model.lm import LoadedModel
from kvrelay.reuse import ReuseMethod, get_method

# methods a call names that were not set up, kept at once, least recently used out first: every spec string is a
# new object, and a client naming ``epic[k=1]``, ``epic[k=2]``, ... made one each for the server's life. One put out
# starts afresh if named again
MAX_ONE_OFF_METHODS = 64


class MethodRegistry:
    """The methods set up for good, the one-off ones (a bounded LRU), and the union of their capture layers."""

    def __init__(self, lm: LoadedModel, capture_layers: Iterable[int] = ()) -> None:
        """``capture_layers``: layers to carry beyond what the methods ask for (e.g. a profiler's)."""
        self.lm = lm
        self._kept: dict[str, ReuseMethod] = {}
        self._one_off: OrderedDict[str, ReuseMethod] = OrderedDict()
        self._capture: set[int] = {int(layer) for layer in capture_layers}

    def get(self, spec: str | ReuseMethod, keep: bool = True) -> ReuseMethod:
        """The method for ``spec``, made on first use (its capture layers join the registry's). ``keep``: set it
        up for good; else it is one of the ``MAX_ONE_OFF_METHODS`` most recently named."""
        key = f"{spec.name}@{id(spec)}" if isinstance(spec, ReuseMethod) else spec.strip()
        method = self._kept.get(key)
        if method is not None:
            return method
        method = self._one_off.pop(key, None)
        if method is None:
            method = spec if isinstance(spec, ReuseMethod) else get_method(key)
            self._capture.update(method.capture_layers(self.lm))
        if keep:
            self._kept[key] = method
        else:
            self._one_off[key] = method
            while len(self._one_off) > MAX_ONE_OFF_METHODS:
                self._one_off.popitem(last=False)
        return method

    def __len__(self) -> int:
        """Methods held: those set up and the one-off ones."""
        return len(self._kept) + len(self._one_off)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Layers whose input hidden states every call carries (union over the methods held or ever made)."""
        return tuple(sorted(self._capture))
