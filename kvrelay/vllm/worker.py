"""The connector's worker side: finished requests' K/V out of vLLM's paged cache into the store, and claimed
tokens' K/V into it.

A load builds the request's first ``end`` positions in a kvrelay sequence cache: ``[0, num_computed)`` read from
the paged cache (what vLLM computed or found in its own prefix cache), each piece's stored K/V loaded at its
new positions with its keys re-rotated (RoPE composes: ``K(p') = R(p' - p) K(p)``), then kvrelay's scheduled
prefill computes the gap and repaired tokens at every layer, attending to everything before them, through vLLM's
own modules (``binding``). Positions ``[num_computed, end)`` then go into the paged cache, and vLLM prefills the
rest of the prompt on top of them. A scheduled method (``cacheblend``, ``relay``) places the moved pieces and runs its
own schedule as its plan says (``methods``), over the whole prompt. A span gone from the store since the scheduler
planned (evicted, or its save failed) is not an error: its tokens are computed like a gap.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.cache.store import SpanNotFoundError
from kvrelay.errors import KvRelayError
from kvrelay.model import packed
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.schedule import StaticSchedule
from kvrelay.model.transformer import Transformer
from kvrelay.reuse import ReuseMethod
from kvrelay.vllm.forward import VllmLayersForward
from kvrelay.vllm.hub import Hub
from kvrelay.vllm.methods import BoundModel, prefix_length, run_scheduled
from kvrelay.vllm.paged import PagedKV
from kvrelay.vllm.plan import LoadPlan

log = logging.getLogger("kvrelay.vllm")


@dataclass
class SaveJob:
    """A finished request's computed tokens, to store as one span at position 0 (prompt + output)."""

    req_id: str
    span_id: str
    namespace: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class LoadJob:
    req_id: str
    namespace: str
    token_ids: list[int]  # the prompt's first ``plan.run_end`` tokens
    plan: LoadPlan
    block_ids: list[int]
    # set by the scheduler side when it cannot serve a claim vLLM granted: the worker reports the blocks unloaded
    error: str | None = None


@dataclass
class LoadResult:
    """What one load did (the connector's per-request numbers)."""

    req_id: str
    num_claimed: int
    num_loaded: int
    num_recomputed: int
    spans_missing: int
    load_ms: float
    forward_ms: float = 0.0
    num_token_layers: int = 0  # token-layers the forward computed (a scheduled method's band repairs included)
    note: str | None = None  # what the method's plan could not do as asked (``Plan.note``)
    pieces: list[tuple[int, int, bool]] = field(default_factory=list)  # (dst_start, num_tokens, exact)


def compute_kv(model: Transformer, token_ids: torch.Tensor, cache: SequenceKV, active: torch.Tensor) -> None:
    """The K/V of positions ``active`` at every layer into ``cache``, which holds every other position of
    ``token_ids`` ([n]) already: kvrelay's scheduled prefill run through its last layer and stopped there, without
    the final norm and the output head (a 49k-row product for SmolLM2), whose logits no load reads."""
    forward = model.begin_prefill(token_ids, cache, StaticSchedule(active))
    model.prefill_layers(forward)  # every layer (a static schedule has no exit test)
    cache.check_filled(int(token_ids.shape[0]))  # as ``finish_prefill`` checks: no position left without K/V


