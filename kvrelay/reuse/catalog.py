"""What ``kvrelay methods`` prints: every registered method with its settings, read off the method classes.

A method's settings are its dataclass's init fields; each carries its one line of meaning as
``field(metadata={"help": ...})``, as the config dataclasses the CLI derives its flags from do. The method's own
line is the first line of its module's docstring. Nothing here is a list kept by hand: a new setting shows up
with its default the moment it is a field.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from kvrelay.errors import ConfigError
from kvrelay.reuse import METHODS, method_class

SPEC_SYNTAX = "a method spec is NAME or NAME[setting=value,...], e.g. relay[keep_share=0.2] or cacheblend[ratio=0.3]"


@dataclass(frozen=True)
class SettingInfo:
    name: str
    type: str  # the field's annotation, e.g. "float | None"
    default: object  # None, bool, int, float or str
    help: str  # one line ("" where the field carries none)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    summary: str  # the first line of the method module's docstring, without its markup
    settings: tuple[SettingInfo, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def method_info(name: str) -> MethodInfo:
    """One registered method's line and settings."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    cls = method_class(name)
    doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
    summary = doc[0].replace("``", "") if doc else name
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    settings = tuple(SettingInfo(f.name, str(f.type), _default(f), " ".join(f.metadata.get("help", "").split()))
                     for f in fields if f.init)
    return MethodInfo(name, summary, settings)


def method_catalog(names: tuple[str, ...] = ()) -> list[MethodInfo]:
    """The named methods (every registered one by default), in registry order."""
    return [method_info(name) for name in (names or tuple(METHODS))]


def format_catalog(infos: list[MethodInfo]) -> str:
    """A plain-text listing: per method its line, then one row per setting (name, type, default, meaning)."""
    blocks = [SPEC_SYNTAX]
    for info in infos:
        lines = [info.summary]
        if not info.settings:
            lines.append("  (no settings)")
        width_name = max((len(s.name) for s in info.settings), default=0)
        width_type = max((len(s.type) for s in info.settings), default=0)
        width_default = max((len(repr(s.default)) for s in info.settings), default=0)
        for s in info.settings:
            lines.append(f"  {s.name:<{width_name}}  {s.type:<{width_type}}  {s.default!r:<{width_default}}  "
                         f"{s.help}".rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
