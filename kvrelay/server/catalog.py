"""The server's spans: the store, the token index and the output registry, kept in step, per namespace.

The store scopes spans by namespace (a tenant's spans are never matched, read or evicted through
another namespace); the engine sees it through a ``CatalogView`` of the request's namespace, which
also tells the index and the registry about every span the store evicts.

Spans other replicas published to a shared tier are indexed too (``learn_published``) though this process may never
hold them, so no eviction of its own store forgets them: they are kept up to ``MAX_LEARNED_TOKENS`` tokens, room
made from the API key holding the most (``FairLru``), least recently learned first within it. Without that bound a
replica's index grew with every span its peers published, for as long as it ran.
"""

from __future__ import annotations

import re
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvrelay.cache.store import KVStore, SpanLike, StoreView
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.server.fair_lru import FairLru
from kvrelay.server.index import TokenIndex
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.registry import OutputRegistry, RegisteredOutput
from kvrelay.server.serve_config import MatchConfig


@dataclass
class CallBuild:
    call: CallInput
    num_prefix_tokens: int  # exact stored prefix
    pinned: list[str]  # span ids pinned for this call (unpin when it ends)
    namespace: str = ""
    framing: list[tuple[int, int]] = field(default_factory=list)  # prompt ranges no later run may match
    # the shared tier's fetch-or-recompute decisions of the lookups made here (``FetchDecision`` as dicts)
    tier_decisions: list[dict] = field(default_factory=list)


# a published completion's span id says where its output starts: "span-<origin>-<random>-p<prompt tokens>"
_OUTPUT_SPAN = re.compile(r"^span-[0-9a-f]+-[0-9a-f]+-p(\d+)$")
# tokens of spans learned from the shared tier kept in the index at once (its own spans are bounded by the store):
# as many as the announcements' own prefix index keeps spans (``tier.announce.RemoteSpans``), at 100 tokens each
MAX_LEARNED_TOKENS = 1_000_000


