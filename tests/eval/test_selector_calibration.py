"""Relay's selector pass (``kvrelay.eval.selector_calibration``): the choice rule, and what a calibration writes
into the profile, on fixed scores."""



from kvrelay.eval import selector_calibration
from kvrelay.eval.calibration_calls import MethodScore
from kvrelay.eval.selector_calibration import (
    AT_START,
    BELOW_TOP,
    ENTER_AT,
    KL_SHARE_OF_EPIC,
    SELECTOR_CANDIDATES,
    calibrate_selector,
    candidate_band,
    choose_selector,
    selector_spec,
)
from kvrelay.reuse.epic import EpicMethod
from kvrelay.reuse.profile import LayerProfile


def test_the_selector_chosen_is_the_lowest_kl_that_reuses_as_much_as_epic_or_else_the_paper_s():
    paper = selector_spec({})
    scores = {paper: (0.010, 0.56), "a": (0.004, 0.55), "b": (0.006, 0.59), "c": (0.009, 0.62), "d": (0.006, 0.60)}
    assert choose_selector(scores, paper, reuse_bar=0.61) == "c"  # the only one reusing as much as epic
    assert choose_selector(scores, paper, reuse_bar=0.595) == "d"  # "d" ties "b" on KL, but "b" is under the bar
    # none reaches epic's reuse (or no bar): the lowest KL reusing as much as the paper's
    assert choose_selector(scores, paper, reuse_bar=0.7) == choose_selector(scores, paper) == "d"
    assert choose_selector({paper: (0.01, 0.5), "e": (0.02, 0.7)}, paper) == paper  # nothing better: the paper's
    assert selector_spec({AT_START: True, "top_r": 0.3}) == "relay[l_det=l_start,top_r=0.3]"

def test_scored_along_the_continuation_the_selector_is_the_lowest_path_kl_under_the_first_token_bar():
    paper = selector_spec({})
    # spec -> (first-token KL, reuse, KL along full's continuation, greedy share)
    scores = {paper: (0.010, 0.56, 0.009, 0.5), "a": (0.002, 0.62, 0.0035, 0.5), "b": (0.004, 0.63, 0.004, 0.6),
              "c": (0.007, 0.64, 0.003, 0.7), "d": (0.001, 0.50, 0.001, 0.9)}
    assert choose_selector(scores, paper, reuse_bar=0.6) == "c"  # the lowest path KL reusing as much as epic
    assert choose_selector(scores, paper, reuse_bar=0.6, kl_bar=0.005) == "a"  # "c" is over the first-token bar
    # none under it: the nearest to it ("a", the lowest reusing as much as epic; "b" is not within 10% of it)
    assert choose_selector(scores, paper, reuse_bar=0.6, kl_bar=0.0005) == "a"
    near = {**scores, "b": (0.0021, 0.63, 0.002, 0.6)}  # within 10% of "a": the lower path KL of the two
    assert choose_selector(near, paper, reuse_bar=0.6, kl_bar=0.0005) == "b"
    beyond = {**scores, "b": (0.00222, 0.63, 0.002, 0.6)}  # 11% over "a": out
    assert choose_selector(beyond, paper, reuse_bar=0.6, kl_bar=0.0005) == "a"
    # then epic's greedy share: under the KL bar only "b" reaches 0.55, and none 0.65 (the bar gives way)
    assert choose_selector(scores, paper, reuse_bar=0.6, kl_bar=0.005, greedy_bar=0.55) == "b"
    assert choose_selector(scores, paper, reuse_bar=0.6, kl_bar=0.005, greedy_bar=0.65) == "a"
    # without the continuation's scores the first token's KL ranks, as before
    assert choose_selector({k: v[:2] for k, v in scores.items()}, paper, reuse_bar=0.6) == "a"


def _profile() -> LayerProfile:
    return LayerProfile("fp", "toy", 8, 2, 3, 7, 0.5, [1.0] * 8, [1.0] * 8, [0.0] * 8, calibration={"problems": 4})


