"""The tiered store: the memory tier (``KVStore``: budget, pins, LRU) in front of a shared tier.

A span put here is kept in memory and written through to the shared tier (disk or Redis), where
every process opening the same URL finds it. A span asked for (``span_id in store``) that is not
in memory is looked up in the tier; the cost model decides whether fetching it pays over
recomputing its tokens, and every such decision is recorded (``take_decisions``). The tier never
fails a request: an unreachable or slow tier, a corrupt value, another model's value — each is a
miss (a warning where data was bad, one log line when the tier goes down and one when it is back);
while it is down no call touches it, and a prober thread (``TierHealth``) marks it up once it answers
again. A bad record (an announcement, metadata or value that does not decode) is skipped and counted in
``bad_records``, never taken for the tier being down: the tier goes on serving and storing every other record.

Spans published elsewhere are announced in the tier; ``poll_published`` and ``on_published`` +
``sync`` hand them to whoever indexes spans (the any-offset block index).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from kvrelay.cache.store import DEFAULT_NAMESPACE, KVStore, PrefixMatch, SpanLike, SpanNotFoundError
from kvrelay.errors import ConfigError, StoreFullError
from kvrelay.tier.announce import PublishedSpan, RemoteSpans, announcement
from kvrelay.tier.backends.base import TierBackend, channel_key, span_key
from kvrelay.tier.bad_records import BadRecords
from kvrelay.tier.fetch_cost import DecisionLog, FetchCostModel, FetchDecision
from kvrelay.tier.health import TierDown, TierHealth
from kvrelay.tier.store_url import parse_store_url
from kvrelay.tier.wire import SpanMeta, WireError, decode_span, encode_span
from kvrelay.tier.writer import TierWriter

log = logging.getLogger("kvrelay.tier")
_MAX_UNWRITTEN = 100_000  # spans remembered for writing once the tier is back (oldest forgotten first)
# (namespace, model) announcement channels whose read position is kept, least recently polled out first: a
# ``cache_salt`` per conversation polls a new channel each time. A channel polled again after being forgotten is
# read from its start, as a new process reads it (announcements are hints; the remote index is bounded)
MAX_POLLED_CHANNELS = 4096


class TieredStore(KVStore):
    """``KVStore`` whose misses may be served by a shared tier (see the module docstring)."""

    def __init__(self, budget_bytes: int, backend: TierBackend, fingerprint: str | None = None,
                 block_len: int = 16, namespace_budget_bytes: int | None = None,
                 compute_token_layers_per_s: float | None = None,
                 min_backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 remote_prefix_poll_s: float | None = 1.0, max_polled_channels: int = MAX_POLLED_CHANNELS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` (seconds): times the tier's reads for the cost model, the announcement polls and how long the
        tier has been down; a test passes its own to make every measured number exact."""
        super().__init__(budget_bytes, block_len, namespace_budget_bytes)
        if max_polled_channels < 1:
            raise ConfigError(f"max_polled_channels must be >= 1, got {max_polled_channels}")
        self.backend = backend
        self.url = backend.url
        self.fingerprint = fingerprint  # the model whose spans ``span_id in store`` looks up in the tier
        self.clock = clock
        self.cost = FetchCostModel(compute_token_layers_per_s)
        self.decisions = DecisionLog()
        # a down tier is probed (``backend.ping``) between these intervals, on the prober's thread, never a caller's
        self.health = TierHealth(backend.url, min_backoff_s, max_backoff_s, clock=clock, probe=backend.ping)
        self.origin = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # (namespace, model) -> (its announcements' read position, when it was last polled), least recent first
        self._channels: OrderedDict[tuple[str, str], tuple[str | None, float]] = OrderedDict()
        self.max_polled_channels = max_polled_channels
        # put while the tier was down or for the writer (None: written if still in memory then), or deferred (the span
        # itself: a deferred write is owed, even if memory evicts the span before the caller flushes)
        self._unwritten: OrderedDict[tuple[str, str], SpanLike | None] = OrderedDict()
        self._deferring = threading.local()  # ``writes_deferred``: this thread's puts skip the tier for now
        # writes the tier on a thread of its own (kvrelay.tier.writer); None: each put writes on its caller's thread
        self.writer: TierWriter | None = None
        self.remote = RemoteSpans(self._hashes, block_len)
        # match_prefix reads new announcements at most this often (None: never, memory prefixes only)
        self.remote_prefix_poll_s = remote_prefix_poll_s
        self._listeners: list[tuple[str, Callable[[PublishedSpan], Any]]] = []
        self._poll_lock = threading.Lock()
        self._bad = BadRecords(self.url)  # span records that did not decode: counted once, skipped afterwards

    # ------------------------------------------------------------------ settings the engine gives
    def set_compute_rate(self, token_layers_per_s: float | None) -> None:
        """This model's measured prefill rate on this device (the other side of the cost model)."""
        self.cost.set_compute_rate(token_layers_per_s)

    def set_fingerprint(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint

    @property
    def bad_records(self) -> dict[str, int]:
        """Records of the tier skipped as unreadable since this store opened, by kind: announcements (lines or
        entries the backend could not read, and messages that are not announcements), span metadata, span values."""
        return {"announcement": getattr(self.backend, "num_bad_records", 0) + self.remote.num_bad,
                **self._bad.num_by_kind}

    def take_decisions(self) -> list[FetchDecision]:
        """Fetch/recompute decisions made by this thread since its last call, oldest first."""
        return self.decisions.take()

    # ------------------------------------------------------------------ tier access, never raising
    def _tier(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self.health.call(what, fn, *args)

    def _miss(self, span_id: str, namespace: str, reason: str, **inputs: Any) -> None:
        self.decisions.record(FetchDecision(span_id, namespace, "miss", reason, **inputs))

    def _fetch(self, span_id: str, namespace: str, decide: bool) -> Any | None:
        """The span from the tier, now also in memory; None on a miss or when recomputing pays."""
        fp = self.fingerprint
        if fp is None:
            self._miss(span_id, namespace, "no model fingerprint set (set_fingerprint)")
            return None
        key = span_key(namespace, fp, span_id)
        if self._bad.known(key):
            self._miss(span_id, namespace, "a bad record, skipped")
            return None
        try:
            t0 = self.clock()
            raw_meta = self._tier("read metadata", self.backend.get_meta, key)
            self.cost.observe_latency(self.clock() - t0)
        except TierDown as e:
            self._miss(span_id, namespace, str(e) or "tier unavailable")
            return None
        if raw_meta is None:
            self._miss(span_id, namespace, "not in the tier")
            return None
        try:
            meta = SpanMeta.from_bytes(raw_meta)
        except WireError as e:
            self._bad.add(key, "metadata", str(e))
            self._miss(span_id, namespace, "corrupt metadata")
            return None
        if (meta.span_id, meta.namespace, meta.fingerprint) != (span_id, namespace, fp):
            self._miss(span_id, namespace, "metadata of another span, namespace or model")
            return None
        if decide:
            decision = self.cost.decide(span_id, namespace, meta.num_tokens, meta.num_layers, meta.value_bytes)
        else:
            decision = FetchDecision(span_id, namespace, "fetch", "asked for by get/pin", meta.num_tokens,
                                     meta.num_layers, meta.value_bytes)
        if decision.action != "fetch":
            self.decisions.record(decision)
            return None
        t0 = self.clock()
        try:
            value = self._tier("read value", self.backend.get_value, key)
        except TierDown as e:
            self.decisions.record(replace(decision, action="miss", reason=str(e) or "tier unavailable"))
            return None
        if value is None:
            self.decisions.record(replace(decision, action="miss", reason="value gone from the tier (evicted)"))
            return None
        try:
            span = decode_span(value, span_id, namespace, fp)
        except WireError as e:
            self._bad.add(key, "value", str(e))
            self.decisions.record(replace(decision, action="miss", reason="corrupt value"))
            return None
        fetch_s = self.clock() - t0
        self.cost.observe_fetch(len(value), fetch_s)
        try:
            evicted = KVStore.put(self, span_id, span, False, namespace)
            with self._lock:  # no caller's put returns these: indexes learn of them from ``take_reclaimed``
                self._reclaimed.extend(evicted)
        except StoreFullError:
            self.decisions.record(replace(decision, action="recompute", reason="no room in the memory tier"))
            return None
        self.decisions.record(replace(decision, fetch_ms=fetch_s * 1e3))
        return span

    # ------------------------------------------------------------------ the KVStore interface
    def contains(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        """In memory, or fetched from the tier now because that pays (see ``take_decisions``)."""
        return super().contains(span_id, namespace) or self._fetch(span_id, namespace, decide=True) is not None

    def get(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> Any:
        try:
            return super().get(span_id, namespace)
        except SpanNotFoundError:
            span = self._fetch(span_id, namespace, decide=False)
            if span is None:
                raise
            return span

    def pin(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        if not super().contains(span_id, namespace):
            self._fetch(span_id, namespace, decide=False)
        super().pin(span_id, namespace)

    def put(self, span_id: str, span: SpanLike, pin: bool = False, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
        """Into memory (as ``KVStore.put``), then written through to the tier and announced there."""
        evicted = super().put(span_id, span, pin, namespace)
        if self.fingerprint is None:
            self.fingerprint = span.fingerprint
        if getattr(self._deferring, "active", False):  # written by the caller's ``flush_unwritten``
            with self._lock:
                self._unwritten[(namespace, span_id)] = span
            return evicted
        writer = self.writer
        if writer is not None:  # owed to the tier while the span is in memory; the writer writes it
            with self._lock:
                self._unwritten.setdefault((namespace, span_id), None)
                self._forget_oldest_unwritten()
            writer.wake()
            return evicted
        if self._write_through(span_id, span, namespace):
            self.flush_unwritten()
        return evicted

    @contextmanager
    def writes_deferred(self) -> Iterator[None]:
        """Puts by this thread inside the block go to memory only, their tier write and announcement left to
        ``flush_unwritten``: a caller holding a lock that others wait on writes to the tier after releasing it."""
        self._deferring.active = True
        try:
            yield
        finally:
            self._deferring.active = False

    def _write_through(self, span_id: str, span: SpanLike, namespace: str) -> bool:
        """Write and announce ``span`` in the tier; False (and remembered for later) when the tier is down."""
        try:
            value, meta = encode_span(span, span_id, namespace)
        except (WireError, AttributeError, TypeError) as e:  # not a tensor span: it stays in memory only
            log.warning("span %r is kept in memory only: %s", span_id, e)
            return True
        message = announcement(span_id, span.token_ids, span.start_pos, self.origin)
        key = span_key(namespace, span.fingerprint, span_id)
        try:
            self._tier("write", self.backend.put, key, value, meta.to_bytes())
            self._bad.forget(key)  # written anew: a later lookup reads it
            self._tier("announce", self.backend.announce, channel_key(namespace, span.fingerprint), message)
        except TierDown as e:
            with self._lock:
                if str(e) == "tier refused":  # this span will not fit: give up on it
                    self._unwritten.pop((namespace, span_id), None)
                else:  # down: write it when the tier is back, if it is still in memory then
                    self._unwritten[(namespace, span_id)] = None
                    self._forget_oldest_unwritten()
            return False
        with self._lock:
            self._unwritten.pop((namespace, span_id), None)
        return True

    def _forget_oldest_unwritten(self) -> None:
        """Bound what is remembered for the tier (under ``_lock``)."""
        while len(self._unwritten) > _MAX_UNWRITTEN:
            self._unwritten.popitem(last=False)

    @property
    def num_unwritten(self) -> int:
        """Spans put but not yet in the tier: the writer's backlog, or what waits for a down tier."""
        return len(self._unwritten)

    def flush_unwritten(self) -> int:
        """Write the spans published while the tier was down (those still in memory); returns how many.

        Runs after every successful write-through and at ``sync``, so a tier that comes back (or a
        Redis restarted empty) gets them without anyone asking.
        """
        written = 0
        while True:
            with self._lock:
                if not self._unwritten:
                    return written
                (namespace, span_id), owed = next(iter(self._unwritten.items()))
                rec = self._spaces.get(namespace, {}).get(span_id)
                span = rec.span if rec is not None else owed
                if span is None:  # evicted or removed meanwhile: nothing to write
                    del self._unwritten[(namespace, span_id)]
                    continue
            if self._write_through(span_id, span, namespace):
                written += 1
            elif (namespace, span_id) in self._unwritten:  # the tier is down again: later
                return written

    def delete_from_tier(self, span_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        """Remove a span from the shared tier (``remove`` only frees this process's memory copy)."""
        if self.fingerprint is None:
            return False
        try:
            self._tier("delete", self.backend.delete, span_key(namespace, self.fingerprint, span_id))
            return True
        except TierDown:
            return False

    # ------------------------------------------------------------------ announcements (for the index)
    def poll_published(self, namespace: str = DEFAULT_NAMESPACE, fingerprint: str | None = None,
                       include_own: bool = False) -> list[PublishedSpan]:
        """Spans announced in the tier for ``namespace`` and model since this store's last poll.

        The first poll returns everything still announced (so a new process learns the tier's spans).
        An announcement is a hint: the span may have been evicted since (then a lookup misses).
        """
        fp = fingerprint or self.fingerprint
        if fp is None:
            return []
        self._pull(namespace, fp)
        return [p for p in self.remote.take(namespace, fp) if include_own or p.origin != self.origin]

    def _pull(self, namespace: str, fingerprint: str) -> None:
        """Read new announcements into ``self.remote`` (queued for ``poll_published``, prefix-indexed)."""
        with self._poll_lock:
            key = (namespace, fingerprint)
            cursor, _ = self._channels.pop(key, (None, 0.0))
            now = self.clock()
            self._channels[key] = (cursor, now)
            while len(self._channels) > self.max_polled_channels:
                self.remote.forget_channel(*self._channels.popitem(last=False)[0])
            try:
                messages, cursor = self._tier("poll", self.backend.poll, channel_key(namespace, fingerprint), cursor)
            except TierDown:
                return
            self._channels[key] = (cursor, now)
            self.remote.add(namespace, fingerprint, messages)

    @property
    def num_polled_channels(self) -> int:
        return len(self._channels)

    def match_prefix(self, fingerprint: str, token_ids: list[int] | tuple[int, ...],
                     namespace: str = DEFAULT_NAMESPACE) -> PrefixMatch | None:
        """The longest exact prefix in memory, or a longer one another process announced (fetched now,
        if the cost model agrees)."""
        best = super().match_prefix(fingerprint, token_ids, namespace)
        if self.remote_prefix_poll_s is None or fingerprint != self.fingerprint:
            return best
        last_pull = self._channels.get((namespace, fingerprint), (None, float("-inf")))[1]
        if self.clock() - last_pull >= self.remote_prefix_poll_s:
            self._pull(namespace, fingerprint)
        remote = self.remote.match(fingerprint, token_ids, namespace)
        if remote is None or (best is not None and remote.num_tokens <= best.num_tokens):
            return best
        if self.contains(remote.span_id, namespace):
            return remote
        last = self.decisions.last()
        if last is not None and last.action == "miss":
            self.remote.forget(namespace, remote.span_id)  # gone from the tier: stop offering it
        return best

    def on_published(self, callback: Callable[[PublishedSpan], Any], namespace: str = DEFAULT_NAMESPACE) -> None:
        """Call ``callback`` for each span of ``namespace`` published elsewhere, at every ``sync``."""
        self._listeners.append((namespace, callback))

    def sync(self) -> int:
        """Write what waits for the tier, then poll the announcements of every namespace with a listener;
        returns how many announcements were delivered."""
        self.flush_unwritten()
        delivered = 0
        for namespace in dict.fromkeys(ns for ns, _ in self._listeners):
            for span in self.poll_published(namespace):
                for ns, callback in self._listeners:
                    if ns == namespace:
                        callback(span)
                        delivered += 1
        return delivered

    def close(self) -> None:
        if self.writer is not None:
            self.writer.stop()
        self.health.close()
        try:
            self.backend.close()
        except Exception:  # closing a dead connection is not worth an error
            pass


def open_store(url: str | None, budget_bytes: int, *, fingerprint: str | None = None, block_len: int = 16,
               namespace_budget_bytes: int | None = None, timeout_s: float = 1.0,
               compute_token_layers_per_s: float | None = None) -> KVStore:
    """A store for ``url``: None or ``memory`` (memory only), ``disk:PATH``, ``redis://[user:pass@]host:port/db``.

    ``budget_bytes`` bounds the memory tier; the shared tier is bounded by its own configuration
    (Redis ``maxmemory``). Credentials in ``url`` never appear in a message (``redact``).
    """
    spec = parse_store_url(url)
    if spec.kind == "memory":
        return KVStore(budget_bytes, block_len, namespace_budget_bytes)
    if spec.kind == "disk":
        from kvrelay.tier.backends.disk import DiskBackend

        backend: TierBackend = DiskBackend(spec.location)
    else:
        from kvrelay.tier.backends.redis import RedisBackend

        backend = RedisBackend(spec.location, timeout_s=timeout_s)
    store = TieredStore(budget_bytes, backend, fingerprint, block_len, namespace_budget_bytes,
                        compute_token_layers_per_s)
    if hasattr(backend, "client"):
        try:  # an unreachable server is logged now, once, rather than at the first request
            store._tier("connect", backend.ping)
        except TierDown:
            pass
    store.health.watch()  # an idle process too finds the tier down within one ping interval
    return store