class SpanCatalog:
    def __init__(self, store: KVStore, fingerprint: str, block_len: int = 16, match: MatchConfig | None = None,
                 decode: Callable[[list[int]], str] | None = None, max_learned_tokens: int = MAX_LEARNED_TOKENS
                 ) -> None:
        """``decode``: the tokenizer's, so that completions other processes published to a shared tier
        join this process's output registry (without it, only their token runs are indexed)."""
        self.store = store
        self.match = match or MatchConfig()
        self.decode = decode
        self.fingerprint = fingerprint
        self.index = TokenIndex(block_len=block_len)
        self.registry = OutputRegistry()
        # the server tokenizes and matches requests on threads of their own while the engine thread publishes:
        # the index and the pins a lookup takes change under one lock (the store and the registry have their own)
        self._lock = threading.RLock()
        # span ids are unique across processes: replicas on one shared tier must never overwrite each other
        self._origin = uuid.uuid4().hex[:12]
        # spans learned from the tier: (namespace, span id) -> None, weighed by their tokens; those put out are
        # forgotten once its lock is released (``_unlearned``)
        self._unlearned: list[tuple[str, str]] = []
        self._learned = FairLru(max_learned_tokens,
                                on_evict=lambda namespace, span_id, _: self._unlearned.append((namespace, span_id)))

    def new_span_id(self, num_prompt_tokens: int | None = None) -> str:
        """A span id unique across processes; a completion's says where its output starts. Random per span, not a
        count: a tenant that sees its own span ids (``kvrelay.debug``) must not learn from their gaps how many
        completions other tenants got in between. Nothing orders spans by id (the index keeps its own order)."""
        span_id = f"span-{self._origin}-{secrets.token_hex(8)}"
        return span_id if num_prompt_tokens is None else f"{span_id}-p{num_prompt_tokens}"

    def owns(self, namespace: str, span_id: str) -> bool:
        return self.store.contains(span_id, namespace)

    def view(self, namespace: str, framing: list[tuple[int, int]] | tuple[()] = ()) -> CatalogView:
        """The store as one namespace sees it; ``framing``: ranges of the spans put through this view that no
        run may match (a call's ``CallBuild.framing``, for the span that publishes it)."""
        return CatalogView(self, namespace, framing)

    # ------------------------------------------------------------------ writes
    def put(self, namespace: str, span_id: str, span: SpanLike, pin: bool = False,
            framing: list[tuple[int, int]] | tuple[()] = ()) -> list[str]:
        """Store ``span`` in ``namespace`` (the store evicts only that namespace's spans to fit; a
        StoreFullError stores nothing) and index its tokens, the ``framing`` ranges left unmatchable."""
        with self._lock:
            evicted = self.store.put(span_id, span, pin, namespace)
            for victim in (*evicted, *self.store.take_reclaimed()):  # expired namespaces' spans too
                self._forget(victim)
            self.index.add(span_id, span.token_ids, namespace, framing)
            return evicted

    def register(self, output: RegisteredOutput) -> bool:
        return self.registry.add(output)

    def drop(self, namespace: str, span_id: str) -> None:
        with self._lock:
            if self.store.contains(span_id, namespace):
                self.store.remove(span_id, namespace)
            self._forget(span_id)

    def _forget(self, span_id: str) -> None:
        self.index.remove(span_id)
        self.registry.remove_span(span_id)

    # ------------------------------------------------------------------ lookups
    def build_call(self, prompt: PromptBuild, namespace: str, agent: str, role: str = "") -> CallBuild:
        """The call with its SpanRefs: quoted outputs (kind "output"), then the exact prefix, then the
        longest runs shared with stored spans (kind "input"); the spans they read are pinned."""
        with self._lock:
            # the lookups run on the calling (prepare) thread, whose decisions the engine never takes: taken here,
            # those of earlier work on this thread dropped first, so the call's debug object lists its own
            self.store.take_decisions()
            build = self._build_call(prompt, namespace, agent, role)
            build.tier_decisions = [asdict(d) for d in self.store.take_decisions()]
            return build

    def _build_call(self, prompt: PromptBuild, namespace: str, agent: str, role: str) -> CallBuild:
        ids = prompt.ids
        refs: list[SpanRef] = []
        covered: list[tuple[int, int]] = []
        for k, splice in enumerate(prompt.splices):
            out = splice.output
            if self.owns(namespace, out.span_id):
                refs.append(SpanRef(splice.start, splice.end, out.span_id, out.src_start, "output", f"output{k}"))
                covered.append((splice.start, splice.end))
        prefix = self.store.match_prefix(self.fingerprint, ids, namespace)
        num_prefix = 0 if prefix is None else min(prefix.num_tokens, len(ids) - 1)
        if num_prefix > 0:
            covered.append((0, num_prefix))
        framing = []
        if not self.match.match_framing and prompt.content_ranges is not None:
            framing = _framing(prompt.content_ranges, len(ids))
            covered += framing
        found = self.index.find(ids, namespace, self.match.min_match_tokens, covered, self.match.match_prefer)
        for k, m in enumerate(found):
            if self.owns(namespace, m.span_id):  # an index entry outliving its span is never used
                refs.append(SpanRef(m.start, m.end, m.span_id, m.src_start, "input", f"input{k}"))
        refs.sort(key=lambda r: r.start)
        pinned = sorted({r.span_id for r in refs} | ({prefix.span_id} if num_prefix > 0 else set()))
        for span_id in pinned:
            self.store.pin(span_id, namespace)
        return CallBuild(CallInput(ids, refs, agent, role), num_prefix, pinned, namespace, framing)

    def learn_published(self, namespace: str) -> int:
        """Index the spans other processes published to the shared tier in ``namespace`` since the last
        call (none without a tier), and register their completions; a hit on one is fetched when the
        tier's cost model says it pays. The server calls it once per request, before building the prompt."""
        published = self.store.poll_published(namespace, self.fingerprint)
        with self._lock:
            self._learn(namespace, published)
        return len(published)

    def _learn(self, namespace: str, published: list) -> None:
        for p in published:
            if p.start_pos != 0:
                continue
            self.index.add(p.span_id, p.token_ids, namespace)
            self._learned.put(namespace, p.span_id, None, max(1, len(p.token_ids)))
            m = _OUTPUT_SPAN.match(p.span_id)
            if m is not None and self.decode is not None and int(m[1]) < len(p.token_ids):
                output_ids = tuple(p.token_ids[int(m[1]):])
                self.registry.add(RegisteredOutput(self.decode(list(output_ids)), output_ids, p.span_id, int(m[1]),
                                                   namespace))
        for victim in self.store.take_reclaimed():  # evicted by a fetch from the tier, or with an idle namespace
            self._forget(victim)
        for ns, span_id in self._unlearned:
            if not KVStore.contains(self.store, span_id, ns):  # fetched into memory: the store's evictions tell
                self._forget(span_id)
        self._unlearned.clear()

    def unpin(self, built: CallBuild) -> None:
        with self._lock:
            for span_id in built.pinned:
                if self.store.contains(span_id, built.namespace) and self.store.is_pinned(span_id, built.namespace):
                    self.store.unpin(span_id, built.namespace)
            built.pinned = []


def _framing(content_ranges: list[tuple[int, int]], num_tokens: int) -> list[tuple[int, int]]:
    """The token ranges between contents (and before the first, after the last): the template's framing."""
    gaps, cursor = [], 0
    for start, end in content_ranges:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < num_tokens:
        gaps.append((cursor, num_tokens))
    return gaps


class CatalogView(StoreView):
    """One namespace of the store, as the engine and the methods see it; puts go through the catalog."""

    def __init__(self, catalog: SpanCatalog, namespace: str, framing: list[tuple[int, int]] | tuple[()] = ()) -> None:
        super().__init__(catalog.store, namespace)
        self.catalog, self.framing = catalog, framing

    def put(self, span_id: str, span: SpanLike, pin: bool = False) -> list[str]:
        return self.catalog.put(self.namespace, span_id, span, pin, self.framing)