def test_calibrate_selector_writes_the_choice_its_scores_and_its_detection_layer(monkeypatch):
    at_start = next(k for k in SELECTOR_CANDIDATES if k.get(AT_START) and k.get("drift"))
    in_band = next(k for k in SELECTOR_CANDIDATES if k and not k.get(AT_START))
    best, over_bar = selector_spec(at_start), selector_spec(in_band)
    epic = MethodScore(kl=0.05, reuse=0.65, path_kl=0.010, greedy=0.70)
    seen = {}

    def fixed_scores(lm, methods, workload, data, num_problems, desc, progress, path_tokens, offset):
        seen.update(methods=methods, workload=workload, path_tokens=path_tokens, offset=offset)
        out = {key: MethodScore(0.05, 0.50, 0.05, 0.5) for key in methods}  # every other one under epic's reuse
        out[best] = MethodScore(0.01, 0.70, 0.004, 0.8)
        # the lowest KL along the continuation, but over KL_SHARE_OF_EPIC x epic's first-token KL
        out[over_bar] = MethodScore(KL_SHARE_OF_EPIC * 0.05 * 1.5, 0.70, 0.002, 0.9)
        out["epic"] = epic
        return out

    monkeypatch.setattr(selector_calibration, "score_methods", fixed_scores)
    before = _profile()
    before.calibration |= {"selector_problems": 30, "selector_rescored": "a note on an earlier pass's scores"}
    profile = calibrate_selector(None, before, ["gsm8k-chain3", "humaneval-adr"], None, 4, progress=False,
                                 offset=100)
    assert profile.selector == {k: v for k, v in at_start.items() if k != AT_START}
    # the band search's record kept, the earlier selector pass's replaced, its note gone
    assert profile.calibration["problems"] == 4 and profile.calibration["selector_problems"] == 4
    assert "selector_rescored" not in profile.calibration
    assert profile.layers == (2, 2, 7) and profile.searched_band == [2, 3, 7]  # detected where the states enter
    assert profile.selector_scores[best] == {"kl": 0.01, "reuse": 0.70, "path_kl": 0.004, "greedy": 0.8}
    assert profile.selector_scores["epic"] == epic._asdict()
    assert len(profile.selector_scores) == len(seen["methods"]) == 1 + sum(
        candidate_band(k, (2, 3, 7), 8) is not None for k in SELECTOR_CANDIDATES)
    assert profile.calibration["selector_workloads"] == {"gsm8k-chain3": profile.calibration["selector_workloads"]
                                                         ["gsm8k-chain3"], "humaneval-adr": "default"}
    assert profile.calibration["selector_workloads"]["gsm8k-chain3"].endswith("train.jsonl")
    assert (profile.calibration["selector_offset"], profile.calibration["selector_path_tokens"]) == (100, 32)
    # every candidate ran on the profile's band, detecting at L_start where it asks to
    methods = seen["methods"]
    assert isinstance(methods["epic"], EpicMethod) and seen["path_tokens"] == 32 and seen["offset"] == 100
    assert methods[best].fixed[0] == (2, 2, 7)
    assert methods[over_bar].fixed[0] == (2, 3, 7)
    assert methods[selector_spec({})].fixed[1].tau_dev == 1.5  # the paper's thresholds for the empty candidate


def test_calibrate_selector_on_the_first_token_alone_ranks_by_its_kl_under_epic_s_reuse(monkeypatch):
    in_band = next(k for k in SELECTOR_CANDIDATES if k and not k.get(AT_START))
    chosen = selector_spec(in_band)

    def first_token_scores(lm, methods, workload, data, num_problems, desc, progress, path_tokens, offset):
        assert path_tokens == 0
        out = {key: MethodScore(0.03, 0.70) for key in methods}
        out[chosen] = MethodScore(0.025, 0.70)  # no KL bar without the continuation: only the lowest KL counts
        out["epic"] = MethodScore(0.05, 0.65)
        return out

    monkeypatch.setattr(selector_calibration, "score_methods", first_token_scores)
    profile = calibrate_selector(None, _profile(), "gsm8k-chain3", None, 4, progress=False, path_tokens=0)
    assert profile.selector == in_band and profile.layers == (2, 3, 7)
    assert profile.selector_scores[chosen] == {"kl": 0.025, "reuse": 0.70}


def _one_best(methods: dict, best: str) -> dict[str, MethodScore]:
    """Scores where ``best`` alone beats epic on every bar, the others under epic's reuse."""
    out = {key: MethodScore(0.05, 0.50, 0.05, 0.5) for key in methods}
    out[best] = MethodScore(0.01, 0.70, 0.004, 0.8)
    out["epic"] = MethodScore(0.05, 0.65, 0.010, 0.70)
    return out


