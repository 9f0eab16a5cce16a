"""Block cache manager: RKSC's RSBCM and an LRU baseline over one block table.

A block is ``block_len`` prompt tokens keyed by the chained hash of the whole prefix up to and
including it (``store.block_hashes``), so equal keys mean equal prefixes of the same model. A block
holds a payload (real K/V in practice) and its byte size; the manager keeps blocks under a byte
budget and counts hits, misses and the tokens it had to recompute because it evicted them.

Eviction picks among unpinned blocks:
- ``rsbcm``: the smallest importance / (depth + 1), where importance is the attention mass the
  block's tokens received (accumulated by ``add_importance``) and depth its index in the chain;
- ``lru``: the least recently used.
With ``half_life_ops`` > 0 (not in RKSC; ours), RSBCM's importance halves every that many cache
operations (lookups and inserts), so the credit of blocks nobody reads any more fades: without it,
blocks of finished requests keep their mass forever and a new request's blocks (no credit yet) go
first.
Ties go to the least recently used, then the deepest (a lookup touches a whole chain at once, so
its deeper blocks go first, as vLLM frees a request's blocks tail first).

A request holds what it uses from the moment it gets it, as a serving engine's block refcount
does: ``lookup(..., pin=True)`` pins the chain it hits in the same step, ``insert(..., pin=True)``
pins the blocks it adds, and the request later unpins exactly those keys: with several requests in
flight, a gap between insert and pin lets another request's insert evict a fresh root.

Bookkeeping only, no torch. Every operation is recorded as an event, so a run's trace can be
replayed under another policy or budget (``replay``) to compare them on the very same accesses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.cache.store import block_hashes
from kvrelay.errors import ConfigError

POLICIES = ("rsbcm", "lru")


@dataclass
class Block:
    key: bytes
    depth: int  # index in its chain: the block covers tokens [depth * block_len, (depth + 1) * block_len)
    nbytes: int
    payload: Any
    importance: float = 0.0  # as of importance_tick (decays from there with a half-life)
    importance_tick: int = 0
    last_tick: int = 0
    pins: int = 0


@dataclass
class BlockStats:
    num_lookup_blocks: int = 0  # full blocks asked for
    num_hit_blocks: int = 0
    num_recomputed_tokens: int = 0  # tokens of missed blocks this cache had held before (evicted)
    num_evicted_blocks: int = 0
    num_rejected_blocks: int = 0  # blocks that could not fit (everything else pinned)
    peak_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_lookup_blocks if self.num_lookup_blocks else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": self.hit_rate}


@dataclass
class BlockCache:
    budget_bytes: int
    policy: str = "rsbcm"
    block_len: int = 16
    fingerprint: str = ""
    half_life_ops: float = 0.0  # 0: importance never decays (RKSC's RSBCM)
    stats: BlockStats = field(default_factory=BlockStats)
    events: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"block cache policy must be one of {POLICIES}, got {self.policy!r}")
        if self.half_life_ops < 0:
            raise ConfigError(f"block cache half_life_ops must be >= 0, got {self.half_life_ops}")
        if self.budget_bytes <= 0 or self.block_len <= 0:
            raise ConfigError(f"block cache needs a positive budget and block length, got "
                              f"{self.budget_bytes} bytes / {self.block_len} tokens")
        self.blocks: dict[bytes, Block] = {}
        self.used_bytes = 0
        self._tick = 0
        self._ever: set[bytes] = set()

    # ------------------------------------------------------------------ by token ids
    def keys(self, token_ids: list[int] | tuple[int, ...]) -> list[bytes]:
        return block_hashes(self.fingerprint, token_ids, self.block_len)

    def lookup(self, token_ids: list[int] | tuple[int, ...], pin: bool = False) -> list[Block]:
        """The cached chain of full blocks from the start of ``token_ids`` (touched, counted; pinned
        in the same step with ``pin``)."""
        return self.lookup_keys(self.keys(token_ids), pin)

    def insert(self, token_ids: list[int] | tuple[int, ...], payload: Callable[[int], tuple[Any, int]],
               num_tokens: int | None = None) -> int:
        """Add the missing full blocks of the first ``num_tokens`` tokens; ``payload(i)`` gives block i's
        (payload, nbytes). Returns how many were added."""
        ids = token_ids if num_tokens is None else token_ids[:num_tokens]
        return len(self.insert_keys(self.keys(ids), payload))

    # ------------------------------------------------------------------ by keys (what the trace records)
    def lookup_keys(self, keys: list[bytes], pin: bool = False) -> list[Block]:
        self.events.append(("lookup", tuple(keys), pin))
        self._tick += 1
        chain: list[Block] = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            block.last_tick = self._tick
            block.pins += int(pin)
            chain.append(block)
        missed = keys[len(chain):]
        self.stats.num_lookup_blocks += len(keys)
        self.stats.num_hit_blocks += len(chain)
        self.stats.num_recomputed_tokens += self.block_len * sum(k in self._ever for k in missed)
        return chain

    def insert_keys(self, keys: list[bytes], payload: Callable[[int], tuple[Any, int]], pin: bool = False
                    ) -> list[bytes]:
        """Add the missing blocks of a chain (pinned with ``pin``); returns the keys added. Blocks
        already present are touched, not pinned: the caller computed its own copy of them."""
        self._tick += 1
        added: list[bytes] = []
        sizes = []
        chain = set(keys)  # never evict a block of the chain being inserted
        for depth, key in enumerate(keys):
            block = self.blocks.get(key)
            if block is not None:
                block.last_tick = self._tick
                sizes.append(block.nbytes)
                continue
            data, nbytes = payload(depth)
            sizes.append(nbytes)
            if not self._make_room(nbytes, chain):
                self.stats.num_rejected_blocks += len(keys) - depth
                break  # deeper blocks are unreachable without this one
            self.blocks[key] = Block(key, depth, nbytes, data, last_tick=self._tick, pins=int(pin))
            self._ever.add(key)
            self.used_bytes += nbytes
            added.append(key)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.used_bytes)
        self.events.append(("insert", tuple(keys[: len(sizes)]), tuple(sizes), pin))
        return added

    def add_importance(self, keys: list[bytes], masses: list[float]) -> None:
        """Credit each block with the attention mass its tokens received."""
        self.events.append(("importance", tuple(keys), tuple(masses)))
        for key, mass in zip(keys, masses, strict=True):
            block = self.blocks.get(key)
            if block is not None:
                block.importance = self._importance(block) + mass
                block.importance_tick = self._tick

    def pin(self, keys: list[bytes]) -> None:
        self.events.append(("pin", tuple(keys)))
        for key in keys:
            if key in self.blocks:
                self.blocks[key].pins += 1

    def unpin(self, keys: list[bytes]) -> None:
        self.events.append(("unpin", tuple(keys)))
        for key in keys:
            if key in self.blocks and self.blocks[key].pins > 0:
                self.blocks[key].pins -= 1

    # ------------------------------------------------------------------ eviction
    def _importance(self, block: Block) -> float:
        """The block's importance now (decayed since its last credit when a half-life is set)."""
        if not self.half_life_ops:
            return block.importance
        return block.importance * 0.5 ** ((self._tick - block.importance_tick) / self.half_life_ops)

    def _victim_order(self, block: Block) -> tuple:
        if self.policy == "rsbcm":
            return (self._importance(block) / (block.depth + 1), block.last_tick, -block.depth)
        return (block.last_tick, -block.depth)

    def _make_room(self, nbytes: int, protected: set[bytes]) -> bool:
        while self.used_bytes + nbytes > self.budget_bytes:
            candidates = [b for b in self.blocks.values() if b.pins == 0 and b.key not in protected]
            if not candidates:
                return False
            victim = min(candidates, key=self._victim_order)
            del self.blocks[victim.key]
            self.used_bytes -= victim.nbytes
            self.stats.num_evicted_blocks += 1
        return True

    def eviction_order(self) -> list[bytes]:
        """Keys of the unpinned blocks in the order they would be evicted now."""
        return [b.key for b in sorted((b for b in self.blocks.values() if b.pins == 0), key=self._victim_order)]


