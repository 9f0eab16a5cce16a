"""Boundary validation helpers: pydantic errors turned into one line naming the place and the rule."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def location(parts: tuple[Any, ...], names: dict[int, str] | None = None) -> str:
    """``agents[1] ('critic').max_new_tokens`` from pydantic's ``('agents', 1, 'max_new_tokens')``."""
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
            if names and i == 1 and p in names:
                out += f" ({names[p]!r})"
        else:
            out += f".{p}" if out else str(p)
    return out


def first_error(exc: ValidationError, where: str, names: dict[int, str] | None = None) -> str:
    """``where: field: rule, got VALUE`` for the first error of ``exc``, on one line.

    Unknown keys are listed together; ``names`` labels the list index after the first key (an agent's name)."""
    errors = exc.errors()
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        parent = loc[:-1]
        extra = sorted(str(e["loc"][-1]) for e in errors
                       if e.get("type") == "extra_forbidden" and tuple(e["loc"][:-1]) == parent)
        return f"{where}: {location(parent, names) or 'top level'} has unknown key(s) {extra}"
    label = location(loc, names)
    if err.get("type") == "missing":
        return f"{where}: {label}: required field is missing"
    msg = str(err.get("msg", "invalid")).replace("Input should be", "must be").removeprefix("Value error, ")
    msg = " ".join(msg.split())
    got = short_repr(err.get("input"))
    return f"{where}: {label}: {msg}, got {got}" if label else f"{where}: {msg}, got {got}"


def short_repr(value: Any, max_chars: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."
