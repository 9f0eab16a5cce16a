"""The band's counts kept on the host (``BandSchedule``, relay's share pruning and drift) agree with its masks.

On the CPU ``rows_of`` checks every count a schedule passes it against the mask, so each relay or cacheblend
prefill here fails on a count that drifts from what the device holds (on CUDA a wrong count would cut or pad
rows). The cases are the ones where counting is easy to get wrong: spans entering at layer 0 and at L_start in
one call, a span shorter than its opening and last tokens together, several spans, refs that overlap, a
selection that admits nothing, a band that ends where it selects.
"""

import functools

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.relay import RelayMethod
from tests.helpers import generate, publish, tiny_lm

ONE = SamplingConfig(max_new_tokens=1)


@functools.cache
def _setup():
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    gen = torch.Generator().manual_seed(0)
    up = generate(lm, torch.randint(0, 256, (20,), generator=gen).tolist(), "full", store,
                  SamplingConfig(max_new_tokens=24), capture_layers=(1, 2), keep_cache=True)
    publish(store, "up", up, lm)  # hidden states at layers 1 and 2: its tokens enter there
    plain = generate(lm, torch.randint(0, 256, (15,), generator=gen).tolist(), "full", store,
                     SamplingConfig(max_new_tokens=12), keep_cache=True)
    publish(store, "plain", plain, lm)  # none: its tokens enter at layer 0
    head, mid, tail = (torch.randint(0, 256, (k,), generator=gen).tolist() for k in (7, 4, 5))
    first, second = up.output_ids, plain.output_ids
    ids = head + first + mid + second + tail + first[:3] + tail
    s1, s2 = 7, 7 + 24 + 4
    s3 = s2 + 12 + 5
    calls = {
        "several": CallInput(ids, [SpanRef(s1, s1 + 24, "up", 20), SpanRef(s3, s3 + 3, "up", 20)]),
        "mixed": CallInput(ids, [SpanRef(s1, s1 + 24, "up", 20), SpanRef(s2, s2 + 12, "plain", 15),
                                 SpanRef(s3, s3 + 3, "up", 20)]),
        # one inside the first, one partly past its end (each a true copy of its span's tokens, as every ref must be)
        "overlapping": CallInput(ids, [SpanRef(s1, s1 + 20, "up", 20), SpanRef(s1 + 3, s1 + 13, "up", 23),
                                       SpanRef(s1 + 16, s1 + 24, "up", 36)]),
    }
    return lm, store, calls


# (layers, the policy in the profile's knob vocabulary) per relay variant, the band's parts in many combinations
RELAYS = [
    ((1, 2, 3), {"top_r": 0.5, "l_pre": 2, "l_suf": 2, "prune": 0.5, "drift": 0.5}),  # a 3-token span: overlap
    ((2, 2, 3), {"top_r": 0.3, "l_pre": 2, "l_suf": 3, "pre_dense": True, "prune": 0.5, "drift": 0.5}),
    ((2, 2, 3), {"top_r": 0, "l_pre": 0, "l_suf": 0, "prune": 0.5, "drift": 0.5}),  # admits nothing
    ((2, 2, 3), {"top_r": 0.5, "l_pre": 2, "l_suf": 2, "prune": 0.5}),  # pruning alone
    ((1, 1, 3), {"top_r": 0.4, "l_pre": 1, "l_suf": 1, "prune": 1.0, "drift": 0.5}),  # prunes every free token
    ((1, 2, 2), {"top_r": 0.5, "l_pre": 2, "l_suf": 1}),  # the band ends where it selects
    ((0, 1, 3), {"top_r": 0.3, "l_pre": 2, "l_suf": 1, "prune": 1, "drift": 0.3, "pos_prior": 1}),
    ((2, 2, 3), {"top_r": 0.3, "l_pre": 2, "l_suf": 1, "pre_dense": True, "prune": 0.5, "drift": 0.5, "away": 1}),
    ((1, 2, 3), {"l_pre": 2, "l_suf": 2, "prune": 0.5, "drift": 0.5}),  # the paper's thresholds, then pruning
]
SPECS = [*(f"relay {layers} {knobs}" for layers, knobs in RELAYS), "cacheblend[check_layer=1,ratio=0.3]"]


def _method(spec: str):
    if spec.startswith("relay "):
        return RelayMethod.with_knobs(*RELAYS[SPECS.index(spec)])
    return get_method(spec)


@pytest.mark.parametrize("call_name", ["several", "mixed", "overlapping"])
@pytest.mark.parametrize("spec", SPECS)
def test_band_counts_agree_with_the_masks(call_name, spec):
    lm, store, calls = _setup()
    out = generate(lm, calls[call_name], _method(spec), store, ONE)  # a wrong count: ScheduleError
    assert 0 < out.stats.num_computed_token_layers < len(calls[call_name].prompt_ids) * lm.config.num_layers
