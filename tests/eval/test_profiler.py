"""The layer profiler (``kvrelay profile``): band and detection-layer rules, candidate bands, a build."""

from dataclasses import replace

import pytest
import torch

from kvrelay.eval.profiler import (
    build_profile,
    choose_band,
    choose_by_fidelity,
    choose_detection_layer,
    detection_candidates,
    fidelity_candidates,
    search_candidates,
)
from kvrelay.eval.selector_calibration import (
    AT_START,
    BAND_KNOBS,
    KL_SHARE_OF_EPIC,
    SELECTOR_CANDIDATES,
    candidate_band,
    choose_selector,
    selector_spec,
)
from kvrelay.weights import presets
from kvrelay.weights.loader import load_model


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
    # a costlier detection layer lowers the lowest KL; with the first pass's bar it cannot win on KL alone
    later = scores | {(1, 9, 29): (0.002, 0.30)}
    assert choose_by_fidelity(later) == (1, 9, 29)
    assert choose_by_fidelity(later, kl_bar=0.011) == (2, 3, 29)


def test_search_candidates_free_every_layer_of_the_band():
    bands = search_candidates(12, (6, 9, 11))
    assert bands == [(6, 9, 11), (1, 2, 11), (1, 2, 9), (1, 2, 7), (1, 2, 3), (2, 3, 11), (2, 3, 9), (2, 3, 7),
                     (4, 5, 11), (4, 5, 9), (4, 5, 7), (8, 9, 11)]
    assert all(end >= start + 2 for start, _, end in bands[1:])  # a kept token runs past detection
    assert search_candidates(12, (2, 3, 11))[0] == (2, 3, 11) and len(search_candidates(12, (2, 3, 11))) == 11
    assert detection_candidates((2, 3, 21)) == [(2, 4, 21), (2, 6, 21), (2, 10, 21), (2, 18, 21)]
    assert detection_candidates((4, 5, 6)) == []


def test_build_profile_searches_bands_that_end_below_the_top(monkeypatch):
    monkeypatch.setitem(presets.PRESETS, "tiny8", replace(presets.PRESETS["tiny"], num_layers=8))
    lm = load_model("random:tiny8")
    profile = build_profile(lm, num_problems=1, progress=False)
    assert profile.select == "search"
    scores = {tuple(map(int, k.split(","))): (v["kl"], v["reuse"]) for k, v in profile.band_scores.items()}
    first = search_candidates(lm.config.num_layers, tuple(profile.deviation_band))
    best_first = choose_by_fidelity({b: scores[b] for b in first})
    assert set(scores) == set(first) | set(detection_candidates(best_first))
    bar = 1.1 * min(scores[b][0] for b in first)  # the first pass's bar holds for the second
    best_start, best_det, best_end = choose_by_fidelity(scores, kl_bar=bar)
    assert any(end < lm.config.num_layers - 1 for _, _, end in scores)
    # the last pass chose relay's selector for that band on the same calls
    searched = (best_start, best_det, best_end)
    valid = [k for k in SELECTOR_CANDIDATES if candidate_band(k, searched, lm.config.num_layers) is not None]
    assert len(valid) < len(SELECTOR_CANDIDATES)  # bands of their own that do not fit 8 layers are not scored
    assert sorted(profile.selector_scores) == sorted([selector_spec(k) for k in valid] + ["epic"])
    # scored along full's continuation (the default), chosen by that KL under epic's reuse, half its KL and its
    # greedy share
    sel = {k: (v["kl"], v["reuse"], v["path_kl"], v["greedy"]) for k, v in profile.selector_scores.items()
           if k != "epic"}
    epic = profile.selector_scores["epic"]
    assert profile.calibration["selector_path_tokens"] == 32 and 0.0 <= epic["greedy"] <= 1.0
    chosen = choose_selector(sel, selector_spec({}), epic["reuse"], KL_SHARE_OF_EPIC * epic["kl"], epic["greedy"])
    knobs = next(k for k in SELECTOR_CANDIDATES if selector_spec(k) == chosen)
    assert profile.selector == {k: v for k, v in knobs.items() if k not in BAND_KNOBS}
    # a selector detecting at L_start moves the profile's L_det there, one with a band of its own the band;
    # the band search's own stays on record
    assert profile.searched_band == list(searched)
    assert profile.layers == candidate_band(knobs, searched, lm.config.num_layers)
    assert profile.l_det == (profile.l_start if knobs.get(AT_START) else best_det)


def test_build_profile_scores_every_candidate_band_on_train():
    lm = load_model("random:tiny")
    profile = build_profile(lm, num_problems=2, progress=False, select="fidelity")
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
