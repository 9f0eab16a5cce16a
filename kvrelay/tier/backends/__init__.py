"""Shared-tier backends: where spans live behind the memory tier (disk files, a Redis server).

Each backend moves opaque bytes under string keys (``base.TierBackend``); encoding spans is
``tier.wire``'s job, deciding what to fetch is ``tier.tiered``'s.
"""

from kvrelay.tier.backends.base import TierBackend, redact, span_key

__all__ = ["TierBackend", "redact", "span_key"]
