"""SIGHUP on ``kvrelay serve``: read the ``--api-keys`` and ``--metrics-key`` files again, without a restart.

Rotating a tenant's key, adding a tenant or revoking one otherwise needed a restart, which cuts what runs past the
grace. The new keys hold from the next request on; a request already admitted keeps running. A reload is all or
nothing: both files are read and checked (``kvrelay.server.key_files``) before either set of keys is replaced, so a
file caught half-written, emptied or holding a bad line leaves the old keys in force, with one warning naming the
problem. What changed is logged as counts, never as keys. A tenant's namespace is its key's digest: a new key starts
with no cached spans, and a removed key's spans are reclaimed as any idle namespace's are.
"""

from __future__ import annotations

import logging

from kvrelay.errors import ConfigError
from kvrelay.server.access import Keys, read_metrics_key
from kvrelay.server.key_files import read_api_keys

log = logging.getLogger("kvrelay.server")


class KeyReloader:
    """Reads the key files given at start into ``keys`` (the app's ``ServerSettings``) on each ``reload``."""

    def __init__(self, keys: Keys, api_keys_path: str | None, metrics_key_path: str | None) -> None:
        self.keys, self.api_keys_path, self.metrics_key_path = keys, api_keys_path, metrics_key_path

    def reload(self) -> bool:
        """Whether new keys were read (logged at WARNING either way: an operator's signal deserves an answer at the
        server's default log level)."""
        if self.api_keys_path is None and self.metrics_key_path is None:
            log.warning("SIGHUP: no key file to reload (the server was started without --api-keys and "
                        "--metrics-key); nothing changed")
            return False
        try:
            api_keys = read_api_keys(self.api_keys_path) if self.api_keys_path is not None else self.keys.api_keys
            metrics_key = read_metrics_key(self.metrics_key_path)
        except ConfigError as e:
            log.warning("SIGHUP: keys not reloaded, the previous ones stay in force: %s", e)
            return False
        old = self.keys.api_keys
        changed_metrics_key = metrics_key != self.keys.metrics_key
        self.keys.api_keys, self.keys.metrics_key = api_keys, metrics_key  # each a plain assignment: atomic
        said = []
        if self.api_keys_path is not None:
            said.append(f"--api-keys: {len(api_keys)} key(s), {len(api_keys - old)} added, {len(old - api_keys)} "
                        f"removed")
        if self.metrics_key_path is not None:
            said.append(f"--metrics-key: {'changed' if changed_metrics_key else 'unchanged'}")
        log.warning("SIGHUP: keys reloaded (%s)", "; ".join(said))
        return True
