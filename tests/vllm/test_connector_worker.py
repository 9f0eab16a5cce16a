"""The connector's worker side without vLLM: a stand-in of vLLM's model (modules named and returning as vLLM's)
and of its CPU paged KV, on the random tiny model. What a load writes must be what kvrelay's own engine computes
for the same plan, and a stored span must be the request's K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.cache.kv import SequenceKV
from kvrelay.model.schedule import StaticSchedule
from kvrelay.vllm.binding import bind_transformer, find_model
from kvrelay.vllm.hub import ConnectorConfig, Hub
from kvrelay.vllm.paged import PagedKV, layer_order
from kvrelay.vllm.plan import Run, plan_load
from kvrelay.vllm.worker import LoadJob, SaveJob, WorkerSide
from kvrelay.weights.loader import load_model

NEEDS_VLLM = False  # runs in the main venv: no vLLM here, a stand-in of its model and paged KV
BLOCK = 16


class VllmLinear(nn.Module):
    """A linear module called as vLLM's are: it returns (output, bias)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = weight  # not ``weight``: vLLM's CPU linears leave that empty

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.w), None


def vllm_like(model) -> nn.Module:
    """vLLM's Llama module layout over the tiny model's tensors, with an ``attn`` leaf per layer."""
    root, backbone = nn.Module(), nn.Module()
    backbone.embed_tokens, backbone.norm = model.model.embed_tokens, model.model.norm
    layers = []
    for layer in model.model.layers:
        ours, attn, mlp = nn.Module(), nn.Module(), nn.Module()
        attn.qkv_proj = VllmLinear(layer.self_attn.fused_qkv()[0])
        attn.o_proj = VllmLinear(layer.self_attn.o_proj.weight)
        attn.attn = nn.Module()
        mlp.gate_up_proj, mlp.down_proj = VllmLinear(layer.mlp.fused_gate_up()), VllmLinear(layer.mlp.down_proj.weight)
        ours.self_attn, ours.mlp = attn, mlp
        ours.input_layernorm, ours.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(ours)
    backbone.layers = nn.ModuleList(layers)
    root.model, root.lm_head = backbone, model.lm_head
    return root


@pytest.fixture(scope="module")
def lm():
    return load_model("random:tiny")


@pytest.fixture(scope="module")
def vllm_model(lm):
    return vllm_like(lm.model)


def paged_kv(cfg, num_blocks: int = 16) -> tuple[PagedKV, list[torch.Tensor]]:
    layers = [torch.zeros(num_blocks, cfg.num_kv_heads, BLOCK, 2 * cfg.head_dim) for _ in range(cfg.num_layers)]
    return PagedKV(layers, BLOCK, cfg.num_kv_heads, cfg.head_dim), layers


def full_prefill(lm, ids: list[int]) -> SequenceKV:
    cache = SequenceKV(lm.config, torch.float32, "cpu", capacity=len(ids) + 1)
    lm.model.prefill(torch.tensor(ids), cache)
    return cache


def test_the_model_is_found_by_its_attention_layers_and_computes_as_kvrelays(lm, vllm_model):
    attn = {"model.layers.0.self_attn.attn": vllm_model.model.layers[0].self_attn.attn}
    assert find_model(attn) is vllm_model
    bound = bind_transformer(lm.config, vllm_model)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1))
    ours, theirs = (SequenceKV(lm.config, torch.float32, "cpu", 41) for _ in range(2))
    expected = lm.model.prefill(ids, ours).logits
    got = bound.prefill(ids, theirs).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs.k[:, :, :40], ours.k[:, :, :40], rtol=1e-4, atol=1e-4)
    # no second copy: every tensor the bound model holds is one of the model's own
    ours_params = [p for p in bound.parameters() if p.device.type != "meta"]
    assert ours_params and all(any(p is q for q in lm.model.parameters()) for p in ours_params)