def test_a_candidate_band_is_the_searched_one_moved_by_its_knobs():
    searched = (4, 5, 13)
    assert candidate_band({}, searched, 18) == (4, 5, 13)
    assert candidate_band({AT_START: True}, searched, 18) == (4, 4, 13)
    assert candidate_band({AT_START: True, ENTER_AT: 3, BELOW_TOP: 6}, searched, 18) == (3, 3, 11)
    assert candidate_band({AT_START: True, BELOW_TOP: 0}, searched, 18) == (4, 4, 17)
    assert candidate_band({AT_START: True, ENTER_AT: 4, BELOW_TOP: 6}, searched, 8) is None  # would end at 1
    assert candidate_band({ENTER_AT: 6}, searched, 18) is None  # the search's L_det 5 would sit below L_start
    assert candidate_band({}, (6, 6, 6), 18) == (6, 6, 6)  # a one-layer searched band is still scored as given
    assert all(k.get(AT_START) for k in SELECTOR_CANDIDATES if ENTER_AT in k or BELOW_TOP in k)
    # each budget on a band of its own is tried with and without the drift correction (which needs prune)
    own = [k for k in SELECTOR_CANDIDATES if ENTER_AT in k]
    assert {(k["top_r"], k.get("drift")) for k in own} == {(0.0, None), (0.3, None), (0.4, None), (0.3, 0.5),
                                                           (0.4, 0.5)}
    assert all(k.get("prune") for k in own if k.get("drift")) and len(own) == 30
    assert selector_spec({AT_START: True, ENTER_AT: 3, BELOW_TOP: 4, "top_r": 0.4}) == (
        "relay[l_det=l_start,l_start=3,l_end=top-4,top_r=0.4]")


def test_a_chosen_band_of_its_own_moves_the_profile_s_band_and_a_recalibration_starts_from_the_search(monkeypatch):
    own = next(k for k in SELECTOR_CANDIDATES if k.get(ENTER_AT) == 2 and k.get(BELOW_TOP) == 4 and k["top_r"])
    best = selector_spec(own)

    def fixed_scores(lm, methods, workload, data, num_problems, desc, progress, path_tokens, offset):
        assert methods[best].fixed[0] == (2, 2, 3)  # 8 layers: top - 4
        return _one_best(methods, best)

    monkeypatch.setattr(selector_calibration, "score_methods", fixed_scores)
    profile = calibrate_selector(None, _profile(), "gsm8k-chain3", None, 4, progress=False)
    assert profile.layers == (2, 2, 3) and profile.searched_band == [2, 3, 7]
    assert profile.selector == {k: v for k, v in own.items() if k not in (AT_START, ENTER_AT, BELOW_TOP)}
    seen = {}

    def record(lm, methods, workload, data, num_problems, desc, progress, path_tokens, offset):
        seen["paper"] = methods[selector_spec({})]
        return fixed_scores(lm, methods, workload, data, num_problems, desc, progress, path_tokens, offset)

    monkeypatch.setattr(selector_calibration, "score_methods", record)
    again = calibrate_selector(None, profile, "gsm8k-chain3", None, 4, progress=False)  # from [2, 3, 7] again
    assert again.searched_band == [2, 3, 7] and again.layers == (2, 2, 3)
    assert seen["paper"].fixed[0] == (2, 3, 7)  # not the moved band


def test_a_chosen_band_candidate_with_drift_runs_and_ships_its_drift(monkeypatch):
    own = next(k for k in SELECTOR_CANDIDATES if k.get(ENTER_AT) == 3 and k.get(BELOW_TOP) == 6 and k.get("drift"))
    best = selector_spec(own)
    assert best.endswith(",drift=0.5]")

    def fixed_scores(lm, methods, workload, data, num_problems, desc, progress, path_tokens, offset):
        assert methods[best].fixed[1].drift == 0.5 and methods[best].fixed[1].prune_share == 0.25
        assert methods[best].fixed[0] == (3, 3, 11)
        return _one_best(methods, best)

    monkeypatch.setattr(selector_calibration, "score_methods", fixed_scores)
    profile = LayerProfile("fp", "toy", 18, 4, 5, 13, 0.5, [1.0] * 18, [1.0] * 18, [0.0] * 18,
                           calibration={"problems": 4})
    profile = calibrate_selector(None, profile, "gsm8k-chain3", None, 4, progress=False)
    assert profile.layers == (3, 3, 11) and profile.searched_band == [4, 5, 13]
    assert profile.selector == {"top_r": own["top_r"], "l_pre": 16, "l_suf": 0, "prune": 0.25, "drift": 0.5}
