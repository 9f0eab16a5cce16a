"""Our forward against transformers' logits, for every family we claim (fp32, within 1e-4)."""

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.model.schedule import SuffixSchedule
from tests.helpers import FAMILIES, hf_model, ours_from_hf

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    hf = hf_model(request.param)
    return request.param, hf, ours_from_hf(hf)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


def test_full_prefill_matches(pair):
    _, hf, ours = pair
    ids = _ids(40)  # longer than mistral's 16-token window: the window mask is exercised
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = SequenceKV(ours.config, torch.float32, "cpu")
    got = ours.prefill(ids, cache, all_logits=True)
    torch.testing.assert_close(got.logits, ref, atol=ATOL, rtol=0)
    assert got.num_computed_token_layers == 40 * ours.config.num_layers


def test_two_chunk_prefill_with_first_cached(pair):
    _, hf, ours = pair
    ids = _ids(37)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = SequenceKV(ours.config, torch.float32, "cpu", capacity=8)  # forces growth too
    ours.prefill(ids[:23], cache)
    got = ours.prefill(ids, cache, SuffixSchedule(23), all_logits=True)
    torch.testing.assert_close(got.logits, ref[23:], atol=ATOL, rtol=0)
    assert got.num_computed_token_layers == 14 * ours.config.num_layers


def test_twenty_decode_steps_match(pair):
    _, hf, ours = pair
    prompt = _ids(12)
    cache = SequenceKV(ours.config, torch.float32, "cpu", capacity=4)
    logits = [ours.prefill(prompt, cache).logits]
    tokens = []
    for _ in range(20):
        tokens.append(int(logits[-1].argmax()))
        logits.append(ours.decode_step(tokens[-1], cache))
    with torch.no_grad():
        hf_out = hf.generate(prompt[None], max_new_tokens=20, do_sample=False, min_new_tokens=20,
                             output_logits=True, return_dict_in_generate=True)
    assert hf_out.sequences[0, 12:].tolist() == tokens
    for step, hf_logits in enumerate(hf_out.logits):
        torch.testing.assert_close(logits[step], hf_logits[0].float(), atol=ATOL, rtol=0)
    # the decode steps' last logits too: a full forward over everything
    with torch.no_grad():
        full = hf(torch.cat([prompt, torch.tensor(tokens)])[None]).logits[0, -1]
    torch.testing.assert_close(logits[-1], full, atol=ATOL, rtol=0)


def test_fused_projections_follow_later_weight_changes():
    """Fusing q/k/v and gate/up must never serve stale weights (load_state_dict or dtype changes)."""
    hf_a, hf_b = hf_model("qwen2", seed=0), hf_model("qwen2", seed=5)
    ours = ours_from_hf(hf_a)
    ids = _ids(10)
    cache = lambda dtype=torch.float32: SequenceKV(ours.config, dtype, "cpu")  # noqa: E731
    ours.prefill(ids, cache())  # fuses
    ours.load_state_dict(hf_b.state_dict(), strict=False)  # copies into the fused views
    with torch.no_grad():
        ref = hf_b(ids[None]).logits[0, -1]
    torch.testing.assert_close(ours.prefill(ids, cache()).logits, ref, atol=ATOL, rtol=0)
    ours.double()  # replaces every parameter: the fusion must be rebuilt
    ours._rope = None
    got = ours.prefill(ids, cache(torch.float64)).logits
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
