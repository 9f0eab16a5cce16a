"""Reuse methods by name. A new method is a new file here plus one line in ``METHODS``.

Methods are imported on first use, by path: ``rksc`` plans the branches of one problem and lives in
its own wing (``kvrelay.branches``), above the engine.

A method spec is a name with optional parameters: ``relay``, ``relay[keep_share=0.2,band=2:2:29]``,
``cacheblend[ratio=0.3]``, ``epic[k=8]``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import TYPE_CHECKING

from kvrelay.errors import ConfigError

if TYPE_CHECKING:
    from kvrelay.reuse.base import CallInput, Plan, ReuseMethod, SpanLoad, SpanRef, role_key

METHODS: dict[str, str] = {
    "full": "kvrelay.reuse.full:FullMethod", "prefix": "kvrelay.reuse.prefix:PrefixMethod",
    "naive": "kvrelay.reuse.naive:NaiveMethod", "cacheblend": "kvrelay.reuse.cacheblend:CacheBlendMethod",
    "epic": "kvrelay.reuse.epic:EpicMethod", "relay": "kvrelay.reuse.relay:RelayMethod",
    "kvcomm": "kvrelay.reuse.kvcomm:KVCommMethod", "rksc": "kvrelay.branches.rksc:RKSCMethod",
}

#: methods that plan single agent calls of a pipeline; ``rksc`` plans branches (workload gsm8k-branches)
PIPELINE_METHODS = tuple(m for m in METHODS if m != "rksc")

__all__ = ["PIPELINE_METHODS", "METHODS",
           "CallInput", "Plan", "ReuseMethod", "SpanLoad", "SpanRef", "get_method", "method_class",
           "role_key", "split_method_specs"]


# kvrelay.reuse.base's names, imported on first use: the registry and spec parsing above and below are torch-free, so
# the CLI lists the methods in its flags' help without loading torch
_BASE_NAMES = frozenset({"CallInput", "Plan", "ReuseMethod", "SpanLoad", "SpanRef", "role_key"})


def __getattr__(name: str):
    if name in _BASE_NAMES:
        return getattr(importlib.import_module("kvrelay.reuse.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def method_class(name: str) -> type[ReuseMethod]:
    """The class of a registered method name (imported on first use)."""
    module, _, attr = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), attr)

_SPEC = re.compile(r"^([a-z_]+)(?:\[(.*)\])?$")


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _check_type(spec: str, key: str, value, annotation: str):
    """``value`` as the field's annotated type (``float``, ``int | None``, ...), or a ConfigError."""
    kinds = set(re.findall(r"\b(bool|int|float|str|None)\b", str(annotation)))
    kind = "None" if value is None else type(value).__name__
    if kind == "int" and "int" not in kinds and "float" in kinds:
        return float(value)
    if kind not in kinds:
        raise ConfigError(f"method {spec!r}: {key}={value!r} is not a valid {annotation}")
    return value


def get_method(spec: str) -> ReuseMethod:
    """A method from its spec, e.g. ``relay[keep_share=0.2]``; unknown names or parameters are errors."""
    m = _SPEC.match(spec.strip())
    if not m or m.group(1) not in METHODS:
        raise ConfigError(f"unknown method {spec!r}; available: {', '.join(METHODS)} (parameters as name[k=v,...])")
    cls, params = method_class(m.group(1)), {}
    fields = {f.name: f.type for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else {}
    for item in filter(None, (m.group(2) or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ConfigError(f"method {spec!r}: unknown parameter {key!r}; parameters: {sorted(fields) or 'none'}")
        if key in params:  # the last one would win unseen
            raise ConfigError(f"method {spec!r}: {key} is given twice")
        params[key] = _check_type(spec, key, _parse_value(value.strip()), fields[key])
    return cls(**params)


def split_method_specs(text: str) -> tuple[str, ...]:
    """Split a comma-separated list of specs, keeping commas inside [...]."""
    specs, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            specs.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        specs.append(current.strip())
    return tuple(specs)