class WorkerSide:
    """Saves and loads against one process's hub, on the paged KV vLLM registered."""

    def __init__(self, hub: Hub, paged: PagedKV, config: ModelConfig,
                 transformer: Transformer | VllmLayersForward | None, method: ReuseMethod | None = None,
                 bound: BoundModel | None = None) -> None:
        self.hub, self.paged, self.config = hub, paged, config
        # computes the tokens a load does not take from a span (vLLM's layers as its forward runs them, or
        # kvrelay's modules on vLLM's weights); None: no load may
        self.transformer = transformer
        # a scheduled method (cacheblend, relay; None: the plan's static positions) and the bound transformer it
        # runs its schedule on (``methods``)
        self.method, self.bound = method, bound
        if method is not None and bound is None:
            raise KvRelayError(f"kvrelay connector: method {method.name!r} needs kvrelay's transformer bound to "
                               "vLLM's modules")
        self.rope = RotaryEmbedding(config, "cpu")
        self.results: list[LoadResult] = []
        self._stored: list[tuple[str, str]] = []
        self._dropped: list[tuple[str, str]] = []
        self._report_lock = threading.Lock()  # saves are stored in a thread of their own (``saver``)

    # ------------------------------------------------------------------ saves
    def save(self, job: SaveJob) -> bool:
        """Read and store ``job``'s K/V in the caller's thread (``saver.BackgroundSaver`` splits the two)."""
        stored = self.store(job, *self.read(job))
        self.hub.write_tier()
        return stored

    def read(self, job: SaveJob) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of ``job``'s K/V out of the paged cache, [L, Hkv, tokens, hd] each: after this its blocks may
        be reused."""
        return self.paged.read_range(job.block_ids, 0, len(job.token_ids))

    def copy_blocks(self, job: SaveJob) -> PagedKV:
        """A copy of ``job``'s blocks (``PagedKV.copy_blocks``): after this its blocks may be reused, and
        ``read_copy`` gathers its K/V from the copy."""
        return self.paged.copy_blocks(job.block_ids, len(job.token_ids))

    @staticmethod
    def read_copy(copy: PagedKV, job: SaveJob) -> tuple[torch.Tensor, torch.Tensor]:
        """``job``'s K/V out of its ``copy_blocks`` copy, [L, Hkv, tokens, hd] each."""
        return copy.read_copied(len(job.token_ids))

    def store(self, job: SaveJob, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Store ``job``'s K/V (from ``read``) in the hub's memory tier and index (the caller then runs
        ``hub.write_tier``); False when the store refused it. What was stored, refused or evicted is reported to the
        scheduler side (``take_report``)."""
        hub, key = self.hub, (job.namespace, job.span_id)
        try:
            span = StoredSpan(tuple(job.token_ids), 0, k, v, hub.fingerprint)
            evicted = hub.put_span(job.namespace, job.span_id, span)
            hub.stats["saved"] += 1
            with self._report_lock:
                self._stored.append(key)
                self._dropped.extend((job.namespace, span_id) for span_id in evicted)
            return True
        except KvRelayError as e:  # a full store: this span is not kept, nothing else fails
            log.warning("kvrelay connector: request %s's KV not stored: %s", job.req_id, e)
            self.refused(job)
            return False

    def refused(self, job: SaveJob) -> None:
        """``job``'s span is not stored: forgotten here and by the scheduler side."""
        hub = self.hub
        hub.stats["save_failed"] += 1
        with hub.lock:
            hub.catalog.drop(job.namespace, job.span_id)
        with self._report_lock:
            self._dropped.append((job.namespace, job.span_id))

    def take_report(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(spans stored, spans refused or evicted) since the last call, as (namespace, span id)."""
        with self._report_lock:
            report = (self._stored, self._dropped)
            self._stored, self._dropped = [], []
        return report

    # ------------------------------------------------------------------ loads
    def load(self, job: LoadJob) -> LoadResult:
        t0 = time.perf_counter()
        plan, paged = job.plan, self.paged
        cache = SequenceKV(self.config, paged.dtype, "cpu", capacity=plan.run_end + 1)
        recompute, spans, missing = set(plan.recompute), {}, 0
        for piece in plan.pieces:
            span = self._span(job.namespace, piece.span_id)
            if span is None or len(span) < piece.src_start + piece.num_tokens:
                missing += 1
                recompute.update(range(piece.dst_start, piece.dst_end))
                continue
            spans[piece.span_id] = span
        # what vLLM computed is read back only where a token computed here attends to it: a claim whose every token
        # is loaded as stored (an exact prefix past vLLM's own cache) needs none of it (near the context limit that
        # read is most of a load: 7,808 tokens of K/V for a 113-token claim)
        if plan.num_computed and (recompute or self.method is not None):
            k, v = paged.read_range(job.block_ids, 0, plan.num_computed)
            cache.patch(0, k, v, add=False)
        # a scheduled method loads its moved pieces itself, as its plan says; the exact prefix is loaded here
        prefix = prefix_length(plan, spans) if self.method is not None else None
        for piece in plan.pieces:
            if piece.span_id in spans and (prefix is None or piece.exact and piece.dst_end <= prefix):
                cache.load_span(spans[piece.span_id], piece.dst_start, self.rope, piece.src_start,
                                piece.src_start + piece.num_tokens)
        result = LoadResult(job.req_id, plan.num_claimed, plan.num_claimed - len(recompute), len(recompute), missing,
                            0.0, pieces=[(p.dst_start, p.num_tokens, p.exact) for p in plan.pieces])
        t1 = time.perf_counter()
        if self.method is not None:
            with packed.unpacked():  # vLLM's modules do the products; nothing of kvrelay's is packed
                result.num_token_layers, result.note = run_scheduled(self.method, self.bound, job.token_ids, plan,
                                                                     cache, spans)
        elif recompute:
            result.num_token_layers = self._compute(job, cache, sorted(recompute))
        result.forward_ms = (time.perf_counter() - t1) * 1e3
        k, v = cache.kv_all(plan.num_computed, plan.end)  # [L, Hkv, claimed, hd]
        paged.write(paged.slots(job.block_ids, plan.num_computed, plan.end), k, v)
        result.load_ms = (time.perf_counter() - t0) * 1e3
        stats = self.hub.stats
        stats["loads"] += 1
        stats["tokens_claimed"] += result.num_claimed
        stats["tokens_recomputed"] += result.num_recomputed
        stats["spans_missing"] += missing
        self.results.append(result)
        return result

    def _compute(self, job: LoadJob, cache: SequenceKV, positions: list[int]) -> int:
        """The K/V of ``positions`` at every layer (a static method's gaps and repairs); the token-layers computed."""
        model = self.transformer
        if model is None:
            raise KvRelayError("no model to compute the claimed tokens with")
        active = torch.tensor(positions, dtype=torch.long)
        token_ids = torch.tensor(job.token_ids[: positions[-1] + 1])
        if isinstance(model, VllmLayersForward):
            model.compute_kv(token_ids, cache, active)
        else:
            with packed.unpacked():  # vLLM's modules do the products; nothing of kvrelay's is packed
                compute_kv(model, token_ids, cache, active)
        return len(positions) * self.config.num_layers

    def _span(self, namespace: str, span_id: str) -> StoredSpan | None:
        try:
            return self.hub.store.get(span_id, namespace)
        except SpanNotFoundError:
            return None
