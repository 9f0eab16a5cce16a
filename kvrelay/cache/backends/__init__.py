"""Shared-tier backends: where spans live behind the memory tier (disk files, a Redis server).

Each backend moves opaque bytes under string keys (``base.TierBackend``); encoding spans is
``cache.wire``'s job, deciding what to fetch is ``cache.tier``'s.
"""

from kvrelay.cache.backends.base import TierBackend, redact, span_key

__all__ = ["TierBackend", "redact", "span_key"]
