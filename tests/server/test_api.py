"""The OpenAI API surface of ``kvrelay serve``, driven by the official ``openai`` client."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.conftest import MODEL
from tests.server.live import LiveServer


def salt() -> str:
    return uuid.uuid4().hex  # a fresh namespace: nothing other tests stored can be reused


def test_health_models_metrics(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("kvrelay_requests_total", "kvrelay_ttft_seconds_bucket", "kvrelay_reused_token_layers_total",
                 "kvrelay_computed_token_layers_total", "kvrelay_store_bytes", "kvrelay_queue_depth"):
        assert name in text, name


def test_chat_completion_with_usage_and_extension(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=7, temperature=0,
        extra_body={"cache_salt": salt()})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens == 0
    ext = r.model_extra["kvrelay"]
    assert ext["method"] == "epic" and ext["ttft_ms"] > 0 and ext["reuse_rate"] == 0.0
    assert ext["fallback"] is None and ext["num_recomputed_token_layers"] == 0


def test_max_completion_tokens_seed_and_top_p(server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Pick words."}], temperature=1.0, top_p=0.9,
              seed=7, max_completion_tokens=6)
    a = server.client().chat.completions.create(**kw, extra_body={"cache_salt": salt()})
    b = server.client().chat.completions.create(**kw, extra_body={"cache_salt": salt()})
    assert a.usage.completion_tokens == 6 and a.choices[0].message.content == b.choices[0].message.content


def test_requests_without_a_seed_sample_differently(server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Pick words."}], temperature=1.0,
              max_tokens=12)
    texts = {server.client().chat.completions.create(**kw, extra_body={"cache_salt": salt()}).choices[0].message.content
             for _ in range(3)}
    assert len(texts) > 1  # a fixed default seed would return one text three times


def test_text_completion(server):
    r = server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                           extra_body={"cache_salt": salt()})
    assert r.object == "text_completion" and r.usage.completion_tokens == 5 and isinstance(r.choices[0].text, str)
    ids = server.client().completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=2, temperature=0,
                                             extra_body={"cache_salt": salt()})
    assert ids.usage.prompt_tokens == 4


def test_streaming_with_usage_matches_non_streaming(server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Stream please."}], max_tokens=12, temperature=0)
    whole = server.client().chat.completions.create(**kw, extra_body={"cache_salt": salt()})
    chunks = list(server.client().chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                          extra_body={"cache_salt": salt()}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_string_cuts_the_output(server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Go on."}], max_tokens=30, temperature=1.0, seed=3)
    full = server.client().chat.completions.create(**kw, extra_body={"cache_salt": salt()}).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), "the sampled text should not be blank"
    cut = server.client().chat.completions.create(**kw, stop=[stop], extra_body={"cache_salt": salt()})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
        **kw, stop=stop, stream=True, extra_body={"cache_salt": salt()}) if c.choices)
    assert streamed == full[: full.index(stop)]


def test_logprobs_of_every_token(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"cache_salt": salt()})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:  # greedy: the chosen token is the most likely one
        assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6


def test_concurrent_clients_all_complete_in_one_decode_batch():
    """The six requests are all queued before the worker runs (it is paused), so they are admitted together and
    every decode step of this server runs all six: batching asserted on this server's own steps, not hoped for."""
    srv = LiveServer()

    def one(i: int):
        return srv.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Client {i} asks."}], max_tokens=16, temperature=0,
            extra_body={"cache_salt": salt()})

    try:
        srv.worker.pause()
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(one, i) for i in range(6)]
            srv.wait_until(lambda: srv.num_waiting() == 6, "six requests queued")
            srv.worker.resume()
            results = [f.result() for f in futures]
        assert all(r.usage.completion_tokens == 16 for r in results)
        assert srv.metric("kvrelay_decode_batch_size_count") > 0
        assert srv.metric('kvrelay_decode_batch_size_bucket{le="4.0"}') == 0  # every step ran all six
    finally:
        srv.stop()
