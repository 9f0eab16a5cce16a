"""The sampler is numerically safe for every temperature and top_p the API accepts, and refuses logits
nothing can be sampled from (so the engine fails that sequence alone)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.model.sampling import MIN_TEMPERATURE, Sampler, SamplingConfig, SamplingError

TINY = [5e-324, 1e-320, 1e-310, 1e-46, 1e-39, 1e-38, 1e-37, 1e-30, 1e-12]


def _logits(seed: int = 0, vocab: int = 1000, scale: float = 30.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_samples_the_argmax(temperature):
    for seed in range(3):
        logits = _logits(seed)
        assert Sampler(SamplingConfig(temperature=temperature, seed=seed))(logits) == int(logits.argmax())


@pytest.mark.parametrize("top_p", TINY)
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    logits = _logits(1, scale=1.0)
    for seed in range(5):
        assert Sampler(SamplingConfig(temperature=1.0, top_p=top_p, seed=seed))(logits) == int(logits.argmax())


def test_a_temperature_just_above_the_floor_samples_the_tied_top_tokens():
    """Just above the floor the tokens tied with the max (gap 0) are sampled from, nothing else: no overflow."""
    logits = torch.full((50,), -5.0)
    logits[[3, 17]] = 80.0  # two tied top tokens; (80 - (-5)) / 2e-6 overflows float32
    seen = {Sampler(SamplingConfig(temperature=2 * MIN_TEMPERATURE, seed=s))(logits) for s in range(40)}
    assert seen == {3, 17}


def test_ordinary_sampling_is_unchanged_in_distribution():
    """At temperature 1 the shifted sampler draws by softmax(logits): frequencies match within noise."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    expected = torch.softmax(logits.double(), -1)
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=7))
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(4000)]), minlength=4).double() / 4000
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.7, seed=0))
    assert {sampler(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("bad", ["nan", "posinf", "all_masked"])
def test_logits_nothing_can_be_sampled_from_raise_a_sampling_error(bad):
    logits = _logits(2)
    if bad == "nan":
        logits[5] = float("nan")
    elif bad == "posinf":
        logits[5] = float("inf")
    else:
        logits[:] = float("-inf")
    for temperature in (0.0, 1.0):
        with pytest.raises(SamplingError):
            Sampler(SamplingConfig(temperature=temperature))(logits)


def test_masked_tokens_are_never_sampled():
    logits = _logits(3, vocab=20, scale=1.0)
    logits[::2] = float("-inf")
    sampler = Sampler(SamplingConfig(temperature=2.0, seed=1))
    assert all(sampler(logits) % 2 == 1 for _ in range(200))


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(temperature=st.one_of(st.just(0.0), st.floats(0, 2, allow_subnormal=True)),
       top_p=st.floats(0, 1, exclude_min=True, allow_subnormal=True),
       scale=st.sampled_from([1e-3, 1.0, 100.0, 3e4]), seed=st.integers(0, 2**32))
def test_fuzz_every_accepted_value_samples_a_token(temperature, top_p, scale, seed):
    logits = _logits(seed % 97, vocab=64, scale=scale)
    token = Sampler(SamplingConfig(temperature=temperature, top_p=top_p, seed=seed))(logits)
    assert 0 <= token < 64
