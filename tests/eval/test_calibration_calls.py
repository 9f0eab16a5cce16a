"""Calibration calls (``kvrelay.eval.calibration_calls``): which problems run, and what a method's score holds."""

import pytest

from kvrelay.errors import KvRelayError
from kvrelay.eval import calibration_calls
from kvrelay.eval.calibration_calls import calibration_data, downstream_calls, score_methods
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse.full import FullMethod
from kvrelay.reuse.naive import NaiveMethod
from kvrelay.reuse.relay import RelayMethod
from kvrelay.weights.loader import load_model


def test_calibration_pools_several_workloads_after_the_offset(monkeypatch):
    seen = []

    class Runner:  # records which problem each pipeline would run
        def __init__(self, engine, spec, run_id):
            seen.append((spec.name, run_id))

        def run(self, inputs, method, before_call):
            pass

    monkeypatch.setattr(calibration_calls, "PipelineRunner", Runner)
    lm = load_model("random:tiny")
    downstream_calls(lm, ("gsm8k-chain3", "humaneval-adr"), None, 2, (), None, "", False, offset=3)
    train = calibration_data(None, "gsm8k-chain3")
    assert train.endswith("gsm8k/train.jsonl") and calibration_data(None, "humaneval-adr") is None
    expected = [(name, p.problem_id) for name, data in (("gsm8k-chain3", train), ("humaneval-adr", None))
                for p in get_workload(name).problems(data, 5)[3:5]]
    assert seen == expected and len(set(seen)) == 4
    with pytest.raises(KvRelayError, match="give it for one"):
        downstream_calls(lm, ("gsm8k-chain3", "humaneval-adr"), train, 1, (), None, "", False)


def test_scores_are_means_over_the_calls_with_full_exact_against_itself():
    lm = load_model("random:tiny")
    scores = score_methods(lm, {"full": FullMethod(), "naive": NaiveMethod()}, "gsm8k-chain3", None, 2, "",
                           progress=False, path_tokens=4)
    full, naive = scores["full"], scores["naive"]
    assert full.kl == pytest.approx(0.0, abs=1e-6) and full.path_kl == pytest.approx(0.0, abs=1e-6)
    assert full.reuse == 0.0 and full.greedy == 1.0
    assert 0.0 < naive.reuse < 1.0 and naive.kl > 0.0 and naive.path_kl > 0.0 and 0.0 <= naive.greedy <= 1.0
    assert naive.path_kl != pytest.approx(naive.kl, rel=1e-3)  # a mean over the continuation's rows, not the first
    # every span token admitted at layer 1 from the upstream's carried states: layer 0 stays reused only if the
    # calibration pipelines captured those states (else relay recomputes the tokens from layer 0)
    band = f"1:1:{lm.config.num_layers - 1}"
    relay = score_methods(lm, {"relay": RelayMethod(keep_share=1.0, span_openings=0, band=band)}, "gsm8k-chain3",
                          None, 2, "", progress=False)
    assert 0.0 < relay["relay"].reuse < naive.reuse
    first_only = score_methods(lm, {"naive": NaiveMethod()}, "gsm8k-chain3", None, 2, "", progress=False)
    assert first_only["naive"].path_kl is None and first_only["naive"].greedy is None
    assert first_only["naive"].kl == pytest.approx(naive.kl, rel=1e-4) and first_only["naive"].reuse == naive.reuse
