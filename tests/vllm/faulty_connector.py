"""kvrelay's connector with faults injected by ``cache_salt``, for test_connector_faults.py (vLLM loads it by module
path, ``tests.vllm.faulty_connector``, from the server's working directory: the repository root).

A request under salt ``fault-plan`` fails its match (scheduler side), ``fault-finish`` fails its indexing when it
finishes (scheduler side), ``fault-grant`` has its plan lost before vLLM allocates its claim (the scheduler side
cannot serve what vLLM granted), and ``fault-load`` fails every load (worker side). Every other salt is served as
the connector serves it.
"""

from __future__ import annotations

from typing import Any

from kvrelay.vllm.connector import KVRelayConnector, namespace_of


class InjectedFault(RuntimeError):
    pass


class FaultyConnector(KVRelayConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        plan = self.hub.plan

        def faulty_plan(prompt: list[int], namespace: str, num_computed: int):
            if namespace == namespace_of("fault-plan"):
                raise InjectedFault("plan")
            return plan(prompt, namespace, num_computed)

        self.hub.plan = faulty_plan  # type: ignore[method-assign]

    def _index_finished(self, request, block_ids):
        if request.cache_salt == "fault-finish":
            raise InjectedFault("finish")
        return super()._index_finished(request, block_ids)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if request.cache_salt == "fault-grant":
            self._plans.pop(request.request_id, None)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.load_worker
        assert worker is not None
        load = worker.load

        def faulty_load(job):
            if job.namespace == namespace_of("fault-load"):
                raise InjectedFault("load")
            return load(job)

        worker.load = faulty_load  # type: ignore[method-assign]
