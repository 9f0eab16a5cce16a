"""The connector's forward on vLLM's Llama-layout layers (``kvrelay.vllm.forward``) without vLLM: a stand-in of
vLLM's decoder-layer modules (norms that add the residual, an in-place rotary embedding, a whole MLP module) over
the random tiny model. What it writes must be what kvrelay's scheduled prefill writes for the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.cache.kv import SequenceKV
from kvrelay.model.rope import apply_rotary
from kvrelay.model.schedule import StaticSchedule
from kvrelay.vllm.forward import attention_chunks, bind_layers
from kvrelay.weights.loader import load_model

NEEDS_VLLM = False  # runs in the main venv


class Linear(nn.Module):
    """Called as vLLM's linear modules are: (output, bias)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.w), None


class Norm(nn.Module):
    """vLLM's RMSNorm call: ``norm(x)``, or ``norm(x, residual)`` -> (norm(x + residual), x + residual)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.norm(x)
        total = x + residual
        return self.norm(total), total


class Rotary(nn.Module):
    """vLLM's rotary embedding call: (positions [m], q [m, H * hd], k [m, Hkv * hd]) -> rotated q, k."""

    def __init__(self, rope, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.rope.cos_sin(positions, q.dtype)
        m, hd = q.shape[0], self.head_dim
        rotate = [apply_rotary(x.reshape(m, -1, hd).transpose(0, 1), cos, sin).transpose(0, 1).reshape(m, -1)
                  for x in (q, k)]
        return rotate[0], rotate[1]


class Mlp(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = Linear(gate_up), Linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0]


def vllm_llama(model) -> nn.Module:
    """vLLM's Llama module layout over the tiny model's tensors."""
    cfg = model.config
    root, backbone = nn.Module(), nn.Module()
    backbone.embed_tokens = model.model.embed_tokens
    layers = []
    for layer in model.model.layers:
        ours, attn = nn.Module(), nn.Module()
        attn.qkv_proj = Linear(layer.self_attn.fused_qkv()[0])
        attn.o_proj = Linear(layer.self_attn.o_proj.weight)
        attn.rotary_emb = Rotary(model.rope, cfg.head_dim)
        attn.scaling = cfg.head_dim**-0.5
        ours.self_attn, ours.mlp = attn, Mlp(layer.mlp.fused_gate_up(), layer.mlp.down_proj.weight)
        ours.input_layernorm = Norm(layer.input_layernorm)
        ours.post_attention_layernorm = Norm(layer.post_attention_layernorm)
        layers.append(ours)
    backbone.layers = nn.ModuleList(layers)
    root.model = backbone
    return root


@pytest.fixture(scope="module")
def lm():
    return load_model("random:tiny")


@pytest.mark.parametrize("active", [
    list(range(0, 12)) + list(range(30, 38)) + [50, 51, 52, 60],  # leading gap, moved runs' first tokens, framing
    list(range(0, 40)),  # every position (the causal path)
    [5, 6, 7, 20, 39],
])
def test_writes_what_kvrelays_scheduled_prefill_writes(lm, active):
    cfg, gen = lm.config, torch.Generator().manual_seed(5)
    n = active[-1] + 1
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    reused = SequenceKV(cfg, torch.float32, "cpu", capacity=n + 1)  # stands for the loaded spans
    lm.model.prefill(torch.randint(0, cfg.vocab_size, (n,), generator=gen), reused)
    expected, got = (SequenceKV(cfg, torch.float32, "cpu", capacity=n + 1) for _ in range(2))
    for cache in (expected, got):
        cache.patch(0, *reused.kv_all(0, n), add=False)
    lm.model.prefill(ids, expected, StaticSchedule(torch.tensor(active)))
    forward = bind_layers(cfg, vllm_llama(lm.model))
    assert forward is not None
    forward.compute_kv(ids, got, torch.tensor(active))
    torch.testing.assert_close(got.kv_all(0, n)[0], expected.kv_all(0, n)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.kv_all(0, n)[1], expected.kv_all(0, n)[1], rtol=1e-5, atol=1e-5)


def test_a_layout_it_does_not_cover_is_left_to_kvrelays_modules(lm):
    model = vllm_llama(lm.model)
    del model.model.layers[3].self_attn.rotary_emb
    assert bind_layers(lm.config, model) is None
    model = vllm_llama(lm.model)
    model.model.layers[0].self_attn.scaling = 0.5  # scores scaled otherwise than SDPA's default
    assert bind_layers(lm.config, model) is None


def test_attention_chunks_cover_the_rows_and_compute_fewest_scores():
    positions = list(range(0, 56)) + list(range(160, 186))
    assert attention_chunks(positions) == [(0, 56), (56, 82)]  # 56 * 56 + 26 * 186 scores, not 82 * 186
    assert attention_chunks(list(range(10))) == [(0, 10)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        positions = sorted(set(torch.randint(0, 300, (int(torch.randint(1, 80, (1,), generator=gen)),),
                                             generator=gen).tolist()))
        chunks = attention_chunks(positions)
        assert 1 <= len(chunks) <= 4 and chunks[0][0] == 0 and chunks[-1][1] == len(positions)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(chunks, chunks[1:], strict=False))
        scores = sum((end - start) * (positions[end - 1] + 1) for start, end in chunks)
        assert scores <= len(positions) * (positions[-1] + 1)


def test_a_long_span_read_in_place_is_attended_as_kvrelays_prefill_attends_it(lm):
    """A span of 256 tokens or more is read where the store holds it (``SequenceKV``'s refs); the row chunks attend
    over it, the first chunk over only its first keys."""
    from kvrelay.cache.kv import IN_PLACE_MIN_TOKENS

    cfg, gen = lm.config, torch.Generator().manual_seed(6)
    upstream = torch.randint(0, cfg.vocab_size, (IN_PLACE_MIN_TOKENS + 40,), generator=gen).tolist()
    up = SequenceKV(cfg, torch.float32, "cpu", capacity=len(upstream) + 1)
    lm.model.prefill(torch.tensor(upstream), up)
    span = up.export(0, len(upstream), upstream, lm.fingerprint)
    prompt = [1, 2, 3, 4, 5] + upstream + [6, 7, 8, 9, 10]
    n, end = len(prompt), 5 + len(upstream)
    active = torch.tensor(list(range(0, 9)) + list(range(end, n)))  # the gap, 4 repaired tokens, the tail
    expected, got = (SequenceKV(cfg, torch.float32, "cpu", capacity=n + 1) for _ in range(2))
    for cache in (expected, got):
        cache.load_span(span, 5, lm.model.rope)
    assert got._refs  # read in place, not copied
    lm.model.prefill(torch.tensor(prompt), expected, StaticSchedule(active))
    bind_layers(cfg, vllm_llama(lm.model)).compute_kv(torch.tensor(prompt), got, active)
    torch.testing.assert_close(got.kv_all(0, n)[0], expected.kv_all(0, n)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.kv_all(0, n)[1], expected.kv_all(0, n)[1], rtol=1e-5, atol=1e-5)
