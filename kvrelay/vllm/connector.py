"""kvrelay as a vLLM KV connector (``KVConnectorBase_V1``), loaded by vLLM from ``kv_connector_module_path``::

    vllm serve MODEL_FOLDER --enable-prompt-tokens-details --kv-transfer-config \\
      '{"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"method": "epic", "store": "memory"}}'

Scheduler side (vLLM's engine-core process): every new request is matched against the spans stored so far
(``hub``, ``plan``) and claims the prefix of its uncomputed prompt tokens those spans make reusable; every
finished request is indexed at once and its blocks are held until the worker has read its K/V. Worker side:
reads finished requests' K/V in the next step and stores it in a background thread (``saver``), and writes
claimed tokens into vLLM's paged cache before the forward (``worker``). docs/vllm.md (the connector section)
says what runs where and why.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvrelay.errors import ConfigError
from kvrelay.server.context import digest
from kvrelay.vllm.hub import ConnectorConfig, Hub, hub_for, model_fingerprint
from kvrelay.vllm.methods import BoundModel, check_bound, connector_method
from kvrelay.vllm.paged import KEY_LAYOUTS, PagedKV, layer_order
from kvrelay.vllm.plan import LoadPlan
from kvrelay.vllm.saver import BackgroundSaver
from kvrelay.vllm.worker import LoadJob, SaveJob, WorkerSide
from kvrelay.weights.configs import config_from_hf
from kvrelay.weights.export_record import exported_profile_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvrelay.model.transformer import Transformer
    from kvrelay.vllm.forward import VllmLayersForward

log = logging.getLogger("kvrelay.vllm")


def log_to_stderr() -> None:
    """Show the connector's INFO lines in vLLM's output: vLLM configures only its own logger, and a record of
    ``kvrelay.vllm`` with no handler anywhere is dropped below WARNING. A handler set up by the user stays."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvrelay] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def namespace_of(cache_salt: str | None) -> str:
    """The store namespace of a request: ``kvrelay serve``'s for the same ``cache_salt`` (no API keys)."""
    return "s" + digest(cache_salt) if cache_salt else ""


def attention_isa(layer: Any, head_dim: int, block_size: int) -> str:
    """The kernel variant vLLM's CPU attention runs for ``layer`` (it decides the key layout in a block)."""
    isa = getattr(layer, "isa", None)
    if isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(layer.kv_cache.dtype if hasattr(layer, "kv_cache") else torch.float32, block_size,
                            head_dim)
    return isa


def key_layout(kv: torch.Tensor, num_kv_heads: int, head_dim: int, isa: str) -> str:
    """How vLLM's CPU kernel lays keys out in a block of ``kv``: it writes a scratch block, read back each way."""
    from vllm import _custom_ops as ops

    kernel_block = kv.shape[2]
    scratch = torch.zeros(1, *kv.shape[1:], dtype=kv.dtype)
    key_cache, value_cache = scratch.view(1, num_kv_heads, 2 * kernel_block, head_dim).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(kernel_block, num_kv_heads, head_dim, generator=gen).to(kv.dtype)
    value = torch.randn(kernel_block, num_kv_heads, head_dim, generator=gen).to(kv.dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(kernel_block), isa)
    for layout in KEY_LAYOUTS:
        paged = PagedKV([scratch], kernel_block, num_kv_heads, head_dim, layout)
        k, v = paged.read(paged.slots([0], 0, kernel_block))  # [1, Hkv, kbs, hd]
        if torch.equal(k[0], key.transpose(0, 1)) and torch.equal(v[0], value.transpose(0, 1)):
            return layout
    raise ConfigError(f"kvrelay connector: vLLM's CPU attention kernel {isa!r} lays K/V out in a way kvrelay does "
                      f"not read ({', '.join(KEY_LAYOUTS)} keys tried); loads and saves cannot run")


@dataclass
class KVRelayMetadata(KVConnectorMetadata):
    """One step's work for the worker side: saves first (a load of the same step may read them), then loads."""

    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class KVRelayWorkerReport(KVConnectorWorkerMetadata):
    """The worker side's answer for one step: spans stored, and spans refused or evicted, as (namespace, span id).
    vLLM's CPU build runs its worker in a process of its own even with one device, so the scheduler side learns
    what the worker's store holds only from this."""

    stored: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVRelayWorkerReport)
        return KVRelayWorkerReport(self.stored + other.stored, self.dropped + other.dropped)


class KVRelayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_to_stderr()
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and self.config.load and policy != "recompute":
            log.warning("kvrelay connector: kv_load_failure_policy is %r: a request whose load fails is failed, not "
                        "prefilled; set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config", policy)
        model_config = vllm_config.model_config
        if vllm_config.parallel_config.world_size > 1:
            raise ConfigError("kvrelay connector: one worker only (tensor and pipeline parallel size 1): each worker "
                              "of several holds a shard of the heads, and kvrelay's spans hold them all")
        self.hf_config = model_config.hf_config.to_dict()
        self.model_config = config_from_hf(self.hf_config)
        self.block_size = vllm_config.cache_config.block_size
        # a stored span's bytes per token (its K and V at every layer, in vLLM's KV dtype): a request whose span
        # would exceed the store's whole memory tier is not indexed, as the worker could never store it
        cfg, cache_dtype = self.model_config, getattr(vllm_config.cache_config, "cache_dtype", "auto")
        self._span_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                                      * torch.empty(0, dtype=model_config.dtype).element_size()
                                      if cache_dtype == "auto" else 0)
        fingerprint = model_fingerprint(str(model_config.model), self.hf_config, model_config.dtype)
        self.hub: Hub = hub_for(self.config, fingerprint)
        # scheduler side
        self._plans: dict[str, LoadPlan] = {}
        self._asked: dict[str, int] = {}  # request id -> the tokens vLLM had computed when it asked for a match
        self._saves: list[SaveJob] = []
        self._loads: list[LoadJob] = []
        # worker side
        self._vllm_config = vllm_config
        self._worker: WorkerSide | None = None
        self._saver: BackgroundSaver | None = None
        self._failed_blocks: set[int] = set()

    @property
    def load_worker(self) -> WorkerSide | None:
        """The worker side's loader and store writer (None before ``register_kv_caches``); benchmarks time it."""
        return self._worker

    @property
    def background_saver(self) -> BackgroundSaver | None:
        """The thread that reads finished requests' KV and stores it (None before ``register_kv_caches``)."""
        return self._saver

    # ================================================================== scheduler side
    # These run in vLLM's engine-core process, inside its scheduler: an exception here would end the engine and
    # every request on it. Each failure is logged and the request goes on as without the connector (nothing
    # claimed, nothing stored); a claim vLLM granted but the connector cannot serve becomes a failed load, whose
    # blocks vLLM recomputes (kv_load_failure_policy "recompute").
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.load or request.prompt_token_ids is None:
            return 0, False
        self._asked[request.request_id] = num_computed_tokens
        try:
            plan = self.hub.plan(list(request.prompt_token_ids), namespace_of(request.cache_salt),
                                 num_computed_tokens)
        except Exception:  # noqa: BLE001 - the request is prefilled by vLLM instead
            log.exception("kvrelay connector: matching request %s failed; vLLM prefills it as without the "
                          "connector", request.request_id)
            plan = None
        if plan is None:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = plan
        return plan.num_claimed, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        num_computed = self._asked.pop(request.request_id, 0)  # vLLM's own hit, as it was given to the match
        if num_external_tokens == 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        prompt = request.prompt_token_ids or []
        if plan is None or plan.num_claimed != num_external_tokens:  # vLLM grants what was asked, or nothing
            # not served: its blocks are reported failed (``start_load_kv``) and vLLM recomputes them
            error = f"granted {num_external_tokens} tokens, not the {plan and plan.num_claimed} planned"
            plan = LoadPlan(num_computed, num_computed + num_external_tokens)
            self._loads.append(LoadJob(request.request_id, namespace_of(request.cache_salt), [], plan, block_ids,
                                       error=error))
            return
        self._loads.append(LoadJob(request.request_id, namespace_of(request.cache_salt),
                                   list(prompt[: plan.run_end]), plan, block_ids))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, KVRelayWorkerReport):
            try:
                self.hub.reported(report.stored, report.dropped)
            except Exception:  # noqa: BLE001 - a span then stays matchable; its load finds it missing
                log.exception("kvrelay connector: the worker's report of stored and dropped spans was not applied")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVRelayMetadata(self._saves, self._loads)
        self._saves, self._loads = [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Index the request's tokens now (a request arriving before the worker stores them still matches) and
        hold its blocks until the worker has copied them (``saver``)."""
        self._plans.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        try:
            return self._index_finished(request, block_ids)
        except Exception:  # noqa: BLE001 - the request's K/V is not stored; vLLM frees its blocks now
            log.exception("kvrelay connector: request %s's KV not stored (indexing it failed)", request.request_id)
            return False, None

    def _index_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        num_tokens = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if not self.config.save or num_tokens < self.config.min_match_tokens:
            return False, None
        if num_tokens * self._span_bytes_per_token > self.config.budget_bytes:
            log.warning("kvrelay connector: request %s's KV not stored: %d tokens need %d bytes, more than the "
                        "store's memory tier holds (kv_budget_gb %g)", request.request_id, num_tokens,
                        num_tokens * self._span_bytes_per_token, self.config.kv_budget_gb)
            return False, None
        hub, namespace = self.hub, namespace_of(request.cache_salt)
        token_ids = list(request.all_token_ids[:num_tokens])
        span_id = hub.catalog.new_span_id(request.num_prompt_tokens)  # kvrelay serve's completion ids
        num_blocks = math.ceil(num_tokens / self.block_size)
        job = SaveJob(request.request_id, span_id, namespace, token_ids, list(block_ids[:num_blocks]))
        with hub.lock:
            hub.catalog.index.add(span_id, token_ids, namespace)
            hub.pending.add((namespace, span_id))
        self._saves.append(job)
        return True, None

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = layer_order(list(kv_caches))
        cfg = self.model_config
        layer = self._vllm_config.compilation_config.static_forward_context[names[0]]
        layout = key_layout(kv_caches[names[0]], cfg.num_kv_heads, cfg.head_dim, attention_isa(layer, cfg.head_dim,
                                                                                               self.block_size))
        paged = PagedKV([kv_caches[n] for n in names], self.block_size, cfg.num_kv_heads, cfg.head_dim, layout)
        self._attention_names = names
        method = connector_method(self.config.method, self.config.profile)
        transformer = self._bind_transformer(scheduled=method is not None) if self.config.load else None
        bound = None
        if method is not None and transformer is not None:
            model_dir = str(self._vllm_config.model_config.model)
            exported_from = exported_profile_fingerprint(model_dir)  # a folder kvrelay exported: its source's profile
            bound = BoundModel(model_dir, transformer, cfg, self.hub.fingerprint, exported_from)
            check_bound(method, bound, self.config.profile)  # a model without a (fitting) profile fails at start
        self._worker = WorkerSide(self.hub, paged, cfg, transformer, method if bound is not None else None, bound)
        self._saver = BackgroundSaver(self._worker)

    def _bind_transformer(self, scheduled: bool = False) -> Transformer | VllmLayersForward | None:
        """What computes a load's tokens on vLLM's modules, found once at start: finding the model scans the
        worker's live objects (seconds), which no request should wait for. vLLM's decoder layers run as vLLM runs
        them where they have its Llama layout (``forward``), else kvrelay's transformer on vLLM's modules
        (``binding``). None where neither binds: then loads that need tokens computed fail, and vLLM recomputes
        their blocks (under kv_load_failure_policy "recompute"; its default, "fail", fails the request). A scheduled
        method (``methods``) runs on kvrelay's transformer, whose prefill runs schedules."""
        from kvrelay.vllm.binding import bind_transformer, find_model
        from kvrelay.vllm.forward import bind_layers

        context = self._vllm_config.compilation_config.static_forward_context
        layers = {n: context[n] for n in self._attention_names}
        try:
            vllm_model = find_model(layers)
            if scheduled:
                return bind_transformer(self.model_config, vllm_model)
            return bind_layers(self.model_config, vllm_model) or bind_transformer(self.model_config, vllm_model)
        except ConfigError as e:
            log.warning("%s", e)
            return None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRelayMetadata) and self._worker is not None and self._saver is not None
        for job in meta.saves:  # read now, while vLLM holds the blocks; stored in the saver's thread
            self._saver.submit(job)
        for job in meta.loads:
            if job.error is not None:  # a claim the scheduler side could not plan: vLLM recomputes its blocks
                log.warning("kvrelay connector: request %s: %s; its blocks are reported to vLLM as not loaded",
                            job.req_id, job.error)
                self._fail_load(job)
                continue
            t0 = time.perf_counter()
            for piece in job.plan.pieces:  # a span this load reads may still be being stored
                self._saver.wait_stored(job.namespace, piece.span_id)
            wait_ms = (time.perf_counter() - t0) * 1e3
            try:
                result = self._worker.load(job)
            # the blocks of a failed load are reported (get_block_ids_with_load_errors): vLLM recomputes them under
            # kv_load_failure_policy "recompute", and fails the request under its default, "fail"
            except Exception:  # noqa: BLE001 - one request's failed load never stops the step
                log.exception("kvrelay connector: load for request %s failed; its blocks are reported to vLLM "
                              "(recomputed under kv_load_failure_policy 'recompute')", job.req_id)
                self._fail_load(job)
                continue
            log.info("kvrelay connector: request %s: %d tokens claimed, %d loaded, %d computed (%d spans missing; "
                     "%d token-layers) in %.1f ms (forward %.1f ms on %d threads; %.1f ms waiting for spans being "
                     "stored)%s", result.req_id, result.num_claimed, result.num_loaded, result.num_recomputed,
                     result.spans_missing, result.num_token_layers, result.load_ms, result.forward_ms,
                     torch.get_num_threads(), wait_ms, f"; {result.note}" if result.note else "")

    def _fail_load(self, job: LoadJob) -> None:
        """Report ``job``'s claimed blocks as not loaded (``get_block_ids_with_load_errors``): vLLM recomputes them
        under kv_load_failure_policy "recompute", and fails the request under its default, "fail"."""
        first = job.plan.num_computed // self.block_size
        self._failed_blocks.update(job.block_ids[first: math.ceil(job.plan.end / self.block_size)])

    def has_connector_metadata(self) -> bool:
        """False, so that vLLM's attention layers skip ``wait_for_layer_load`` and ``save_kv_layer`` (two calls per
        layer per step, each after a forward-context lookup): this connector works between forwards only
        (``start_load_kv``; a save reads the finished request's blocks whole). vLLM asks this only there; the step's
        metadata stays bound and ``start_load_kv`` reads it."""
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a request's K/V is read whole when it finishes (start_load_kv of the next step)

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        read = self._saver.take_read() if self._saver is not None else set()
        return (read or None), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        stored, dropped = self._worker.take_report() if self._worker is not None else ([], [])
        return KVRelayWorkerReport(stored, dropped) if stored or dropped else None

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
