"""benchmarks/quality_guard_flow.py's scoring: the reference on the same prompt ids, KL and agreement against it, and
the per-role report (synthetic replies and rows here; no server)."""

from __future__ import annotations

import json
import math

import httpx
import torch
from quality_guard_flow import compare, probe_body, reference, role_report

from kvrelay.quality import QualityConfig
from kvrelay.server.textstream import encode_logprobs


def reply(logits: list[float], prompt_ids: list[int], reuse_rate: float = 0.0) -> dict:
    return {"usage": {"prompt_tokens": len(prompt_ids)},
            "kvrelay": {"first_token_logprobs": encode_logprobs(torch.tensor(logits)), "reuse_rate": reuse_rate,
                        "method": "full", "ttft_ms": 1.0, "debug": {"prompt_ids": prompt_ids}}}


def test_kl_is_full_against_the_call_and_exact_over_the_vocabulary():
    from quality_guard_flow import first_token

    p, q = [2.0, 0.0, -1.0, -3.0], [0.0, 1.0, 0.5, -1.0]
    full, got = first_token(reply(p, [1, 2, 3])), first_token(reply(q, [1, 2, 3], reuse_rate=0.5))
    out = compare(full, got)
    lp, lq = torch.log_softmax(torch.tensor(p).double(), -1), torch.log_softmax(torch.tensor(q).double(), -1)
    want = float((lp.exp() * (lp - lq)).sum())  # KL(full || call): the guard's direction
    assert math.isclose(out["kl"], want, rel_tol=1e-5)
    assert not math.isclose(want, float((lq.exp() * (lq - lp)).sum()), rel_tol=1e-2)  # the other one differs here
    assert out["agree"] is False and out["same_prompt_ids"] and out["reuse_rate"] == 0.5
    assert compare(full, first_token(reply(p, [1, 2, 4])))["same_prompt_ids"] is False


def test_the_reference_runs_on_the_guarded_calls_prompt_ids_when_the_body_tokenizes_otherwise():
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((request.url.path, body))
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, json=reply([0.0, 1.0], [5, 6, 7, 8]))  # re-tokenized: other ids
        return httpx.Response(200, json=reply([1.0, 0.0], body["prompt"]))

    client = httpx.Client(base_url="http://full", transport=httpx.MockTransport(handler))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "max_completion_tokens": 24, "kvrelay": {"debug": True}}
    ref = reference(client, body, [5, 6, 78])
    assert [path for path, _ in sent] == ["/v1/chat/completions", "/v1/completions"]
    assert sent[1][1]["prompt"] == [5, 6, 78] and sent[1][1]["max_tokens"] == 1
    assert sent[1][1]["kvrelay"]["cache_output"] is False
    assert ref["prompt_ids"] == [5, 6, 78] and ref["chat_same_prompt_ids"] is False and ref["chat_prompt_tokens"] == 4
    sent.clear()
    ref = reference(client, body, [5, 6, 7, 8])  # the same ids: the chat body's reference is the reference
    assert [path for path, _ in sent] == ["/v1/chat/completions"] and ref["chat_same_prompt_ids"] is True


def test_a_probe_is_one_token_not_stored_and_names_its_method():
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 48, "kvrelay": {"debug": True}, "cache_salt": "s"}
    probe = probe_body(body, method="naive")
    assert probe["max_tokens"] == 1 and "max_completion_tokens" not in probe and "stream" not in probe
    assert probe["kvrelay"] == {"debug": True, "first_token_logprobs": True, "method": "naive", "cache_output": False}
    assert probe["cache_salt"] == "s" and body["kvrelay"] == {"debug": True}  # the recorded body is left as sent


def rows(num_calls: int, naive_kl: float) -> list[dict]:
    def rung(kl: float, reuse_rate: float) -> dict:
        return {"kl": kl, "agree": kl < 0.1, "reuse_rate": reuse_rate, "prompt_tokens": 100, "same_prompt_ids": True}

    # the live calls: prefix (bad KL, no reuse) for the first 20, relay after
    return [{"agent": "checker", "rung": "prefix" if i < 20 else "relay", **rung(0.2 if i < 20 else 0.01, 0.6),
             "chat_same_prompt_ids": i != 3, "live_vs_probe_kl": 0.0,
             "rungs": {"naive": rung(naive_kl, 0.8), "relay": rung(0.01, 0.6), "prefix": rung(0.0, 0.1)}}
            for i in range(num_calls)]


def test_the_report_scores_the_calls_after_the_20th_and_the_best_static_rung_in_hindsight():
    report = role_report(rows(40, naive_kl=0.3), QualityConfig())
    assert report["quality_after_20"] == {"num_calls": 20, "kl_mean": 0.01, "agreement": 1.0}
    assert report["meets_target_after_20"] is True and report["quality_all"]["agreement"] == 0.5
    assert report["best_static"] == "relay" and report["static"]["naive"]["meets_target"] is False
    assert math.isclose(report["reuse_vs_best_static"], 1.0)
    assert report["rung_calls"] == {"naive": 0, "relay": 20, "prefix": 20}
    assert report["rung_changes"] == [[21, "prefix", "relay"]]
    assert report["num_chat_prompt_id_mismatches"] == 1 and report["num_reference_prompt_id_mismatches"] == 0
    cheap = role_report(rows(40, naive_kl=0.001), QualityConfig())
    assert cheap["best_static"] == "naive" and math.isclose(cheap["reuse_vs_best_static"], 0.6 / 0.8)
    assert cheap["trace"][0] == ["prefix", 0, 0.2, 0]


def test_replay_runs_the_guard_over_the_probes_not_the_live_rungs():
    import quality_guard
    from quality_guard_flow import guard_rows

    probed = rows(40, naive_kl=0.3)
    for row in probed:
        for got in row["rungs"].values():
            got["ttft_ms"] = 1.0
    report = quality_guard.role_report(guard_rows(probed), QualityConfig())
    # the live rows ran prefix for 20 calls; the guard replayed from the probes starts at relay and stays there
    assert report["rung_calls"] == {"naive": 0, "relay": 40, "prefix": 0}
    assert report["quality_after_20"]["kl_mean"] == 0.01 and math.isclose(report["reuse"], 0.6)
    assert report["num_shadowed"] == 17 and report["shadow_share"] is None  # no decode or reference time was kept
