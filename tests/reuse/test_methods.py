"""Reuse methods on a tiny model: exactness limits, schedules' token counts, selector, profiler."""

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.profiler import choose_band, choose_by_fidelity, choose_detection_layer, fidelity_candidates
from kvrelay.reuse.relay import select_tokens
from tests.helpers import generate, publish, tiny_lm

L = 4  # layers of the tiny model


@pytest.fixture(scope="module")
def setup():
    """An upstream call published with hidden states at layer 2; a downstream call that splices its output
    after a different prefix (so the output's KV is approximate there)."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    gen = torch.Generator().manual_seed(0)
    up_prompt = torch.randint(0, 256, (20,), generator=gen).tolist()
    up = generate(lm, up_prompt, "full", store, SamplingConfig(max_new_tokens=24), capture_layers=(2,),
                  keep_cache=True)
    publish(store, "up", up, lm)
    head = torch.randint(0, 256, (7,), generator=gen).tolist()
    tail = torch.randint(0, 256, (5,), generator=gen).tolist()
    ids = head + up.output_ids + tail
    call = CallInput(ids, [SpanRef(7, 7 + 24, "up", 20, "output")])
    full = generate(lm, call, "full", store, SamplingConfig(max_new_tokens=1))
    return lm, store, call, full


def _run(setup, spec):
    lm, store, call, _ = setup
    return generate(lm, call, get_method(spec), store, SamplingConfig(max_new_tokens=1))


def test_naive_reuses_every_span_token_and_recomputes_nothing(setup):
    out = _run(setup, "naive")
    assert out.stats.num_reused_tokens == 24 and out.stats.num_shifted_tokens == 24
    assert out.stats.num_computed_token_layers == (36 - 24) * L
    assert out.stats.recompute_frac == 0.0


def test_relay_with_every_token_selected_reproduces_full(setup):
    full = setup[3]
    out = _run(setup, f"relay[l_start=0,l_det=0,l_end={L - 1},tau_dev=0,tau_inf=0]")
    torch.testing.assert_close(out.first_logits, full.first_logits, atol=1e-4, rtol=0)
    assert out.stats.recompute_frac == 1.0


def test_relay_with_empty_band_and_no_selection_equals_naive(setup):
    naive = _run(setup, "naive")
    out = _run(setup, f"relay[l_start={L},l_det={L},l_end={L},tau_dev=1e9,tau_inf=1e9,l_suf=0]")
    torch.testing.assert_close(out.first_logits, naive.first_logits, atol=0, rtol=0)
    assert out.stats.num_computed_token_layers == naive.stats.num_computed_token_layers


def test_relay_enters_at_l_start_from_carried_hidden_states(setup):
    # band [2, 2]: nothing selected, so span tokens are computed at layer 2 only (entering from hidden states)
    out = _run(setup, "relay[l_start=2,l_det=2,l_end=3,tau_dev=1e9,tau_inf=1e9,l_suf=0]")
    assert out.stats.num_computed_token_layers == 12 * L + 24 * 1
    assert out.stats.note is None
    # with everything selected from layer 2 on, layers 2-3 of the span are recomputed: 2 of 4 layers
    out = _run(setup, "relay[l_start=2,l_det=2,l_end=3,tau_dev=0,tau_inf=0]")
    assert out.stats.recompute_frac == 0.5


def test_relay_recomputes_from_layer0_a_span_without_hidden_states_and_says_so(setup):
    lm, store, call, _ = setup
    bare = KVStore(1 << 30)
    span = store.get("up")
    bare.put("up", type(span)(span.token_ids, 0, span.k, span.v, span.fingerprint))  # no hidden states
    out = generate(lm, call, get_method("relay[l_start=2,l_det=2,l_end=3,tau_dev=1e9,tau_inf=1e9,l_suf=0]"), bare,
                   SamplingConfig(max_new_tokens=1))
    assert "24 span tokens had no hidden state at L_start=2: recomputed from layer 0" in out.stats.note
    assert out.stats.num_computed_token_layers == 12 * L + 24 * 3  # layers 0, 1, 2


def test_relay_l_pre_keeps_each_span_opening_through_the_band(setup):
    # nothing selected but the first 5 span tokens: from layer 0 all 24 span tokens compute layer 0 (the
    # select layer), then only those 5 stay to the top; this is epic[k=5] plus layer 0 of the other 19
    out = _run(setup, f"relay[l_start=0,l_det=0,l_end={L - 1},l_pre=5,l_suf=0,tau_dev=1e9,tau_inf=1e9]")
    epic = _run(setup, "epic[k=5]")
    assert out.stats.num_computed_token_layers == epic.stats.num_computed_token_layers + 19
    # layer 0's K/V depend on the token and its position only, so recomputing them changes nothing
    torch.testing.assert_close(out.first_logits, epic.first_logits, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="l_pre"):
        get_method("relay[l_pre=-1]")


def test_epic_recomputes_the_first_k_tokens_of_each_span(setup):
    out = _run(setup, "epic[k=5]")
    assert out.stats.num_computed_token_layers == (12 + 5) * L
    assert out.stats.recompute_frac == pytest.approx(5 / 24)


def test_cacheblend_keeps_the_top_r_after_the_check_layer(setup):
    out = _run(setup, "cacheblend[check_layer=1,ratio=0.25]")
    # all 24 span tokens at layers 0-1, then 6 (25%) at layers 2-3
    assert out.stats.num_computed_token_layers == 12 * L + 24 * 2 + 6 * 2


def test_cacheblend_with_full_ratio_reproduces_full(setup):
    out = _run(setup, "cacheblend[ratio=1.0]")
    torch.testing.assert_close(out.first_logits, setup[3].first_logits, atol=1e-4, rtol=0)


def test_selector_sets_on_hand_made_vectors():
    dev = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.3, 0.1])  # mean 0.267: 1.5x = 0.4 -> token 3
    inf = torch.tensor([1.0, 1.0, 4.0, 1.0, 1.0, 1.0])  # mean 1.5: 1.45x = 2.175 -> token 2
    suffix = torch.tensor([False, False, False, False, False, True])
    keep = select_tokens(dev, inf, suffix, tau_dev=1.5, tau_inf=1.45)
    assert keep.tolist() == [False, False, True, True, False, True]
    assert select_tokens(dev, None, torch.zeros(6, dtype=torch.bool), 1.5, 1.45).nonzero().flatten().tolist() == [3]
    assert select_tokens(None, inf, torch.zeros(6, dtype=torch.bool), 1.5, 1.45).nonzero().flatten().tolist() == [2]


def test_profiler_picks_a_known_band_and_detection_layer():
    curve = [0.0, 0.0, 1.0, 5.0, 5.0, 1.0, 0.0, 0.0]
    assert choose_band(curve, 0.8) == (3, 4)  # 10 of 12
    assert choose_band(curve, 0.95) == (2, 5)
    gen = torch.Generator().manual_seed(0)
    later = torch.rand(50, generator=gen)
    token_dev = torch.rand(8, 50, generator=gen)
    token_dev[3] = later * 2 + 0.01  # layer 3 ranks tokens exactly as the later layers' mean does
    token_dev[4:7] = later
    det, scores = choose_detection_layer(token_dev, 2, 6)
    assert det == 3 and scores[3] == pytest.approx(1.0)


def test_profiler_fidelity_candidates_and_choice():
    assert fidelity_candidates(30, (18, 27, 29)) == [(18, 27, 29), (1, 2, 29), (2, 3, 29), (4, 5, 29), (8, 9, 29),
                                                     (16, 17, 29)]
    assert fidelity_candidates(4, (1, 2, 3)) == [(1, 2, 3), (2, 3, 3)]  # no duplicate of the deviation band
    scores = {(18, 27, 29): (0.030, 0.51), (1, 2, 29): (0.010, 0.50), (2, 3, 29): (0.0105, 0.52),
              (4, 5, 29): (0.012, 0.60)}
    assert choose_by_fidelity(scores) == (2, 3, 29)  # within 10% of the lowest KL, the most reuse
    assert choose_by_fidelity(scores, kl_tolerance=0.0) == (1, 2, 29)
    assert choose_by_fidelity(scores, kl_tolerance=0.25) == (4, 5, 29)
    assert choose_by_fidelity({(1, 2, 3): (0.0, 0.4), (2, 3, 3): (0.0, 0.4)}) == (1, 2, 3)  # full tie: the earlier


def test_build_profile_scores_every_candidate_band_on_train():
    from kvrelay.model.loader import load_model
    from kvrelay.reuse.profiler import build_profile

    lm = load_model("random:tiny")
    profile = build_profile(lm, num_problems=2, progress=False)
    top = lm.config.num_layers - 1
    bands = fidelity_candidates(lm.config.num_layers, tuple(profile.deviation_band))
    assert sorted(profile.band_scores) == sorted(",".join(map(str, b)) for b in bands)
    scores = {tuple(map(int, k.split(","))): (v["kl"], v["reuse"]) for k, v in profile.band_scores.items()}
    assert (profile.l_start, profile.l_det, profile.l_end) == choose_by_fidelity(scores)
    assert profile.select == "fidelity" and "train" in profile.calibration["data"]
    assert all(0.0 < reuse < 1.0 and kl >= 0.0 for kl, reuse in scores.values())
    assert scores[(1, 2, top)][1] != scores[(2, 3, top)][1] or top == 2  # different bands recompute differently
    paper = build_profile(lm, num_problems=2, progress=False, select="deviation")
    assert [paper.l_start, paper.l_det, paper.l_end] == paper.deviation_band and paper.band_scores == {}


def test_your_profile_wins_over_the_shipped_one_and_says_so(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from kvrelay.reuse import relay
    from kvrelay.reuse.profiler import LayerProfile, profile_path

    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(relay, "_PROFILES", {})
    lm = SimpleNamespace(fingerprint="f00d", name="toy")
    make = lambda *layers: LayerProfile("f00d", "toy", 4, *layers, 0.9, [], [], [])  # noqa: E731
    shipped_dir = tmp_path / "shipped"
    make(1, 2, 3).save(shipped_dir / profile_path("f00d").name)
    assert relay.layer_profile(lm, shipped_dir=shipped_dir).layers == (1, 2, 3)  # only the shipped one
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(relay, "_PROFILES", {})
    make(2, 3, 3).save(profile_path("f00d"))
    assert relay.layer_profile(lm, shipped_dir=shipped_dir).layers == (2, 3, 3)
    err = capsys.readouterr().err
    assert "L_start 2 / L_det 3 / L_end 3" in err and "shipped with kvrelay has L_start 1 / L_det 2" in err
    monkeypatch.setattr(relay, "_PROFILES", {})
    make(1, 2, 3).save(profile_path("f00d"))  # the same layers: nothing to say
    assert relay.layer_profile(lm, shipped_dir=shipped_dir).layers == (1, 2, 3)
    assert capsys.readouterr().err == ""


def test_method_parameter_types_are_checked():
    with pytest.raises(ConfigError, match="gamma='x' is not a valid float"):
        get_method("kvcomm[gamma=x]")
    with pytest.raises(ConfigError, match="k=1.5 is not a valid int"):
        get_method("epic[k=1.5]")
    assert get_method("relay[tau_dev=2,l_start=none,band=false]").tau_dev == 2.0


def test_bad_method_parameters():
    with pytest.raises(ConfigError, match="unknown parameter 'tau'"):
        get_method("relay[tau=1]")
    with pytest.raises(ConfigError, match="selector must be one of"):
        get_method("relay[selector=magic]")
    with pytest.raises(ConfigError, match="ratio must be in"):
        get_method("cacheblend[ratio=2]")


def test_zero_deviation_selects_nothing():
    zeros = torch.zeros(4)
    assert not select_tokens(zeros, zeros, torch.zeros(4, dtype=torch.bool), 1.5, 1.45).any()
