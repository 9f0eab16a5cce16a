"""RoPE: shifts are exact rotations, and variants where they do not compose are refused."""

import dataclasses

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryEmbedding, apply_rotary
from tests.helpers import tiny_lm

BASE = ModelConfig(family="llama", vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=1,
                   num_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def test_shift_plus_then_minus_is_identity():
    rope = RotaryEmbedding(BASE)
    k = torch.randn(3, 7, 16)  # [heads, n, head_dim]
    delta = torch.tensor([0, 1, 5, 40, 100, 3, 250])
    back = rope.shift_keys(rope.shift_keys(k, delta), -delta)
    torch.testing.assert_close(back, k, atol=1e-5, rtol=0)


def test_shifted_keys_equal_keys_computed_at_new_position():
    rope = RotaryEmbedding(BASE)
    k = torch.randn(2, 5, 16)
    p, q = torch.tensor([0, 3, 9, 10, 11]), torch.tensor([50, 60, 9, 200, 12])
    at_p = apply_rotary(k, *rope.cos_sin(p, torch.float32))
    at_q = apply_rotary(k, *rope.cos_sin(q, torch.float32))
    torch.testing.assert_close(rope.shift_keys(at_p, q - p), at_q, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["tiny", "gemma3-tiny"])  # one RoPE base; a base per layer
def test_shift_into_a_cache_slice_equals_the_shift(preset):
    from kvrelay.weights.presets import PRESETS

    config = PRESETS[preset]
    rope = RotaryEmbedding(config)
    keys = torch.randn(config.num_layers, config.num_kv_heads, 9, config.head_dim)  # [L, Hkv, n, hd]
    cache = torch.zeros(config.num_layers, config.num_kv_heads, 20, config.head_dim)
    rope.shift_keys_into(keys, 37, cache[:, :, 4:13])  # a strided slice, as SequenceKV.load_span passes
    torch.testing.assert_close(cache[:, :, 4:13], rope.shift_keys(keys, 37), atol=1e-5, rtol=0)
    assert not cache[:, :, :4].any() and not cache[:, :, 13:].any()  # nothing written outside the slice


@pytest.mark.parametrize("preset", ["tiny", "gemma3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # in place; another dtype via a rotated copy
def test_keys_added_at_positions_are_the_keys_rotated_there(preset, dtype):
    """``add_keys_at`` adds position-free keys rotated for [start, start + n) to a strided cache slice, layer by
    layer with each layer's base; it leaves the rest of the cache alone. Checked against ``apply_rotary`` with
    the positions' own cos/sin tables (not ``shift_keys``)."""
    from kvrelay.weights.presets import PRESETS

    config = PRESETS[preset]
    rope = RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(config.num_layers, config.num_kv_heads, 9, config.head_dim, generator=gen)  # [L, Hkv, n, hd]
    cache = torch.randn(config.num_layers, config.num_kv_heads, 20, config.head_dim, generator=gen).to(dtype)
    before = cache.clone()
    rope.add_keys_at(keys, 37, cache[:, :, 4:13])
    positions = torch.arange(37, 46)
    ropes = [rope.local if rope.local and config.is_local(i) else rope for i in range(config.num_layers)]
    rotated = torch.stack([apply_rotary(keys[i], *r.cos_sin(positions, torch.float32)) for i, r in enumerate(ropes)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cache[:, :, 4:13].float(), before[:, :, 4:13].float() + rotated, atol=tol, rtol=tol)
    assert torch.equal(cache[:, :, :4], before[:, :, :4]) and torch.equal(cache[:, :, 13:], before[:, :, 13:])


def test_a_cache_patch_with_rope_rotates_its_keys_for_their_positions():
    """``SequenceKV.patch`` with ``rope``: keys without RoPE are rotated for the rows they go to, whether they set the
    rows or are added to loaded ones; values are written as given."""
    from kvrelay.weights.presets import PRESETS

    config = PRESETS["tiny"]
    rope = RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(config.num_layers, config.num_kv_heads, 5, config.head_dim, generator=gen) for _ in range(2))
    rotated = apply_rotary(k, *rope.cos_sin(torch.arange(7, 12), torch.float32))
    cache = SequenceKV(config, torch.float32, "cpu")
    cache.patch(7, k, v, add=False, rope=rope)
    torch.testing.assert_close(cache.k[:, :, 7:12], rotated, atol=1e-5, rtol=0)
    assert torch.equal(cache.v[:, :, 7:12], v)
    cache.patch(7, k, v, add=True, rope=rope)
    torch.testing.assert_close(cache.k[:, :, 7:12], 2 * rotated, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.v[:, :, 7:12], 2 * v)


def test_layer0_keys_moved_from_p_to_p_prime_equal_fresh_keys():
    lm = tiny_lm("llama3")  # llama3 frequency scaling: still a pure rotation
    model, n_pad = lm.model, 9
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3))
    at_p = SequenceKV(lm.config, torch.float32, "cpu")
    model.prefill(ids, at_p)
    padded = torch.cat([torch.randint(0, 300, (n_pad,)), ids])
    at_q = SequenceKV(lm.config, torch.float32, "cpu")
    model.prefill(padded, at_q)
    span = at_p.export(0, 12, ids.tolist(), lm.fingerprint)
    moved = SequenceKV(lm.config, torch.float32, "cpu")
    assert moved.load_span(span, n_pad, model.rope) == 12
    # layer 0 K/V depend on the token alone; only the rotation differs
    torch.testing.assert_close(moved.k[0, :, n_pad : n_pad + 12], at_q.k[0, :, n_pad : n_pad + 12], atol=1e-5, rtol=0)
    torch.testing.assert_close(moved.v[0, :, n_pad : n_pad + 12], at_q.v[0, :, n_pad : n_pad + 12], atol=0, rtol=0)


@pytest.mark.parametrize("scaling, ok", [
    ({}, True),
    ({"rope_type": "linear", "factor": 4.0}, True),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, True),
    ({"rope_type": "dynamic", "factor": 2.0}, False),
])
def test_round_trip_self_test_decides_shifting(scaling, ok):
    rope = RotaryEmbedding(dataclasses.replace(BASE, rope_scaling=scaling))
    assert rope.can_shift is ok


def test_dynamic_rope_refuses_to_move_spans():
    from kvrelay.errors import ScheduleError

    cfg = dataclasses.replace(BASE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, num_layers=1)
    rope = RotaryEmbedding(cfg)
    cache = SequenceKV(cfg, torch.float32, "cpu")
    from kvrelay.cache.kv import StoredSpan

    span = StoredSpan((1, 2), 0, torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16), "fp")
    assert cache.load_span(span, 0, rope) == 0  # same positions: allowed
    with pytest.raises(ScheduleError, match="does not compose"):
        cache.load_span(span, 5, rope)
