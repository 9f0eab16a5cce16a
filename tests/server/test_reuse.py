"""Reuse from plain chat messages: a 3-agent chain, namespaces, and a client that goes away."""

from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import CallInput, SpanRef, role_key
from kvrelay.server.textstream import decode_logprobs
from kvrelay.weights.loader import load_model
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")
TOP = 5


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)  # the server's weights: random:tiny is seeded


def ask(server, messages, namespace, agent, max_tokens=24, method=None, seed=11):
    extra = {"cache_salt": namespace,
             "kvrelay": {"debug": True, "first_token_logprobs": True, **({"method": method} if method else {})}}
    return server.client(default_headers={"x-kvrelay-agent": agent}).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=True,
        top_logprobs=TOP, extra_body=extra)


def first_top(response) -> list[tuple[int, float]]:
    return [(t.model_extra["id"], t.logprob) for t in response.choices[0].logprobs.content[0].top_logprobs]


@pytest.mark.parametrize("method", ["epic", "naive", "relay[band=1:2:3]"])
def test_three_agent_chain_reuses_and_matches_a_direct_engine_call(server, lm, method):
    ns = uuid.uuid4().hex
    solver = [{"role": "system", "content": "You are a careful math solver."}, {"role": "user", "content": QUESTION}]
    r1 = ask(server, solver, ns, "solver", method=method, seed=1)
    a1 = r1.choices[0].message.content
    critic = [{"role": "system", "content": "You check math solutions and point out errors."},
              {"role": "user", "content": f"Problem:\n{QUESTION}\n\nSolution:\n{a1}\n\nIs it right?"}]
    r2 = ask(server, critic, ns, "critic", method=method, seed=2)
    a2 = r2.choices[0].message.content
    final = [{"role": "system", "content": "You write the final answer."},
             {"role": "user", "content": f"Problem:\n{QUESTION}\n\nSolution:\n{a1}\n\nReview:\n{a2}\n\nAnswer:"}]
    r3 = ask(server, final, ns, "finalizer", method=method, seed=3)

    # the same calls on a direct Engine: same ids, same refs, same stored spans -> same first-token logits
    engine = Engine(lm, KVStore(1 << 30), methods=(method, "full"))
    spans: dict[str, list[int]] = {}
    for seed, r, msgs in ((1, r1, solver), (2, r2, critic), (3, r3, final)):
        dbg = r.model_extra["kvrelay"]["debug"]
        ids, refs = dbg["prompt_ids"], [SpanRef(**ref) for ref in dbg["refs"]]
        # the prompt is the model's chat template of the messages, quoted answers as their generated ids
        text = lm.tokenizer.apply_chat_template(msgs)
        assert lm.tokenizer.decode(ids, skip_special_tokens=False) == text
        for ref in refs:  # every ref points at identical tokens of a span the server stored before
            assert ids[ref.start : ref.end] == spans[ref.span_id][ref.src_start : ref.src_start + ref.num_tokens]
        sampling = SamplingConfig(24, 1.0, 1.0, seed)
        seq = engine.start(CallInput(ids, refs, dbg["agent"]), method, GenerateOptions(sampling, keep_cache=True))
        logprobs = torch.log_softmax(seq.first_logits.float(), -1)
        top = torch.topk(logprobs, TOP)
        served = first_top(r)
        assert [i for i, _ in served] == top.indices.tolist()
        assert [lp for _, lp in served] == pytest.approx(top.values.tolist(), abs=1e-4)
        # the whole first-token distribution (what a client measures KL against `full` with)
        whole = decode_logprobs(r.model_extra["kvrelay"]["first_token_logprobs"])
        assert whole.shape == logprobs.shape and torch.allclose(whole, logprobs, atol=1e-5)
        while not seq.done:
            engine.step([seq])
        out = engine.finish(seq)
        assert out.output_ids == dbg["output_ids"]
        engine.publish(dbg["span_id"], out)
        spans[dbg["span_id"]] = ids + out.output_ids
        assert r.usage.prompt_tokens_details.cached_tokens == out.stats.num_reused_tokens

    d1, d2, d3 = (r.model_extra["kvrelay"]["debug"] for r in (r1, r2, r3))
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    for r in (r2, r3):
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert r.model_extra["kvrelay"]["reuse_rate"] > 0
    # agent 1's answer is spliced as its generated ids into both later prompts, agent 2's into the last
    outputs = {(ref["span_id"], ref["src_start"]) for ref in d3["refs"] if ref["kind"] == "output"}
    assert (d1["span_id"], len(d1["prompt_ids"])) in outputs and (d2["span_id"], len(d2["prompt_ids"])) in outputs
    assert any(ref["kind"] == "output" and ref["span_id"] == d1["span_id"] for ref in d2["refs"])
    # the question is found in agent 1's prompt by token matching
    assert any(ref["kind"] == "input" for ref in d2["refs"])


