"""The key files of ``--api-keys`` and ``--metrics-key``: one bearer token a line, blank lines and ``#`` comments
skipped.

A comment a team writes above its key (``# team alpha``) would otherwise be a key itself, one any client could send.
A token is visible ASCII without spaces (what an ``Authorization: Bearer`` header carries); a line that is not one is
refused by its number, never echoed, since the file holds secrets.
"""

from __future__ import annotations

from pathlib import Path

from kvrelay.errors import ConfigError

MIN_KEY_CHAR, MAX_KEY_CHAR = "!", "~"  # visible ASCII: a space or a control character cannot reach a bearer token


def read_key_lines(path: str, flag: str) -> list[str]:
    """The keys in ``path`` in file order; ConfigError naming ``flag`` for a missing file, a bad line or no key."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    try:
        text = file.read_text(encoding="utf-8-sig")  # an editor's BOM is no part of the first key
    except OSError as e:  # unreadable (permissions): named, never a traceback
        raise ConfigError(f"{flag} {path}: cannot be read ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: is not UTF-8 text") from None
    keys: list[str] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not all(MIN_KEY_CHAR <= char <= MAX_KEY_CHAR for char in key):
            raise ConfigError(f"{flag} {path}: line {line_number} is no key (a key is visible ASCII without spaces; "
                              f"a comment line starts with #)")
        keys.append(key)
    if not keys:
        raise ConfigError(f"{flag} {path}: the file holds no key")
    return keys


def read_api_keys(path: str | None) -> frozenset[str]:
    """The tenants' keys in ``--api-keys FILE``, or none without the flag."""
    return frozenset() if path is None else frozenset(read_key_lines(path, "--api-keys"))