def replay(events: list[tuple], budget_bytes: int, policy: str, block_len: int = 16,
           half_life_ops: float = 0.0) -> BlockStats:
    """Run a recorded trace through a fresh cache (no payloads): same accesses, another policy/budget.
    (Traces recorded before lookups and inserts could pin carry no pin flag: read as False.)"""
    cache = BlockCache(budget_bytes, policy, block_len, half_life_ops=half_life_ops)
    for event in events:
        kind = event[0]
        if kind == "lookup":
            cache.lookup_keys(list(event[1]), bool(event[2]) if len(event) > 2 else False)
        elif kind == "insert":
            sizes = event[2]
            cache.insert_keys(list(event[1]), lambda i, sizes=sizes: (None, sizes[i]),
                              bool(event[3]) if len(event) > 3 else False)
        elif kind == "importance":
            cache.add_importance(list(event[1]), list(event[2]))
        elif kind == "pin":
            cache.pin(list(event[1]))
        elif kind == "unpin":
            cache.unpin(list(event[1]))
    return cache.stats


def interleave(segments: list[list[tuple]], concurrency: int) -> list[tuple]:
    """Requests' event lists merged as a server running ``concurrency`` of them at once would: they
    start in order, the in-flight ones take turns one event each, and a finished one's place goes to
    the next. ``concurrency`` 1 = one after another. (A request's accesses do not depend on what the
    cache holds, so a sequential run's per-request traces can be replayed in any such order.)"""
    if concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    pending = deque(seg for seg in segments if seg)
    in_flight: list[list] = []  # [events, next index]
    merged: list[tuple] = []
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            in_flight.append([pending.popleft(), 0])
        for slot in list(in_flight):
            events, i = slot
            merged.append(events[i])
            slot[1] = i + 1
            if slot[1] == len(events):
                in_flight.remove(slot)
    return merged
