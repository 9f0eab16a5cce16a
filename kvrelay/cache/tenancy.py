"""Tenants of one span store: each namespace's bytes, pins and last use, and when an idle one expires.

Why expiry goes by time only. A shared cache leaks through timing: a tenant that sees its own cache
hits disappear learns that someone else stored something. So the store never evicts one namespace's
spans for another's put (eviction for room takes the putting namespace's own least recent spans,
within an optional per-namespace quota), and a namespace is dropped whole only once it has had no
pinned span and no use for ``idle_s`` seconds, whether the store is under pressure or not: whether a
tenant's spans are still there depends on its own last use alone. Reclaiming idle namespaces early
*under pressure* would tell a returning tenant that others filled the store while it was away, so
it is not done.

What stays observable: a put that finds the store full of other namespaces' live spans is refused
(counted in ``num_refused``), so a tenant can tell that the store is full right now (the others'
total bytes, never which prompts they hold).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvrelay.errors import ConfigError, KvRelayError

GIB = 1 << 30


@dataclass(frozen=True)
class TenancyConfig:
    """The store's per-namespace knobs (``kvrelay serve`` flags are derived from these fields)."""

    kv_namespace_budget_gb: float | None = field(default=None, metadata={"help": (
        "cap on the KV one namespace (API key / cache_salt) may hold, in GiB; a namespace at its cap "
        "evicts its own least recent spans (default: no cap, the store's budget)")})
    kv_namespace_idle_s: float = field(default=300.0, metadata={"help": (
        "seconds a namespace with no running request may go unused before all its spans are dropped, "
        "freeing room for new tenants; 0 keeps them until their own namespace evicts them. The default "
        "is the 5-minute cache lifetime hosted LLM APIs document")})

    def __post_init__(self) -> None:
        budget, idle = self.kv_namespace_budget_gb, self.kv_namespace_idle_s
        if budget is not None and not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
            raise ConfigError(f"--kv-namespace-budget-gb must be a positive number of GiB, got {budget!r}")
        if not (isinstance(idle, (int, float)) and math.isfinite(idle) and idle >= 0):
            raise ConfigError(f"--kv-namespace-idle-s must be a number of seconds >= 0, got {idle!r}")

    @property
    def namespace_budget_bytes(self) -> int | None:
        return None if self.kv_namespace_budget_gb is None else int(self.kv_namespace_budget_gb * GIB)

    @property
    def idle_s(self) -> float | None:
        return self.kv_namespace_idle_s or None


def check_idle_s(idle_s: object) -> float | None:
    if idle_s is None:
        return None
    if isinstance(idle_s, bool) or not isinstance(idle_s, (int, float)) or not math.isfinite(idle_s) or idle_s <= 0:
        raise KvRelayError(f"namespace idle time must be a positive number of seconds or None, got {idle_s!r}")
    return float(idle_s)


class NamespaceLedger:
    """Bytes, pin counts and last use of every namespace that holds a span (the store's lock guards it)."""

    def __init__(self, idle_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = check_idle_s(idle_s)
        self.clock = clock
        self.bytes: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self._last_used: OrderedDict[str, float] = OrderedDict()  # least recently used first
        self.num_reclaimed = 0  # namespaces dropped for being idle
        self.num_refused = {"quota": 0, "store_full": 0}  # puts refused, by what was full

    def __len__(self) -> int:
        return len(self._last_used)

    def add(self, namespace: str, nbytes: int, pins: int) -> None:
        self.bytes[namespace] = self.bytes.get(namespace, 0) + nbytes
        self.pins[namespace] = self.pins.get(namespace, 0) + pins
        self.touch(namespace, create=True)

    def sub(self, namespace: str, nbytes: int, pins: int) -> None:
        self.bytes[namespace] -= nbytes
        self.pins[namespace] -= pins

    def forget(self, namespace: str) -> None:
        """The namespace holds no span any more."""
        self.bytes.pop(namespace, None)
        self.pins.pop(namespace, None)
        self._last_used.pop(namespace, None)

    def touch(self, namespace: str, create: bool = False) -> None:
        if create or namespace in self._last_used:
            self._last_used[namespace] = self.clock()
            self._last_used.move_to_end(namespace)

    def idle(self) -> list[str]:
        """Namespaces to drop now: no pinned span, unused for ``idle_s`` or longer (oldest first)."""
        if self.idle_s is None:
            return []
        cutoff = self.clock() - self.idle_s
        out = []
        for namespace, last_used in self._last_used.items():
            if last_used > cutoff:
                break
            if self.pins.get(namespace, 0) == 0:  # a running request's namespace is in use
                out.append(namespace)
        return out


# What a reuse method learns across calls (KVCOMM's anchor pools) is keyed by the agent or
# role that taught it. Keyed so alone, one tenant's calls would serve another's: whether a tenant's call passes the
# gate (its cached tokens, its fallback text) would tell it which documents another tenant sent. So every such key
# carries the namespace of the store view the call runs on. The default namespace keeps the bare key (pipelines and
# benchmarks, which run in no namespace, see the keys they always did); a namespace's keys are
# "<namespace>\0<key>": namespaces are digests ("k<hex>/s<hex>") and agent names come from HTTP headers or
# pipeline specs, neither of which can hold a NUL, so no key of one namespace equals a key of another.
NAMESPACE_SEPARATOR = "\0"


def namespace_for(key_digest: str | None, salt_digest: str | None) -> str:
    """The namespace of a request: its API key's digest (``k<hex>``, when the server has keys) and its
    ``cache_salt``'s (``s<hex>``), "/"-joined; "" with neither."""
    parts = ([f"k{key_digest}"] if key_digest else []) + ([f"s{salt_digest}"] if salt_digest else [])
    return "/".join(parts)


def tenant_of(namespace: str) -> str:
    """The API key's part of a ``namespace_for`` namespace (the tenant: a salt is below it), "" when it has none."""
    head = namespace.split("/", 1)[0]
    return head if head.startswith("k") else ""


def namespace_of(store: object) -> str:
    """The namespace ``store`` is bound to: a ``StoreView``'s (the server's ``CatalogView``), else the default ""
    (a whole store, or none)."""
    namespace = getattr(store, "namespace", None)
    return namespace if isinstance(namespace, str) else ""


def scoped_key(namespace: str, key: str) -> str:
    """``key`` as learned state of ``namespace`` keeps it: the bare key in the default namespace."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{key}" if namespace else key


def key_namespace(key: str) -> str:
    """The namespace a ``scoped_key`` belongs to."""
    namespace, sep, _ = key.partition(NAMESPACE_SEPARATOR)
    return namespace if sep else ""


def unscoped_key(key: str) -> str:
    """The key a ``scoped_key`` was made from (what a message to the namespace's own client may show)."""
    _, sep, rest = key.partition(NAMESPACE_SEPARATOR)
    return rest if sep else key


def expired_keys(keys: Iterable[str], store: object) -> list[str]:
    """The ``scoped_key``s among ``keys`` whose namespace ``store`` (or the store behind a view) holds no span of any
    more: expired for being idle, or emptied by its own evictions. What a method learned from a namespace lives as
    long as the namespace does, so tenants that come and go (``cache_salt`` is the client's choice) do not pile up
    learned state; whether it goes depends on that namespace's own use alone. Default-namespace keys never expire."""
    base = getattr(store, "store", store)
    namespaces = getattr(base, "namespaces", None)
    if not callable(namespaces):
        return []
    live = set(namespaces())
    return [key for key in keys if (ns := key_namespace(key)) and ns not in live]