def test_paged_positions_are_where_vllms_cpu_kernel_keeps_them(lm):
    cfg = lm.config
    paged, layers = paged_kv(cfg)
    k = torch.randn(cfg.num_layers, cfg.num_kv_heads, 20, cfg.head_dim)
    v = torch.randn_like(k)
    paged.write(paged.slots([5, 2], 0, 20), k, v)
    # the vec kernels' block: per (block, head), keys as [head_dim, block] (transposed), then values [block, head_dim]
    region = layers[1].view(16, cfg.num_kv_heads, 2, BLOCK * cfg.head_dim)
    keys_t = region[:, :, 0].view(16, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    values = region[:, :, 1].view(16, cfg.num_kv_heads, BLOCK, cfg.head_dim)
    torch.testing.assert_close(keys_t[5, :, :, 3], k[1, :, 3])
    torch.testing.assert_close(values[2, :, 1], v[1, :, 17])  # position 17: block 2, row 1
    for layout in ("transposed", "plain"):
        paged = PagedKV([torch.zeros_like(t) for t in layers], BLOCK, cfg.num_kv_heads, cfg.head_dim, layout)
        paged.write(paged.slots([5, 2], 0, 20), k, v)
        k2, v2 = paged.read(paged.slots([5, 2], 0, 20))
        assert torch.equal(k2, k) and torch.equal(v2, v)
    assert layer_order(["m.layers.10.attn", "m.layers.2.attn"]) == ["m.layers.2.attn", "m.layers.10.attn"]


@pytest.mark.parametrize("layout", ["transposed", "plain"])
def test_a_range_of_positions_reads_as_by_slots(lm, layout):
    """``read_range`` (runs of rows within kernel blocks) equals ``read`` (a gather by position), across scheduler
    blocks of two kernel blocks, from and to mid-block positions."""
    cfg = lm.config
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randn(12, cfg.num_kv_heads, BLOCK, 2 * cfg.head_dim, generator=gen) for _ in range(cfg.num_layers)]
    paged = PagedKV(layers, 2 * BLOCK, cfg.num_kv_heads, cfg.head_dim, layout)
    block_ids = [4, 1, 3]
    for start, end in ((0, 70), (5, 37), (16, 32), (31, 33), (40, 41), (0, 96)):
        fast, slow = paged.read_range(block_ids, start, end), paged.read(paged.slots(block_ids, start, end))
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), (start, end)
    with pytest.raises(ValueError, match="do not fit"):
        paged.read_range(block_ids, 0, 97)


def run_load(lm, vllm_model, hub: Hub, prompt: list[int], plan, block_ids: list[int]):
    paged, _ = paged_kv(lm.config)
    worker = WorkerSide(hub, paged, lm.config, bind_transformer(lm.config, vllm_model))
    result = worker.load(LoadJob("r2", "", prompt[: plan.end], plan, block_ids))
    return result, paged.read(paged.slots(block_ids, 0, plan.end))


