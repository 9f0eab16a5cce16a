"""Fault containment in ``Engine.step``: a sequence whose sampling or forward fails is failed alone, and the
rest of its decode batch goes on token-for-token as if it had run alone."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig, SamplingError
from tests.helpers import tiny_lm

NUM_NEW_TOKENS = 10
FAIL_AT_STEP = 3  # the culprit fails on its third decode step, with the healthy ones mid-generation
CAPTURE = (1, 2)  # captured decode rows too: a forward that raised partway must not leave extra rows


class Planted(RuntimeError):
    pass


@pytest.fixture(scope="module")
def lm():
    lm = tiny_lm("llama3")
    lm.model.double()  # a batched step equals single steps exactly (tests/engine/test_decode_batch.py)
    return lm


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


HEALTHY = [(_prompt(9, 1), SamplingConfig(NUM_NEW_TOKENS)),
           (_prompt(23, 2), SamplingConfig(NUM_NEW_TOKENS, temperature=0.9, seed=5)),
           (_prompt(14, 3), SamplingConfig(NUM_NEW_TOKENS, temperature=0.7, top_p=0.8, seed=11))]


@pytest.fixture(scope="module")
def alone(lm) -> list:
    engine = Engine(lm, capture_layers=CAPTURE)
    return [engine.generate(prompt, "full", GenerateOptions(cfg)) for prompt, cfg in HEALTHY]


def _run_batch(engine: Engine, culprit_at: int, plant) -> tuple[list, object]:
    """Start the healthy sequences with a culprit at index ``culprit_at``, ``plant`` its fault, decode to the end."""
    seqs = [engine.start(prompt, "full", GenerateOptions(cfg)) for prompt, cfg in HEALTHY]
    culprit = engine.start(_prompt(17, 4), "full", GenerateOptions(SamplingConfig(NUM_NEW_TOKENS + 5)))
    seqs.insert(culprit_at, culprit)
    plant(engine, culprit)
    num_steps = 0
    while not all(s.done for s in seqs):
        engine.step(seqs)
        num_steps += 1
        assert num_steps <= NUM_NEW_TOKENS + 5
    outs = [engine.finish(s) for s in seqs]
    return outs[:culprit_at] + outs[culprit_at + 1 :], culprit


def _raising_sampler(engine: Engine, culprit) -> None:
    inner, calls = culprit.sampler, []

    def sampler(logits):
        calls.append(1)
        if len(calls) == FAIL_AT_STEP:
            raise Planted("a sampler that breaks")
        return inner(logits)

    culprit.sampler = sampler


def _nan_row(engine: Engine, culprit) -> None:
    decode, calls = engine._decode, []

    def poisoned(token_ids, seqs):
        logits = decode(token_ids, seqs).clone()  # [B, vocab]
        if culprit in seqs:
            calls.append(1)
            if len(calls) >= FAIL_AT_STEP:
                logits[seqs.index(culprit)] = float("nan")
        return logits

    engine._decode = poisoned


def _forward_raises(engine: Engine, culprit) -> None:
    """The culprit's cache raises on layer 2's write: the real batched forward fails partway, after the
    rows before it wrote KV and every row's layer-1 hidden state was captured."""
    write, calls = culprit.cache.write_range, []

    def write_range(layer, *args, **kwargs):
        if layer == 2:
            calls.append(1)
            if len(calls) >= FAIL_AT_STEP:
                raise Planted("a forward that breaks on this sequence")
        return write(layer, *args, **kwargs)

    culprit.cache.write_range = write_range


@pytest.mark.parametrize("culprit_at", [0, 2, 3])
@pytest.mark.parametrize("plant,error", [(_raising_sampler, Planted), (_nan_row, SamplingError),
                                         (_forward_raises, Planted)],
                         ids=["sampler_raises", "nan_logits", "forward_raises"])
def test_a_failing_sequence_fails_alone_and_the_batch_goes_on(lm, alone, plant, error, culprit_at):
    healthy, culprit = _run_batch(Engine(lm, capture_layers=CAPTURE), culprit_at, plant)
    assert culprit.stop_reason == "error" and isinstance(culprit.error, error)
    assert len(culprit.output_ids) == FAIL_AT_STEP  # its first token, then FAIL_AT_STEP - 1 good steps
    for got, want in zip(healthy, alone, strict=True):
        assert got.output_ids == want.output_ids and got.stop_reason == want.stop_reason
        assert len(got.output_ids) > FAIL_AT_STEP or got.stop_reason == "stop"  # they went on past the failure
        assert sorted(got.decode_hidden) == sorted(want.decode_hidden)
        for layer, rows in want.decode_hidden.items():
            torch.testing.assert_close(got.decode_hidden[layer], rows, atol=1e-10, rtol=0)


def test_generate_raises_its_sequences_error(lm):
    engine = Engine(lm)
    decode = engine._decode

    def nan_logits(token_ids, seqs):
        return decode(token_ids, seqs) * float("nan")

    engine._decode = nan_logits
    with pytest.raises(SamplingError):
        engine.generate(_prompt(8, 9), "full", GenerateOptions(SamplingConfig(4)))
    with pytest.raises(SamplingError):
        engine.generate_batch([_prompt(8, 9), _prompt(5, 1)], "full", GenerateOptions(SamplingConfig(4)))
