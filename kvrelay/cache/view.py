"""A store bound to one namespace (the interface the reuse methods take)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.cache.store import KVStore, PrefixMatch, SpanLike


class StoreView:
    """A store bound to one namespace: the ``KVStore`` interface without the ``namespace`` arguments."""

    def __init__(self, store: KVStore, namespace: str) -> None:
        self.store, self.namespace = store, namespace

    def __contains__(self, span_id: str) -> bool:
        return self.store.contains(span_id, self.namespace)

    def __len__(self) -> int:
        return len(self.store.ids(self.namespace))

    def ids(self) -> list[str]:
        return self.store.ids(self.namespace)

    def get(self, span_id: str) -> Any:
        return self.store.get(span_id, self.namespace)

    def put(self, span_id: str, span: SpanLike, pin: bool = False) -> list[str]:
        return self.store.put(span_id, span, pin, self.namespace)

    def remove(self, span_id: str) -> None:
        self.store.remove(span_id, self.namespace)

    def pin(self, span_id: str) -> None:
        self.store.pin(span_id, self.namespace)

    def unpin(self, span_id: str) -> None:
        self.store.unpin(span_id, self.namespace)

    def is_pinned(self, span_id: str) -> bool:
        return self.store.is_pinned(span_id, self.namespace)

    def match_prefix(self, fingerprint: str, token_ids: list[int] | tuple[int, ...]) -> PrefixMatch | None:
        return self.store.match_prefix(fingerprint, token_ids, self.namespace)

    def poll_published(self, fingerprint: str | None = None, include_own: bool = False) -> list:
        return self.store.poll_published(self.namespace, fingerprint, include_own)

    def set_compute_rate(self, token_layers_per_s: float | None) -> None:
        self.store.set_compute_rate(token_layers_per_s)

    def set_fingerprint(self, fingerprint: str) -> None:
        self.store.set_fingerprint(fingerprint)

    def take_decisions(self) -> list:
        return self.store.take_decisions()

    @property
    def budget_bytes(self) -> int:
        return self.store.budget_bytes

    @property
    def peak_bytes(self) -> int:
        return self.store.peak_bytes

    @property
    def used_bytes(self) -> int:
        return self.store.namespace_bytes(self.namespace)
