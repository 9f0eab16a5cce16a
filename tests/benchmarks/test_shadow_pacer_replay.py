"""benchmarks/shadow_pacer_replay.py's pure helpers (benchmarks/shadow_load_stats.py): the prefill fit, the replay of
recorded calls through the shadow pacer and the split by prompt-length quartile (synthetic rows; no server)."""

from __future__ import annotations

import pytest
from shadow_load_stats import call_live_ms, fit_prefill_coef, replay_pacer, shadowed_by_quartile
from shadow_pacer_replay import RULES, PositiveCreditPacer

from kvrelay.server.shadow_pacer import ShadowPacer


def _row(num_tokens: int, prefill_ms: float, decode_ms: float = 0.0, cached: int = 0, sent_s: float = 0.0) -> dict:
    return {"prompt_tokens": num_tokens, "cached_tokens": cached, "engine_ttft_ms": prefill_ms + 2.0, "queue_ms": 2.0,
            "ttft_ms": prefill_ms + 5.0, "total_ms": prefill_ms + 5.0 + decode_ms, "sent_s": sent_s}


def test_the_prefill_fit_recovers_a_piece_cost_a_token_cost_and_an_attention_cost_from_whole_prefills():
    fixed, per_token, per_key = 20.0, 2.5, 1e-3
    rows = [_row(n, fixed * -(-n // 512) + per_token * n + per_key * n * (n + 1) / 2) for n in (200, 350, 700,
                                                                                                 1500, 2600, 3300)]
    rows.append(_row(3000, 1.0, cached=2900))  # reused most of its prompt: not a whole prefill, not fitted
    assert fit_prefill_coef(rows, 512) == pytest.approx((fixed, per_token, per_key), rel=1e-6)
    assert call_live_ms(_row(100, 40.0, 300.0)) == pytest.approx((40.0, 300.0))
    with pytest.raises(ValueError, match="no recorded call"):
        fit_prefill_coef([_row(100, 1.0, cached=50)], 512)


def test_a_call_is_offered_after_its_prefill_has_earned_and_before_its_decode_does():
    """Share 0.5: the first call's prefill (100 ms) earns 50 ms, so on the positive-credit rule it is offered on a
    positive credit (its own prefill's earning counted) or not (left out); its decode's earnings come after the
    offer, so the second call, with no prefill of its own, finds the debt (or, left out, the credit). The server's
    rule is offered each call's cost, with the call's prefill in the window and its decode not yet."""
    calls = [_row(10, 100.0, 100.0, sent_s=0.0), _row(10, 0.0, 1000.0, sent_s=1.0), _row(10, 0.0, 0.0, sent_s=2.0)]
    out = replay_pacer(calls[::-1], PositiveCreditPacer(0.5, lambda: 0.0), lambda c: 200.0,  # sorted by send time
                       lambda pacer, cost, prefill_ms: pacer.positive(0.0))
    assert out["taken"] == [True, False, True]
    own = replay_pacer(calls, PositiveCreditPacer(0.5, lambda: 0.0), lambda c: 200.0,
                       lambda pacer, cost, prefill_ms: pacer.positive(prefill_ms))
    assert own["taken"] == [False, True, True]
    assert out["shadow_ms"] == 400.0 and out["live_ms"] == pytest.approx(1200.0)
    assert out["shadow_share_of_live"] == pytest.approx(400.0 / 1200.0)
    asked = []

    def drawn(pacer, cost, prefill_ms):
        taken = RULES["bernoulli"][1](pacer, cost, prefill_ms)
        asked.append((cost, pacer.rate))
        return taken

    replay_pacer(calls, ShadowPacer(0.5, lambda: 0.0), lambda c: 200.0, drawn)
    assert asked[0] == (200.0, pytest.approx(0.5 * 100.0 * (1 - 1 / 256) / 200.0))  # its prefill, not its decode


def test_calls_are_counted_per_prompt_length_quartile_an_edge_in_the_lower_one():
    num_tokens = [100, 200, 300, 400, 500, 600, 700, 800]
    taken = [True, False, False, False, True, True, False, True]
    out = shadowed_by_quartile(num_tokens, taken, edges=[200.0, 400.0, 600.0])
    assert [(q["num_calls"], q["num_shadowed"]) for q in out["quartiles"]] == [(2, 1), (2, 0), (2, 2), (2, 1)]
    assert out["quartiles"][2]["share_shadowed"] == 1.0
    assert shadowed_by_quartile(num_tokens, taken)["edges_tokens"] == [275.0, 450.0, 625.0]
