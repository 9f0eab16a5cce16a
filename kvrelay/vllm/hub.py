"""The connector's settings and the store both its halves share in one process.

vLLM builds the connector twice: a scheduler-side instance in the engine-core process and a worker-side one
in the worker. Where both live in one process (vLLM's ``UniProcExecutor``) they share one ``Hub``: the span store
(memory in front of the shared tier, as ``kvrelay serve`` uses it), the token index the scheduler matches prompts
against, and the spans whose save the worker has not done yet. vLLM's CPU build runs its worker in a process of its
own even for one device: each side then has its own hub, and the scheduler side learns what the worker stored from
the worker's reports (``Hub.reported``). More than one worker (tensor or pipeline parallelism) is refused at start.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.lm import fingerprint_of
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.index import MATCH_PREFERENCES
from kvrelay.tier.backends.base import redact
from kvrelay.tier.tiered import TieredStore, open_store
from kvrelay.vllm.plan import CONNECTOR_METHODS, LoadPlan, Run, method_name, plan_load
from kvrelay.weights.configs import config_from_hf
from kvrelay.weights.integrity import file_sha256

GIB = 1 << 30
STORE_SCHEMES = ("disk:", "redis://", "rediss://", "unix://")  # what ``tier.tiered.open_store`` opens


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of ``--kv-transfer-config`` (every key optional)."""

    store: str = field(default="memory", metadata={"help": (
        "where spans live: memory, disk:PATH or redis://host:port/db (shared with other vLLM instances and "
        "`kvrelay serve` processes on the same URL and model)")})
    kv_budget_gb: float = field(default=2.0, metadata={"help": "memory tier of the span store, in GiB"})
    method: str = field(default="epic", metadata={"help": (
        "repair of moved spans: epic (recompute the first epic_k tokens of each), naive (none), cacheblend or relay "
        "(kvrelay's methods, with parameters as in `kvrelay serve --method`, e.g. relay[keep_share=0.2])")})
    profile: str | None = field(default=None, metadata={"help": (
        "relay's layer profile (a JSON `kvrelay profile` writes; None: the one for this model in kvrelay's cache dir "
        "or shipped with kvrelay)")})
    epic_k: int = field(default=16, metadata={"help": "tokens epic recomputes at the start of each moved span"})
    min_match_tokens: int = field(default=16, metadata={"help": "shortest run of prompt tokens reused"})
    match_prefer: str = field(default="oldest", metadata={"help": "oldest or longest: which span a shared text "
                                                                  "is taken from"})
    save: bool = field(default=True, metadata={"help": "publish every finished request's KV"})
    load: bool = field(default=True, metadata={"help": "load stored spans into new requests"})

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or method_name(self.method) not in CONNECTOR_METHODS:
            raise ConfigError(f"kvrelay connector: method must be one of {', '.join(CONNECTOR_METHODS)}, "
                              f"got {self.method!r}")
        if self.profile is not None and not isinstance(self.profile, str):
            raise ConfigError(f"kvrelay connector: profile must be a path, got {self.profile!r}")
        from kvrelay.vllm.methods import connector_method  # (it imports the methods: torch)

        connector_method(self.method, self.profile)  # its settings checked now: a ConfigError naming the bad one
        if self.match_prefer not in MATCH_PREFERENCES:
            raise ConfigError(f"kvrelay connector: match_prefer must be one of {', '.join(MATCH_PREFERENCES)}, "
                              f"got {self.match_prefer!r}")
        budget = self.kv_budget_gb
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) \
                or budget <= 0:
            raise ConfigError(f"kvrelay connector: kv_budget_gb must be a positive number, got {budget!r}")
        for name in ("epic_k", "min_match_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "epic_k" else 1):
                raise ConfigError(f"kvrelay connector: {name} must be an integer >= "
                                  f"{0 if name == 'epic_k' else 1}, got {value!r}")
        for name in ("save", "load"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"kvrelay connector: {name} must be true or false, got {getattr(self, name)!r}")
        store = self.store.strip() if isinstance(self.store, str) else ""
        if not (store == "memory" or store.startswith(STORE_SCHEMES) and store not in STORE_SCHEMES):
            shown = redact(store) if store else self.store
            raise ConfigError(f"kvrelay connector: store must be memory, disk:PATH or redis://host:port/db, got "
                              f"{shown!r}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """From ``kv_connector_extra_config``; an unknown key is an error naming the known ones."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kvrelay connector: unknown kv_connector_extra_config keys {unknown}; known: "
                              f"{sorted(known)}")
        return cls(**extra)

    @property
    def budget_bytes(self) -> int:
        return int(self.kv_budget_gb * GIB)


def model_fingerprint(model: str, hf_config: dict[str, Any], dtype: torch.dtype) -> str:
    """The fingerprint ``kvrelay.weights.loader`` gives the same Hugging Face folder at the same dtype, so spans
    of vLLM and of ``kvrelay serve --model FOLDER`` are one model's; a model that is not a local folder gets one
    from its name (shared with other vLLM instances only)."""
    path = Path(model)
    shards = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not shards or not (path / "tokenizer.json").exists():
        blob = json.dumps(["vllm", model, hf_config, str(dtype)], sort_keys=True, default=str)
        return "vllm-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    weights = hashlib.sha256()
    for shard in shards:
        weights.update(f"{shard.name}|{shard.stat().st_size}|{file_sha256(shard)}".encode())
    return fingerprint_of(config_from_hf(hf_config), weights.hexdigest(), dtype, file_sha256(path / "tokenizer.json"))


class Hub:
    """One process's span store, token index and pending saves, shared by the connector's two halves."""

    def __init__(self, config: ConnectorConfig, fingerprint: str) -> None:
        self.config, self.fingerprint = config, fingerprint
        store: KVStore = open_store(None if config.store == "memory" else config.store, config.budget_bytes,
                                    fingerprint=fingerprint, block_len=16)
        store.set_fingerprint(fingerprint)
        self.store = store
        self.catalog = SpanCatalog(store, fingerprint)
        self.lock = threading.RLock()  # the index and pending saves: scheduler and worker threads
        # (namespace, span id) the scheduler indexed at a request's end, until the worker reports it stored
        self.pending: set[tuple[str, str]] = set()
        # what the worker reported stored (it may be another process, whose memory store the scheduler cannot see)
        self.stored: set[tuple[str, str]] = set()
        self.stats = {"saved": 0, "save_failed": 0, "loads": 0, "tokens_claimed": 0, "tokens_recomputed": 0,
                      "spans_missing": 0}

    def put_span(self, namespace: str, span_id: str, span: StoredSpan) -> list[str]:
        """Store and index ``span`` in this process (memory tier and token index, under the hub's lock); its write
        to the shared tier is left to ``write_tier``, which the caller runs after: the scheduler side, matching
        prompts under that lock, and a load reading the span here never wait for a Redis or disk write. The span
        ids the memory tier evicted to fit it."""
        tiered = self.store if isinstance(self.store, TieredStore) else None
        with self.lock, (tiered.writes_deferred() if tiered is not None else nullcontext()):
            return self.catalog.put(namespace, span_id, span)

    def write_tier(self) -> None:
        """Write and announce in the shared tier the spans ``put_span`` stored (none without a tier; a tier that
        is down gets them when it is back, as ``TieredStore.put`` does)."""
        if isinstance(self.store, TieredStore):
            self.store.flush_unwritten()

    def plan(self, prompt: list[int], namespace: str, num_computed: int) -> LoadPlan | None:
        """What a request with ``prompt`` (vLLM computed its first ``num_computed`` tokens) loads: the matcher's runs
        of spans a load can find, planned (``plan.plan_load``); None when nothing pays. The spans other processes
        published to the shared tier are learned first, outside the hub's lock: that poll is a network call, and a
        slow Redis then delays this request's plan only, never a save or another thread's lookup waiting on the lock
        (the catalog indexes what it learned under its own lock)."""
        self.catalog.learn_published(namespace)
        cfg = self.config
        with self.lock:
            found = self.catalog.index.find(prompt, namespace, cfg.min_match_tokens, None, cfg.match_prefer)
            runs = [Run(m.start, m.end, m.span_id, m.src_start) for m in found if self.available(namespace, m.span_id)]
            return plan_load(prompt, num_computed, runs, self.catalog.index.token_ids, cfg.method, cfg.epic_k,
                             cfg.min_match_tokens)

    def available(self, namespace: str, span_id: str) -> bool:
        """Whether a load of ``span_id`` can find it: stored, or about to be by the worker."""
        with self.lock:
            if (namespace, span_id) in self.pending or (namespace, span_id) in self.stored:
                return True
        return self.catalog.owns(namespace, span_id)

    def reported(self, stored: list[tuple[str, str]], dropped: list[tuple[str, str]]) -> None:
        """The worker's report: spans now stored, and spans it could not store or has evicted (forgotten here, so
        no later request plans to load them)."""
        with self.lock:
            for key in stored:
                self.pending.discard(key)
                self.stored.add(key)
            for namespace, span_id in dropped:
                self.pending.discard((namespace, span_id))
                self.stored.discard((namespace, span_id))
                self.catalog.index.remove(span_id)


_HUBS: dict[tuple[ConnectorConfig, str], Hub] = {}
_HUBS_LOCK = threading.Lock()


def hub_for(config: ConnectorConfig, fingerprint: str) -> Hub:
    """This process's hub for ``config`` and model (one store per process, whichever half asks first)."""
    with _HUBS_LOCK:
        hub = _HUBS.get((config, fingerprint))
        if hub is None:
            hub = _HUBS[(config, fingerprint)] = Hub(config, fingerprint)
        return hub