def test_agent_identity_from_the_header_or_the_system_prompt_and_kvcomm_per_request(server):
    ns = uuid.uuid4().hex
    solver = [{"role": "system", "content": "You solve."}, {"role": "user", "content": QUESTION}]
    a = ask(server, solver, ns, "solver", max_tokens=8, method="kvcomm")
    assert a.model_extra["kvrelay"]["method"] == "kvcomm"
    assert a.model_extra["kvrelay"]["debug"]["agent"] == "solver"
    # the role (what per-role state keys on) is the system prompt's, whatever the header names
    assert a.model_extra["kvrelay"]["debug"]["role"] == role_key("You solve.")
    answer = a.choices[0].message.content
    critic = [{"role": "system", "content": "You review."},
              {"role": "user", "content": f"Problem:\n{QUESTION}\n\nAnswer:\n{answer}"}]
    extra = {"cache_salt": ns, "kvrelay": {"debug": True, "method": "kvcomm"}}
    b = server.client().chat.completions.create(model=MODEL, messages=critic, max_tokens=4, temperature=0,
                                                extra_body=extra)
    ext = b.model_extra["kvrelay"]
    assert ext["method"] == "kvcomm" and ext["debug"]["agent"].startswith("sys-")  # no header: the system prompt's
    c = server.client().chat.completions.create(model=MODEL, messages=critic, max_tokens=4, temperature=0,
                                                extra_body=extra)
    assert c.model_extra["kvrelay"]["debug"]["agent"] == ext["debug"]["agent"]  # the same system prompt, one agent
    # the solver's answer is found in the critic's message; kvcomm's first calls of an agent fill its
    # anchor pool with dense prefills, and say so
    assert any(r["kind"] == "output" for r in ext["debug"]["refs"]) and "dense prefill" in ext["fallback"]


def test_namespaces_never_share(server):
    messages = [{"role": "system", "content": "A long shared system prompt that every agent of the tenant has, "
                                              "written out so that it spans several token blocks of the index."},
                {"role": "user", "content": "Hello there, what is two plus two?"}]
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    assert ask(server, messages, a, "x").usage.prompt_tokens_details.cached_tokens == 0
    assert ask(server, messages, b, "x").usage.prompt_tokens_details.cached_tokens == 0  # not a's
    assert ask(server, messages, a, "x").usage.prompt_tokens_details.cached_tokens > 0  # a's own


def test_full_method_per_request_reuses_nothing(server):
    messages = [{"role": "user", "content": "The same prompt twice, long enough to fill two blocks of tokens."}]
    ns = uuid.uuid4().hex
    ask(server, messages, ns, "x")
    r = ask(server, messages, ns, "x", method="full")
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.model_extra["kvrelay"]["method"] == "full"


def test_disconnect_mid_stream_cancels_and_frees(server):
    before_cancelled = server.metric("kvrelay_cancelled_total")
    before_spans = server.metric("kvrelay_store_spans")
    with httpx.Client(timeout=30) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Talk for a long time."}],
                "max_tokens": 8000, "temperature": 0, "stream": True, "cache_salt": uuid.uuid4().hex}
        with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in seen)
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server.metric("kvrelay_cancelled_total") < before_cancelled + 1:
        time.sleep(0.1)
    assert server.metric("kvrelay_cancelled_total") == before_cancelled + 1
    while time.monotonic() < deadline and server.metric("kvrelay_running_requests") > 0:
        time.sleep(0.1)
    assert server.metric("kvrelay_running_requests") == 0
    assert server.metric("kvrelay_sequence_kv_bytes") == 0  # its KV is freed
    assert server.metric("kvrelay_store_spans") == before_spans  # and nothing of it was published
    assert server.alive()



def test_cache_output_false_stores_nothing(server):
    ns = uuid.uuid4().hex
    before = server.metric("kvrelay_store_spans")
    messages = [{"role": "user", "content": "A probe whose output must not be cached for anyone later."}]
    extra = {"cache_salt": ns, "kvrelay": {"cache_output": False}}
    server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body=extra)
    assert server.metric("kvrelay_store_spans") == before
    assert ask(server, messages, ns, "x").usage.prompt_tokens_details.cached_tokens == 0


def test_disconnect_while_waiting_for_a_whole_response_cancels():
    """The client closes its connection while its request certainly waits (the worker is paused): the request is
    cancelled and never runs."""
    srv = LiveServer()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "A long answer, not streamed."}],
                       "max_tokens": 8, "temperature": 0, "cache_salt": uuid.uuid4().hex}).encode()
    try:
        srv.worker.pause()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            srv.wait_until(lambda: srv.num_waiting() == 1, "the request waiting")
        srv.wait_until(lambda: srv.metric("kvrelay_cancelled_total") == 1, "the request cancelled")
        assert srv.num_waiting() == 0
        srv.worker.resume()
        assert srv.metric("kvrelay_generated_tokens_total") == 0 and srv.worker.num_running == 0
    finally:
        srv.stop()
