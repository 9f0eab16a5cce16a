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
        "overlapping": CallInput(ids, [SpanRef(s1, s1 + 24, "up", 20), SpanRef(s1 + 3, s1 + 13, "up", 23),
                                       SpanRef(s1 + 18, s1 + 30, "up", 30)]),  # one inside, one partly past the end
    }
    return lm, store, calls


SPECS = [
    "relay[l_start=1,l_det=2,l_end=3,top_r=0.5,l_pre=2,l_suf=2,prune=0.5,drift=0.5]",  # a 3-token span: overlap
    "relay[l_start=2,l_det=2,l_end=3,top_r=0.3,l_pre=2,l_suf=3,pre_dense=true,prune=0.5,drift=0.5]",
    "relay[l_start=2,l_det=2,l_end=3,top_r=0,l_pre=0,l_suf=0,prune=0.5,drift=0.5]",  # admits nothing
    "relay[l_start=2,l_det=2,l_end=3,top_r=0.5,l_pre=2,l_suf=2,prune=0.5]",  # pruning alone
    "relay[l_start=1,l_det=1,l_end=3,top_r=0.4,l_pre=1,l_suf=1,prune=2,prune_by=peers,drift=0.5]",
    "relay[l_start=1,l_det=2,l_end=2,top_r=0.5,l_pre=2,l_suf=1]",  # the band ends where it selects
    "relay[l_start=0,l_det=1,l_end=3,top_r=0.3,l_pre=2,l_suf=1,prune=1,drift=0.3,pos_prior=1]",
    "relay[l_start=2,l_det=2,l_end=3,top_r=0.3,l_pre=2,l_suf=1,pre_dense=true,prune=0.5,drift=0.5,away=1]",
    "cacheblend[check_layer=1,ratio=0.3]",
]


@pytest.mark.parametrize("call_name", ["several", "mixed", "overlapping"])
@pytest.mark.parametrize("spec", SPECS)
def test_band_counts_agree_with_the_masks(call_name, spec):
    lm, store, calls = _setup()
    out = generate(lm, calls[call_name], get_method(spec), store, ONE)  # a wrong count: ScheduleError
    assert 0 < out.stats.num_computed_token_layers < len(calls[call_name].prompt_ids) * lm.config.num_layers
