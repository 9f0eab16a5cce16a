"""The connector's scheduler-side hooks without a server: they run inside vLLM's scheduler, where an exception would
end the engine, so every failure there leaves the request to vLLM's own prefill; a request whose span the store could
never hold is not indexed. The connector is built without vLLM's config (its hooks read only what is set here)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvrelay.vllm.hub import ConnectorConfig, Hub
from kvrelay.vllm.plan import LoadPlan, Piece

BLOCK = 16
BYTES_PER_TOKEN = 46_080  # SmolLM2's K and V at every layer, fp32


@pytest.fixture
def connector():
    from kvrelay.vllm.connector import KVRelayConnector

    c = KVRelayConnector.__new__(KVRelayConnector)
    c.config = ConnectorConfig(kv_budget_gb=0.01)  # 10 MiB: 227 tokens of SmolLM2
    c.hub = Hub(c.config, "fp-test")
    c.block_size, c._span_bytes_per_token = BLOCK, BYTES_PER_TOKEN
    c._plans, c._asked, c._saves, c._loads, c._failed_blocks = {}, {}, [], [], set()
    return c


def request(num_tokens: int, salt: str | None = None, req_id: str = "r1") -> SimpleNamespace:
    ids = list(range(100, 100 + num_tokens))
    return SimpleNamespace(request_id=req_id, prompt_token_ids=ids, all_token_ids=ids, num_computed_tokens=num_tokens,
                           num_prompt_tokens=num_tokens, cache_salt=salt)


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_a_finished_request_is_indexed_and_its_blocks_held(connector):
    assert connector.request_finished(request(100), list(range(7))) == (True, None)
    (job,) = connector._saves
    assert len(job.token_ids) == 100 and job.block_ids == list(range(7))
    assert connector.hub.plan(list(range(100, 150)), "", 0) is not None  # a later prompt quoting it claims


def test_a_span_larger_than_the_store_is_not_indexed(connector, caplog):
    with caplog.at_level(logging.WARNING, "kvrelay.vllm"):
        assert connector.request_finished(request(300), list(range(19))) == (False, None)
    assert connector._saves == [] and not connector.hub.pending
    assert "300 tokens need 13824000 bytes, more than the store's memory tier holds (kv_budget_gb 0.01)" in caplog.text
    assert connector.hub.plan(list(range(100, 400)), "", 0) is None  # nothing planned on a span never stored


def test_a_failing_match_leaves_the_request_to_vllm(connector, caplog, monkeypatch):
    def broken(*args):
        raise RuntimeError("index broken")

    monkeypatch.setattr(connector.hub, "plan", broken)
    with caplog.at_level(logging.ERROR, "kvrelay.vllm"):
        assert connector.get_num_new_matched_tokens(request(50), 0) == (0, False)
    assert "matching request r1 failed; vLLM prefills it as without the connector" in caplog.text


def test_a_failing_index_frees_the_blocks_at_once(connector, caplog, monkeypatch):
    def broken(*args):
        raise RuntimeError("catalog broken")

    monkeypatch.setattr(connector.hub.catalog, "new_span_id", broken)
    with caplog.at_level(logging.ERROR, "kvrelay.vllm"):
        assert connector.request_finished(request(50), [0, 1, 2, 3]) == (False, None)
    assert connector._saves == [] and "KV not stored (indexing it failed)" in caplog.text


def test_a_claim_granted_without_a_plan_is_reported_unloaded(connector, caplog):
    """vLLM granted a claim the scheduler side holds no plan for: the worker reports its blocks, vLLM recomputes."""
    connector.request_finished(request(80, req_id="r0"), list(range(5)))  # a span the next request quotes
    req = request(80)
    req.num_computed_tokens = 0  # as vLLM has it while it allocates: its own hit is set after
    assert connector.get_num_new_matched_tokens(req, 16) == (63, False)  # past vLLM's own 16, up to the last token
    del connector._plans[req.request_id]  # the plan lost: the scheduler side cannot serve the claim
    connector.update_state_after_alloc(req, blocks(list(range(10, 16))), 48)
    (job,) = connector._loads
    assert job.error == "granted 48 tokens, not the None planned"
    assert (job.plan.num_computed, job.plan.end) == (16, 64)
    connector.update_state_after_alloc(request(80, req_id="r2"), blocks([1]), 0)  # nothing granted: nothing to do
    assert len(connector._loads) == 1
    # the worker side: no load runs, the claimed blocks (16..64: the second to the fourth) are reported
    connector._worker, connector._saver = object(), SimpleNamespace(submit=lambda job: None)
    connector._get_connector_metadata = lambda: connector.build_connector_meta(None)
    with caplog.at_level(logging.WARNING, "kvrelay.vllm"):
        connector.start_load_kv(None)
    assert connector.get_block_ids_with_load_errors() == {11, 12, 13}
    assert "its blocks are reported to vLLM as not loaded" in caplog.text


def test_a_claim_granted_as_planned_becomes_a_load(connector):
    req = request(80)
    plan = LoadPlan(0, 64, [Piece("s", 0, 0, 64, True)])
    connector._plans[req.request_id] = plan
    connector.update_state_after_alloc(req, blocks([5, 6, 7, 8, 9]), 64)
    (job,) = connector._loads
    assert job.error is None and job.plan is plan and job.token_ids == req.prompt_token_ids[:64]


def test_a_worker_report_that_cannot_be_applied_never_ends_the_engine(connector, caplog, monkeypatch):
    from kvrelay.vllm.connector import KVRelayWorkerReport

    def broken(*args):
        raise RuntimeError("hub broken")

    monkeypatch.setattr(connector.hub, "reported", broken)
    report = KVRelayWorkerReport(stored=[("", "s1")], dropped=[])
    with caplog.at_level(logging.ERROR, "kvrelay.vllm"):
        connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    assert "the worker's report of stored and dropped spans was not applied" in caplog.text