def test_a_saved_request_is_its_kv_and_a_load_writes_what_kvrelays_engine_computes(lm, vllm_model):
    cfg, gen = lm.config, torch.Generator().manual_seed(2)
    upstream = torch.randint(0, 49152, (60,), generator=gen).tolist()
    hub = Hub(ConnectorConfig(), lm.fingerprint)
    paged, _ = paged_kv(cfg)
    up_cache = full_prefill(lm, upstream)
    paged.write(paged.slots([0, 1, 2, 3], 0, 60), *up_cache.kv_all(0, 60))
    worker = WorkerSide(hub, paged, cfg, lambda: None)
    assert worker.save(SaveJob("r1", "span-a", "", upstream, [0, 1, 2, 3]))
    span = hub.store.get("span-a")
    assert span.token_ids == tuple(upstream) and torch.equal(span.k, up_cache.kv_all(0, 60)[0])
    assert hub.catalog.index.find(upstream, "", 16) and worker.take_report() == ([("", "span-a")], [])

    prompt = torch.randint(0, 49152, (8,), generator=gen).tolist() + upstream + [11, 12, 13]
    plan = plan_load(prompt, 0, [Run(8, 68, "span-a", 0)], hub.catalog.index.token_ids, "epic", epic_k=4)
    assert (plan.end, plan.recompute) == (68, list(range(12)))
    result, (k, v) = run_load(lm, vllm_model, hub, prompt, plan, [9, 4, 7, 12, 3])
    assert (result.num_claimed, result.num_loaded, result.num_recomputed, result.spans_missing) == (68, 56, 12, 0)
    # kvrelay's engine on the same plan: the span loaded at its new place, the same tokens recomputed
    expected = SequenceKV(cfg, torch.float32, "cpu", capacity=69)
    expected.load_span(span, 8, lm.model.rope, 0, 60)
    lm.model.prefill(torch.tensor(prompt[:12]), expected, StaticSchedule(torch.arange(12)))
    torch.testing.assert_close(k, expected.kv_all(0, 68)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, expected.kv_all(0, 68)[1], rtol=1e-4, atol=1e-4)
    # and layer 0 of a moved span is exact (its keys re-rotated): as a full prefill of the new prompt has it
    full = full_prefill(lm, prompt)
    torch.testing.assert_close(k[0, :, 12:68], full.kv_all(12, 68)[0][0], rtol=1e-4, atol=1e-4)


def test_a_span_gone_from_the_store_is_computed_like_a_gap(lm, vllm_model):
    gen = torch.Generator().manual_seed(3)
    upstream = torch.randint(0, 49152, (40,), generator=gen).tolist()
    hub = Hub(ConnectorConfig(), lm.fingerprint)
    hub.catalog.index.add("gone", upstream, "")
    prompt = [1, 2, 3, 4] + upstream + [5]
    plan = plan_load(prompt, 0, [Run(4, 44, "gone", 0)], hub.catalog.index.token_ids, "naive")
    result, (k, _) = run_load(lm, vllm_model, hub, prompt, plan, [0, 1, 2])
    assert (result.spans_missing, result.num_recomputed, result.num_loaded) == (1, 44, 0)
    torch.testing.assert_close(k, full_prefill(lm, prompt).kv_all(0, 44)[0], rtol=1e-4, atol=1e-4)


def test_the_scheduler_side_follows_the_workers_report(lm):
    """The worker may be another process: the scheduler plans loads only of spans it reported stored (or that
    are pending), and forgets those it refused or evicted."""
    hub = Hub(ConnectorConfig(), lm.fingerprint)
    tokens = list(range(100, 140))
    for span_id in ("kept", "evicted"):
        hub.catalog.index.add(span_id, tokens, "s1")
        hub.pending.add(("s1", span_id))
    hub.reported([("s1", "kept")], [("s1", "evicted")])
    assert hub.available("s1", "kept") and not hub.available("s1", "evicted")
    assert not hub.available("s2", "kept")  # another namespace never sees it
    assert {m.span_id for m in hub.catalog.index.find(tokens, "s1", 16)} == {"kept"}


