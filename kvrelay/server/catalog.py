"""The server's spans: the store, the token index and the output registry, kept in step, per namespace.

Until the store scopes spans by namespace itself, span ids carry their namespace and the engine
sees the store through a ``NamespaceStore`` view: lookups, reads and writes of one namespace never
see another's spans, and a put evicts only spans of its own namespace (a tenant can never push
another tenant's KV out, which would also be observable through timing).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvrelay.cache.index import TokenIndex
from kvrelay.cache.store import KVStore, PrefixMatch, SpanLike
from kvrelay.errors import StoreFullError
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.registry import OutputRegistry, RegisteredOutput


@dataclass
class CallBuild:
    call: CallInput
    num_prefix_tokens: int  # exact stored prefix
    pinned: list[str]  # span ids pinned for this call (unpin when it ends)


class SpanCatalog:
    def __init__(self, store: KVStore, fingerprint: str, block_len: int = 16, min_match_tokens: int = 16) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.index = TokenIndex(block_len=block_len)
        self.registry = OutputRegistry()
        self.min_match_tokens = min_match_tokens
        self._namespace_of: dict[str, str] = {}
        self._nbytes_of: dict[str, int] = {}
        self._counter = itertools.count()
        self.num_publish_skipped = 0  # spans that did not fit the namespace's share of the budget

    def new_span_id(self, namespace: str) -> str:
        return f"{namespace}#{next(self._counter)}"

    def owns(self, namespace: str, span_id: str) -> bool:
        return self._namespace_of.get(span_id) == namespace and span_id in self.store

    def view(self, namespace: str) -> NamespaceStore:
        return NamespaceStore(self, namespace)

    # ------------------------------------------------------------------ writes
    def put(self, namespace: str, span_id: str, span: SpanLike, pin: bool = False) -> None:
        """Store ``span`` for ``namespace``, evicting only that namespace's least recent unpinned spans.
        Raises StoreFullError (storing nothing) when they cannot make room."""
        need = int(span.nbytes) - (self.store.budget_bytes - self.store.used_bytes)
        own = [sid for sid in self.store.ids() if self._namespace_of.get(sid) == namespace
               and not self.store.is_pinned(sid)]
        if need > 0 and sum(self._nbytes(sid) for sid in own) < need:
            raise StoreFullError(f"span of {span.nbytes} bytes does not fit namespace {namespace!r}'s evictable "
                                 f"spans and the free budget")
        for sid in own:
            if need <= 0:
                break
            need -= self._nbytes(sid)
            self.drop(sid)
        for victim in self.store.put(span_id, span, pin=pin):  # nothing, since room was made above
            self._forget(victim)
        self._namespace_of[span_id] = namespace
        self._nbytes_of[span_id] = int(span.nbytes)
        self.index.add(span_id, span.token_ids, namespace)

    def register(self, output: RegisteredOutput) -> bool:
        return self.registry.add(output)

    def drop(self, span_id: str) -> None:
        if span_id in self.store:
            self.store.remove(span_id)
        self._forget(span_id)

    def _forget(self, span_id: str) -> None:
        self.index.remove(span_id)
        self.registry.remove_span(span_id)
        self._namespace_of.pop(span_id, None)
        self._nbytes_of.pop(span_id, None)

    def _nbytes(self, span_id: str) -> int:
        return self._nbytes_of.get(span_id, 0)

    # ------------------------------------------------------------------ lookups
    def match_prefix(self, namespace: str, token_ids: list[int]) -> PrefixMatch | None:
        m = self.index.match_prefix(token_ids, namespace)
        if m is None or not self.owns(namespace, m.span_id):
            return None
        return PrefixMatch(m.span_id, m.num_tokens)

    def build_call(self, prompt: PromptBuild, namespace: str, agent: str) -> CallBuild:
        """The call with its SpanRefs: quoted outputs (kind "output"), then the exact prefix, then the
        longest runs shared with stored spans (kind "input"); the spans they read are pinned."""
        ids = prompt.ids
        refs: list[SpanRef] = []
        covered: list[tuple[int, int]] = []
        for k, splice in enumerate(prompt.splices):
            out = splice.output
            if self.owns(namespace, out.span_id):
                refs.append(SpanRef(splice.start, splice.end, out.span_id, out.src_start, "output", f"output{k}"))
                covered.append((splice.start, splice.end))
        prefix = self.match_prefix(namespace, ids)
        num_prefix = 0 if prefix is None else min(prefix.num_tokens, len(ids) - 1)
        if num_prefix > 0:
            covered.append((0, num_prefix))
        for k, m in enumerate(self.index.find(ids, namespace, self.min_match_tokens, covered)):
            if self.owns(namespace, m.span_id):
                refs.append(SpanRef(m.start, m.end, m.span_id, m.src_start, "input", f"input{k}"))
        refs.sort(key=lambda r: r.start)
        pinned = sorted({r.span_id for r in refs} | ({prefix.span_id} if num_prefix > 0 else set()))
        for span_id in pinned:
            self.store.pin(span_id)
        return CallBuild(CallInput(ids, refs, agent), num_prefix, pinned)

    def unpin(self, span_ids: list[str]) -> None:
        for span_id in span_ids:
            if span_id in self.store and self.store.is_pinned(span_id):
                self.store.unpin(span_id)


class NamespaceStore:
    """The store as one namespace sees it: what the engine and the methods are handed."""

    def __init__(self, catalog: SpanCatalog, namespace: str) -> None:
        self.catalog, self.namespace = catalog, namespace

    @property
    def block_len(self) -> int:
        return self.catalog.store.block_len

    def __contains__(self, span_id: str) -> bool:
        return self.catalog.owns(self.namespace, span_id)

    def get(self, span_id: str):
        if not self.catalog.owns(self.namespace, span_id):
            raise KeyError(f"span {span_id!r} is not in this namespace's store")
        return self.catalog.store.get(span_id)

    def match_prefix(self, fingerprint: str, token_ids: list[int] | tuple[int, ...]) -> PrefixMatch | None:
        if fingerprint != self.catalog.fingerprint:
            return None
        return self.catalog.match_prefix(self.namespace, list(token_ids))

    def put(self, span_id: str, span: SpanLike, pin: bool = False) -> list[str]:
        self.catalog.put(self.namespace, span_id, span, pin)
        return []
