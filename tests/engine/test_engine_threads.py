"""One engine and store driven from several threads (what a library user may do; the server drives its engine from
one scheduler thread): every call's output and stats are those of the same calls run one after another."""

from concurrent.futures import ThreadPoolExecutor

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput
from tests.helpers import random_ids, relayed_call


def test_calls_from_four_threads_equal_the_calls_run_in_turn():
    lm, store, call = relayed_call("llama3")
    engine = Engine(lm, store, methods=("full", "naive", "epic"))
    options = GenerateOptions(SamplingConfig(max_new_tokens=6))
    calls = [(call, "naive"), (call, "epic"), (CallInput(call.prompt_ids), "full")]
    calls += [(CallInput(random_ids(30, seed)), "full") for seed in range(5)]

    def run(job):
        out = engine.generate(job[0], job[1], options)
        return out.output_ids, out.stats.num_reused_tokens, out.first_logits

    in_turn = [run(job) for job in calls]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(run, calls * 2))
    for (ids, reused, logits), (ids2, reused2, logits2) in zip(in_turn * 2, threaded, strict=True):
        assert (ids2, reused2) == (ids, reused)
        assert (logits2 - logits).abs().max() < 1e-5