def test_a_load_computes_its_tokens_kv_without_the_output_head(lm, vllm_model, monkeypatch):
    """The connector keeps only K/V: its forward stops after the last layer (no final norm, no 49k-row head), and
    writes what the whole scheduled prefill writes, bit for bit."""
    cfg, gen = lm.config, torch.Generator().manual_seed(4)
    upstream = torch.randint(0, 49152, (50,), generator=gen).tolist()
    hub = Hub(ConnectorConfig(), lm.fingerprint)
    hub.catalog.put("", "up", full_prefill(lm, upstream).export(0, 50, upstream, lm.fingerprint))
    prompt = [7, 8, 9] + upstream[:30] + [10, 11] + upstream[30:] + [12]
    runs = [Run(3, 33, "up", 0), Run(35, 55, "up", 30)]
    plan = plan_load(prompt, 0, runs, hub.catalog.index.token_ids, "epic", epic_k=4)
    assert plan.end == 55 and len(plan.recompute) > 8  # the gaps and both runs' first tokens
    bound = bind_transformer(cfg, vllm_model)
    heads = []
    monkeypatch.setattr(bound, "logits_from_hidden", lambda h: heads.append(h))
    paged, _ = paged_kv(cfg)
    result = WorkerSide(hub, paged, cfg, bound).load(LoadJob("r", "", prompt[: plan.end], plan, [3, 1, 4, 0]))
    assert heads == [] and result.num_recomputed == len(plan.recompute)
    k, v = paged.read(paged.slots([3, 1, 4, 0], 0, plan.end))
    # the same plan through the whole scheduled prefill (logits and all) of the same bound modules, on the same
    # placed spans
    expected = SequenceKV(cfg, torch.float32, "cpu", capacity=plan.end + 1)
    for piece in plan.pieces:
        expected.load_span(hub.store.get("up"), piece.dst_start, lm.model.rope, piece.src_start,
                           piece.src_start + piece.num_tokens)
    last = plan.recompute[-1]
    bind_transformer(cfg, vllm_model).prefill(torch.tensor(prompt[: last + 1]), expected,
                                              StaticSchedule(torch.tensor(plan.recompute)))
    assert torch.equal(k, expected.kv_all(0, plan.end)[0]) and torch.equal(v, expected.kv_all(0, plan.end)[1])


def test_an_exact_claim_past_vllms_prefix_reads_nothing_of_it_back(lm, vllm_model, monkeypatch):
    """A claim loaded whole as stored (the exact prefix beyond vLLM's own cache: a prompt repeated near the context
    limit) needs none of what vLLM computed before it; a claim with tokens to compute reads it (they attend to it)."""
    cfg, gen = lm.config, torch.Generator().manual_seed(5)
    upstream = torch.randint(0, 49152, (60,), generator=gen).tolist()
    hub = Hub(ConnectorConfig(), lm.fingerprint)
    full = full_prefill(lm, upstream)
    hub.catalog.put("", "up", full.export(0, 60, upstream, lm.fingerprint))
    prompt = upstream[:50] + [3, 4]
    plan = plan_load(prompt, 16, [Run(0, 50, "up", 0)], hub.catalog.index.token_ids, "epic")
    assert (plan.num_computed, plan.end, plan.recompute) == (16, 50, [])
    paged, _ = paged_kv(cfg)
    paged.write(paged.slots([2, 5, 6, 1], 0, 16), *full.kv_all(0, 16))  # vLLM's own first block
    reads = []
    monkeypatch.setattr(paged, "read_range", lambda *a: reads.append(a) or PagedKV.read_range(paged, *a))
    worker = WorkerSide(hub, paged, cfg, bind_transformer(cfg, vllm_model))
    result = worker.load(LoadJob("r", "", prompt[: plan.end], plan, [2, 5, 6, 1]))
    assert reads == [] and (result.num_loaded, result.num_recomputed) == (34, 0)
    k, v = paged.read(paged.slots([2, 5, 6, 1], 0, 50))
    assert torch.equal(k, full.kv_all(0, 50)[0]) and torch.equal(v, full.kv_all(0, 50)[1])
    # the span gone: its tokens are computed, attending to vLLM's first block, read back for them
    hub.catalog.drop("", "up")
    result = worker.load(LoadJob("r", "", prompt[: plan.end], plan, [2, 5, 6, 1]))
    assert len(reads) == 1 and (result.spans_missing, result.num_recomputed) == (1, 34)
    k, _ = paged.read(paged.slots([2, 5, 6, 1], 0, 50))
    torch.testing.assert_close(k, full.kv_all(0, 50)[0], rtol=1e-4, atol=1e-4)
