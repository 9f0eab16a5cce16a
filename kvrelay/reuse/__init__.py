"""Reuse methods by name. A new method is a new file here plus one line in ``METHODS``."""

from __future__ import annotations

from kvrelay.errors import ConfigError
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod, SpanLoad, SpanRef
from kvrelay.reuse.full import FullMethod
from kvrelay.reuse.prefix import PrefixMethod

METHODS: dict[str, type[ReuseMethod]] = {"full": FullMethod, "prefix": PrefixMethod}

__all__ = ["METHODS", "CallInput", "Plan", "ReuseMethod", "SpanLoad", "SpanRef", "get_method"]


def get_method(name: str) -> ReuseMethod:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]()
