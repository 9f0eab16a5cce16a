"""Weights packed for oneDNN: the same products as ``F.linear``, used only while the weight is unchanged."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from kvrelay.cache.kv import SequenceKV
from kvrelay.model import packed
from kvrelay.model.layers import linear
from kvrelay.model.transformer import Transformer
from tests.helpers import hf_model, ours_from_hf

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN weight packing")


def calls(monkeypatch) -> list[int]:
    """Counts the products run on packed weights."""
    seen: list[int] = []
    real = packed.PackedWeight.__call__

    def counted(self, x, bias):
        seen.append(x.shape[0])
        return real(self, x, bias)

    monkeypatch.setattr(packed.PackedWeight, "__call__", counted)
    return seen


def copies_made(monkeypatch) -> list[int]:
    """Counts the packed copies made."""
    made: list[int] = []
    real_init = packed.PackedWeight.__init__

    def counted_init(self, source):
        made.append(1)
        real_init(self, source)

    monkeypatch.setattr(packed.PackedWeight, "__init__", counted_init)
    return made


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_same_products_as_f_linear(rows, monkeypatch):
    seen = calls(monkeypatch)
    torch.manual_seed(rows)
    w, b = torch.randn(96, 80), torch.randn(96)
    wide = torch.randn(rows, 160)
    x = wide[:, ::2]  # not contiguous: a chunk of a fused output is read this way
    with torch.inference_mode():
        got, got_nb = linear(x, w, b), linear(x.contiguous(), w)
    ref = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    torch.testing.assert_close(got_nb, (x.double() @ w.double().T).float(), atol=1e-5 * float(ref.abs().max()), rtol=0)
    assert seen == [rows, rows]


def test_a_changed_weight_is_packed_again(monkeypatch):
    seen = calls(monkeypatch)
    w, x = torch.randn(48, 32), torch.randn(5, 32)
    with torch.inference_mode():
        before = linear(x, w)
    with torch.no_grad():
        w.mul_(2)  # in place: a new version
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), 2 * before, atol=1e-5, rtol=0)
    w.data = torch.randn(48, 32)  # new memory under the same object, no new version
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=0)
    assert len(seen) == 3


@pytest.fixture
def env_read_again():
    packed._env_on.cache_clear()
    yield
    packed._env_on.cache_clear()


def test_plain_path_where_packing_does_not_apply(monkeypatch, env_read_again):
    seen = calls(monkeypatch)
    w = torch.randn(24, 16, requires_grad=True)
    x = torch.randn(3, 16)
    out = linear(x, w)  # gradients wanted: the autograd path, exactly F.linear
    out.sum().backward()
    assert w.grad is not None and torch.equal(out, F.linear(x, w))
    with torch.inference_mode():
        with packed.unpacked():
            assert torch.equal(linear(x, w), F.linear(x, w))
        assert torch.equal(linear(x.double(), w.double()), F.linear(x.double(), w.double()))  # fp64: not packed
        monkeypatch.setenv(packed.ENV_VAR, "0")
        packed._env_on.cache_clear()
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert seen == []


def test_turning_packing_off_stops_copies_already_made(monkeypatch, env_read_again):
    w, x = torch.randn(8, 4), torch.randn(2, 4)
    with torch.inference_mode():
        linear(x, w)
        assert w in packed._PACKS
        monkeypatch.setenv(packed.ENV_VAR, "0")
        packed._env_on.cache_clear()
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert w not in packed._PACKS


def test_zero_rows_and_bf16(monkeypatch):
    seen = calls(monkeypatch)
    w = torch.randn(24, 16)
    wb = w.to(torch.bfloat16)  # outside inference mode: an inference tensor is never packed
    assert packed.available(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    with torch.inference_mode():
        assert linear(torch.randn(0, 16), w).shape == (0, 24)
        if packed.available(torch.bfloat16):
            x = torch.randn(5, 16, dtype=torch.bfloat16)
            ref = x.double() @ wb.double().T
            torch.testing.assert_close(linear(x, wb).double(), ref, atol=2e-2 * float(ref.abs().max()), rtol=0)
    assert seen == ([0, 5] if packed.available(torch.bfloat16) else [0])


def test_a_weight_moved_off_the_packable_kinds_drops_its_copy():
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        linear(x, lin.weight)
        assert lin.weight in packed._PACKS
        lin.to(torch.float64)  # swaps the parameter's memory: the packed copy no longer stands for it
        assert torch.equal(linear(x.double(), lin.weight), F.linear(x.double(), lin.weight))
    assert lin.weight not in packed._PACKS


def test_inference_tensor_weights_are_never_packed():
    """An inference tensor keeps no version counter: an in-place write to it would leave a packed copy stale."""
    w, x = torch.randn(8, 4), torch.randn(2, 4)
    with torch.inference_mode():
        frozen = w.clone()  # an inference tensor
        assert packed.packed_for(frozen) is None
        frozen.mul_(2)
        assert torch.equal(linear(x, frozen), F.linear(x, frozen))


def test_a_dtype_that_cannot_pack_falls_back_once(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(packed, "_failed", set())
    monkeypatch.setattr(packed, "PackedWeight", broken)
    w, x = torch.randn(8, 4), torch.randn(2, 4)
    with torch.inference_mode():
        assert torch.equal(linear(x, w), F.linear(x, w))
        assert not packed.available(torch.float32)
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert packed.available(torch.bfloat16) == (torch.bfloat16 in packed._supported())  # only fp32 failed
    assert sum("packing failed" in r.message for r in caplog.records) == 1


def test_model_packs_every_matmul_weight_once_and_matches_the_plain_path(monkeypatch):
    hf = hf_model("llama3")
    model = ours_from_hf(hf)
    num_layers = model.config.num_layers
    assert model.matmuls == "F.linear"
    assert model.pack_weights() == 4 * num_layers + 1  # fused qkv, out, fused gate/up, down; the output head
    assert model.matmuls == f"oneDNN packed ({4 * num_layers + 1} weights)"
    made = copies_made(monkeypatch)
    seen = calls(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (40,))
    fast = model.prefill(ids, SequenceKV(model.config, torch.float32, "cpu"), all_logits=True).logits
    with packed.unpacked():
        plain = model.prefill(ids, SequenceKV(model.config, torch.float32, "cpu"), all_logits=True).logits
    assert made == []  # packed at pack_weights(), not on first use
    assert len(seen) == 4 * num_layers + 1
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)


def test_model_built_under_inference_mode_packs_only_its_fused_weights():
    # the fused q/k/v and gate/up are built outside inference mode (layers.fuse_linears); the output
    # projections and the head are inference tensors there, so they stay on F.linear
    with torch.inference_mode():
        model = Transformer(ours_from_hf(hf_model("qwen2")).config)
        assert model.pack_weights() == 2 * model.config.num_layers


def test_threads_packing_one_weight_at_once_share_one_copy(monkeypatch):
    """A server's request threads reach a weight's first use together: one copy is made and every product is right."""
    made = copies_made(monkeypatch)
    w = torch.randn(256, 128)
    xs = [torch.randn(9, 128) for _ in range(8)]
    start = threading.Barrier(len(xs))

    def product(x: torch.Tensor) -> torch.Tensor:
        start.wait()
        with torch.inference_mode():
            return linear(x, w)

    with ThreadPoolExecutor(len(xs)) as pool:
        outs = list(pool.map(product, xs))
    assert made == [1]
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=0)
