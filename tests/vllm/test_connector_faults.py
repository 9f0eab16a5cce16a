"""A failing connector degrades to vLLM's own prefill; it never ends vLLM's engine.

The connector here is kvrelay's with faults injected by ``cache_salt`` (``faulty_connector.py``): a match that raises
and an indexing that raises in vLLM's scheduler, a claim vLLM granted that the scheduler side cannot serve, and a load
that raises in the worker. Each request still gets the answer plain prefill gives (vLLM recomputes a failed load's
blocks under ``kv_load_failure_policy: recompute``), and the server goes on serving, the connector included.

Slow (a vLLM server starts; minutes on a loaded 2-core machine): ``make vllm-test``, not CI.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = {"kv_connector": "FaultyConnector", "kv_connector_module_path": "tests.vllm.faulty_connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
DOC = ("The Treaty of Westphalia, signed in 1648, ended the Thirty Years' War in the Holy Roman Empire and the "
       "Eighty Years' War between Spain and the Dutch Republic. It established the principle of state sovereignty "
       "and recognised the independence of the Swiss Confederation and the Dutch Republic. ") * 3
# the document under two system prompts: the second finds it moved (vLLM's prefix cache finds nothing of it)
UPSTREAM = [{"role": "system", "content": "You are a historian."},
            {"role": "user", "content": DOC + "\nWhen was it signed?"}]
DOWNSTREAM = [{"role": "system", "content": "You are a careful fact checker. Answer briefly."},
              {"role": "user", "content": DOC + "\nWhat did it establish?"}]
LOG_LINES = {"fault-plan": "failed; vLLM prefills it as without the connector",
             "fault-load": "failed; its blocks are reported to vLLM",
             "fault-grant": "its blocks are reported to vLLM as not loaded",
             "fault-finish": "KV not stored (indexing it failed)"}


@pytest.fixture(scope="module")
def server(vllm_server_factory):
    # the engine processes import the faulty connector from the repository root
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return vllm_server_factory(CONNECTOR, extra_args=("--enable-prompt-tokens-details",), env={"PYTHONPATH": path})


@pytest.fixture(scope="module")
def reference(server):
    """The downstream call as plain prefill computes it: under a salt nothing was stored in."""
    from benchmarks.vllm_chain import chat

    return chat(server.client(), server.model, DOWNSTREAM, 8, uuid.uuid4().hex)


def upstream_then_downstream(server, salt: str) -> dict:
    from benchmarks.vllm_chain import chat

    client = server.client()
    chat(client, server.model, UPSTREAM, 8, salt)
    time.sleep(0.5)  # the upstream span is stored in the background
    return chat(client, server.model, DOWNSTREAM, 8, salt)


@pytest.mark.parametrize("salt", ["fault-plan", "fault-load", "fault-grant", "fault-finish"])
def test_a_fault_in_the_connector_gives_plain_prefills_answer(server, reference, salt):
    assert reference["cached_tokens"] == 0
    out = upstream_then_downstream(server, salt)
    assert server.alive(), server.output_tail()
    assert out["text"] == reference["text"]
    top = max(reference["first_logprobs"], key=reference["first_logprobs"].get)
    assert math.isclose(out["first_logprobs"][top], reference["first_logprobs"][top], abs_tol=1e-4)
    assert LOG_LINES[salt] in server.output_tail(200_000)


def test_the_connector_still_serves_after_the_faults(server, reference):
    out = upstream_then_downstream(server, uuid.uuid4().hex)
    assert out["cached_tokens"] >= 100  # the moved document, claimed from the upstream call's span
    assert out["text"].split()[0] == reference["text"].split()[0]
    assert server.alive()
