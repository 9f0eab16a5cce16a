"""The span store's bookkeeping: byte budget, pins, LRU eviction, exact prefix lookup, namespaces.

Pure Python, no torch: a span is any object with ``nbytes``, ``token_ids``, ``start_pos`` and
``fingerprint`` (``cache.kv.StoredSpan`` in practice), so this file is tested on toy objects.

Prefix lookup hashes token blocks in a chain, ``h_i = sha256(h_{i-1} || block_i)`` seeded with
the model fingerprint, so equal hashes mean equal prefixes of the same model (never Python's
``hash``: it is salted per process and 64-bit); ``cache.prefix_index`` finds the longest.

Namespaces partition the store (tenants of a server): a span put in one namespace is never
matched, read, pinned or evicted through another, because a shared cache leaks through timing.
An idle namespace expires whole after ``namespace_idle_s`` (see ``cache.tenancy`` for why by time
only). The default namespace ``""`` is what every caller that names none gets. One re-entrant lock guards
every operation, so one store may be shared by threads (a server's request handlers).
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.cache.prefix_index import PrefixIndex, PrefixMatch
from kvrelay.cache.tenancy import NamespaceLedger, check_idle_s
from kvrelay.cache.view import StoreView
from kvrelay.errors import KvRelayError, StoreFullError

DEFAULT_NAMESPACE = ""
# span ids ``take_reclaimed`` holds between two takes: far more spans than a store's budget holds
MAX_RECLAIMED_IDS = 100_000


class SpanNotFoundError(KvRelayError, KeyError):
    """A span id that is not in the store (never put, evicted, or put in another namespace)."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


class SpanLike(Protocol):
    nbytes: int
    token_ids: tuple[int, ...]
    start_pos: int
    fingerprint: str


@dataclass
class _Record:
    span: Any
    nbytes: int
    pins: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


def block_hashes(fingerprint: str, token_ids: tuple[int, ...] | list[int], block_len: int) -> list[bytes]:
    """Chained sha256 of each full block of ``token_ids``."""
    out: list[bytes] = []
    prev = hashlib.sha256(fingerprint.encode()).digest()
    for start in range(0, len(token_ids) - block_len + 1, block_len):
        prev = hashlib.sha256(prev + array("q", token_ids[start : start + block_len]).tobytes()).digest()
        out.append(prev)
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_name(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise KvRelayError(f"{kind} must be a string, got {type(value).__name__}")
    return value


def check_span(span_id: object, span: object) -> int:
    """The span's size in bytes, after checking what the bookkeeping relies on."""
    if not isinstance(span_id, str) or not span_id:
        raise KvRelayError(f"span id must be a non-empty string, got {span_id!r}")
    nbytes = getattr(span, "nbytes", None)
    if not _is_int(nbytes) or nbytes < 0:
        raise KvRelayError(f"span {span_id!r}: nbytes must be a non-negative int, got {nbytes!r}")
    start_pos = getattr(span, "start_pos", None)
    if not _is_int(start_pos) or start_pos < 0:
        raise KvRelayError(f"span {span_id!r}: start_pos must be a non-negative int, got {start_pos!r}")
    token_ids = getattr(span, "token_ids", None)
    if not isinstance(token_ids, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in token_ids):
        raise KvRelayError(f"span {span_id!r}: token_ids must be a tuple of non-negative ints")
    if not isinstance(getattr(span, "fingerprint", None), str):
        raise KvRelayError(f"span {span_id!r}: fingerprint must be a string")
    return nbytes


class KVStore:
    """Spans by id under a byte budget. Pinned spans are never evicted; others go least recent first.

    Eviction only takes spans of the namespace being put into; ``namespace_budget_bytes`` (optional)
    caps what one namespace may hold, so one tenant cannot fill the store for all; a namespace with no
    pinned span, unused for ``namespace_idle_s`` (optional), is dropped whole.
    """

    def __init__(self, budget_bytes: int, block_len: int = 16, namespace_budget_bytes: int | None = None,
                 namespace_idle_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not _is_int(budget_bytes) or budget_bytes <= 0:
            raise KvRelayError(f"store budget must be a positive int, got {budget_bytes!r} bytes")
        if not _is_int(block_len) or block_len <= 0:
            raise KvRelayError(f"store block_len must be a positive int, got {block_len!r}")
        if namespace_budget_bytes is not None and (not _is_int(namespace_budget_bytes) or namespace_budget_bytes <= 0):
            raise KvRelayError(f"namespace budget must be a positive int, got {namespace_budget_bytes!r} bytes")
        self.budget_bytes = budget_bytes
        self.block_len = block_len
        self.namespace_budget_bytes = namespace_budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        # spans evicted for room, a count: put() returns each eviction's ids, and a list kept here grew for the
        # server's whole life
        self.num_evicted = 0
        self._lock = threading.RLock()
        # namespace -> span id -> record, oldest use first; eviction never looks past one namespace
        self._spaces: dict[str, OrderedDict[str, _Record]] = {DEFAULT_NAMESPACE: OrderedDict()}
        self.tenants = NamespaceLedger(namespace_idle_s, clock)
        self._ns_bytes = self.tenants.bytes
        # ids dropped with their idle namespace or evicted by a fetch from a shared tier, until take_reclaimed (the
        # server's catalog takes them on every put); bounded for a store whose owner never takes them
        self._reclaimed: deque[str] = deque(maxlen=MAX_RECLAIMED_IDS)
        # spans at position 0 by block hash; hashes are seeded with the namespace too, so they never cross
        self._prefixes = PrefixIndex(block_len)

    def set_namespace_idle_s(self, idle_s: float | None) -> None:
        with self._lock:
            self.tenants.idle_s = check_idle_s(idle_s)

    def _enter(self, namespace: str | None = None) -> None:
        """Drop the namespaces that have expired, then mark ``namespace`` (if it holds spans) as used."""
        for ns in self.tenants.idle():
            self._reclaimed.extend(self._spaces[ns])
            for span_id in list(self._spaces[ns]):
                self._drop(span_id, ns)
            self.tenants.num_reclaimed += 1
        if namespace is not None:
            self.tenants.touch(namespace)

    def take_reclaimed(self) -> list[str]:
        """Ids of the spans dropped since the last call that no ``put`` returned: an expired namespace's, and those a
        fetch from a shared tier evicted (for indexes to forget)."""
        with self._lock:
            self._enter()
            out = list(self._reclaimed)
            self._reclaimed.clear()
            return out

    @property
    def _records(self) -> OrderedDict[str, _Record]:
        """The default namespace's records."""
        return self._spaces[DEFAULT_NAMESPACE]

    def _hashes(self, fingerprint: str, namespace: str, token_ids: tuple[int, ...] | list[int]) -> list[bytes]:
        seed = fingerprint if namespace == DEFAULT_NAMESPACE else f"{fingerprint}\0namespace:{namespace}"
        return block_hashes(seed, token_ids, self.block_len)

    # ------------------------------------------------------------------ basic access
    def __contains__(self, span_id: str) -> bool:
        return self.contains(span_id)

    def contains(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        with self._lock:
            self._enter(namespace)
            space = self._spaces.get(namespace)
            return space is not None and span_id in space

    def __len__(self) -> int:
        with self._lock:
            self._enter()
            return sum(len(space) for space in self._spaces.values())

    def ids(self, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
        """Span ids of ``namespace``, least recently used first."""
        with self._lock:
            self._enter()
            return list(self._spaces.get(namespace, ()))

    def namespaces(self) -> list[str]:
        with self._lock:
            self._enter()
            return [ns for ns, space in self._spaces.items() if space]

    def namespace_bytes(self, namespace: str = DEFAULT_NAMESPACE) -> int:
        with self._lock:
            self._enter()
            return self._ns_bytes.get(namespace, 0)

    def view(self, namespace: str) -> StoreView:
        """This store as seen from one namespace (the interface the reuse methods take)."""
        return StoreView(self, check_name("namespace", namespace))

    def _record(self, span_id: str, namespace: str, action: str) -> _Record:
        rec = self._spaces.get(namespace, {}).get(span_id)
        if rec is None:
            raise SpanNotFoundError(f"{action} {span_id!r}: it is not in the store (never put, or evicted)")
        return rec

    def get(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> Any:
        """The span, marked as just used."""
        with self._lock:
            self._enter(namespace)
            rec = self._record(span_id, namespace, "cannot get span")
            self._spaces[namespace].move_to_end(span_id)
            return rec.span

    def put(self, span_id: str, span: SpanLike, pin: bool = False, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
        """Store ``span`` (replacing one of the same id); evict LRU unpinned spans to fit.

        Returns the ids evicted (all of ``namespace``). Raises StoreFullError, evicting nothing, when
        even evicting every unpinned span of the namespace would not make room.
        """
        nbytes = check_span(span_id, span)
        check_name("namespace", namespace)
        hashes = self._hashes(span.fingerprint, namespace, span.token_ids) if span.start_pos == 0 else []
        with self._lock:
            self._enter(namespace)
            space = self._spaces.get(namespace, OrderedDict())  # kept in _spaces only once the span is in
            old = space.get(span_id)
            pins = old.pins if old else 0
            freed_by_replace = old.nbytes if old else 0
            evictable = sum(r.nbytes for sid, r in space.items() if r.pins == 0 and sid != span_id)
            if self._overflow(namespace, nbytes - freed_by_replace) > evictable:
                others = self.used_bytes - self._ns_bytes.get(namespace, 0)
                full = self._overflow(namespace, nbytes - freed_by_replace, quota=False) > evictable
                self.tenants.num_refused["store_full" if full else "quota"] += 1
                raise StoreFullError(
                    f"span {span_id!r} needs {nbytes} bytes; the store has {self.budget_bytes - self.used_bytes} "
                    f"free of {self.budget_bytes} and only {evictable} bytes of unpinned spans to evict"
                    + (f" in namespace {namespace!r} ({others} bytes belong to other namespaces)" if others else "")
                )
            if old is not None:
                self._drop(span_id, namespace)
            evicted = []
            while self._overflow(namespace, nbytes) > 0:
                victim = next(sid for sid, r in space.items() if r.pins == 0)
                self._drop(victim, namespace)
                self.num_evicted += 1
                evicted.append(victim)
            self._prefixes.add(span_id, hashes)  # only a span that starts at position 0 has hashes
            space = self._spaces.setdefault(namespace, space)  # new, or emptied and removed by the drops above
            space[span_id] = _Record(span, nbytes, pins + (1 if pin else 0), hashes)
            self.used_bytes += nbytes
            self.tenants.add(namespace, nbytes, pins + (1 if pin else 0))
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return evicted

    def _overflow(self, namespace: str, extra_bytes: int, quota: bool = True) -> int:
        """Bytes to free so that ``extra_bytes`` more fit both the store and the namespace budget."""
        over = self.used_bytes + extra_bytes - self.budget_bytes
        if quota and self.namespace_budget_bytes is not None:
            over = max(over, self._ns_bytes.get(namespace, 0) + extra_bytes - self.namespace_budget_bytes)
        return over

    def remove(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        with self._lock:
            self._enter()
            self._record(span_id, namespace, "cannot remove span")
            self._drop(span_id, namespace)

    def _drop(self, span_id: str, namespace: str) -> None:
        rec = self._spaces[namespace].pop(span_id)
        self.used_bytes -= rec.nbytes
        self.tenants.sub(namespace, rec.nbytes, rec.pins)
        if not self._spaces[namespace]:
            self.tenants.forget(namespace)
            if namespace != DEFAULT_NAMESPACE:  # a namespace per client salt: an emptied one is not kept
                del self._spaces[namespace]
        self._prefixes.remove(span_id, rec.block_hashes)

    # ------------------------------------------------------------------ pins
    def pin(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        with self._lock:
            self._enter(namespace)
            self._record(span_id, namespace, "cannot pin").pins += 1
            self.tenants.pins[namespace] += 1

    def unpin(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        with self._lock:
            self._enter(namespace)  # its idle time starts when its last request ends
            rec = self._spaces.get(namespace, {}).get(span_id)
            if rec is None or rec.pins == 0:
                raise KvRelayError(f"cannot unpin {span_id!r}: it is not pinned")
            rec.pins -= 1
            self.tenants.pins[namespace] -= 1

    def is_pinned(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        with self._lock:
            self._enter()
            return self._record(span_id, namespace, "cannot tell whether it is pinned:").pins > 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, fingerprint: str, token_ids: list[int] | tuple[int, ...],
                     namespace: str = DEFAULT_NAMESPACE) -> PrefixMatch | None:
        """The span of ``namespace`` sharing the longest exact prefix with ``token_ids`` (same model), its length
        exact (``cache.prefix_index``)."""
        hashes = self._hashes(fingerprint, namespace, token_ids)
        with self._lock:
            self._enter(namespace)
            space = self._spaces.get(namespace, {})
            return self._prefixes.longest(hashes, token_ids, lambda span_id: space[span_id].span.token_ids)

    # ------------------------------------------------------------------ the shared tier's hooks
    # A memory-only store has no tier: these keep one calling code for every store (see kvrelay.tier).
    def set_compute_rate(self, token_layers_per_s: float | None) -> None:
        """The engine's prefill rate, for the fetch-or-recompute decision (no tier: nothing to decide)."""

    def set_fingerprint(self, fingerprint: str) -> None:
        """The model whose spans this process looks up in a shared tier."""

    def take_decisions(self) -> list:
        """Fetch/recompute decisions of this thread since its last call (none without a tier)."""
        return []

    def poll_published(self, namespace: str = DEFAULT_NAMESPACE, fingerprint: str | None = None,
                       include_own: bool = False) -> list:
        """Spans other processes published (none without a shared tier)."""
        return []

    def sync(self) -> int:
        return 0

    def check_invariants(self) -> None:
        """Raise AssertionError unless the byte counters equal the live spans' sizes (for tests)."""
        with self._lock:
            live = {ns: sum(r.nbytes for r in space.values()) for ns, space in self._spaces.items() if space}
            assert self.used_bytes == sum(live.values()) <= self.budget_bytes, (self.used_bytes, live)
            assert self._ns_bytes == live, (self._ns_bytes, live)
            pins = {ns: sum(r.pins for r in space.values()) for ns, space in self._spaces.items() if space}
            emptied = [ns for ns, space in self._spaces.items() if not space and ns != DEFAULT_NAMESPACE]
            assert not emptied, f"{len(emptied)} emptied namespaces still kept"
            assert self.tenants.pins == pins and len(self.tenants) == len(live), (self.tenants.pins, pins)
            if self.namespace_budget_bytes is not None:
                assert all(n <= self.namespace_budget_bytes for n in live.values())
