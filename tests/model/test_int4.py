"""Decode on a GGUF's 4-bit weights: the blocks read back exactly, the kernel computes their product, and
only decode steps, on the very weight the blocks stand for, take that path; every prefill keeps fp32."""

import pytest
import torch
import torch.nn.functional as F

from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import ConfigError
from kvrelay.model.int4 import GROUP_SIZE, Int4Weight, decode_steps, int4_of
from kvrelay.model.layers import linear
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.weights.gguf import read_int4_blocks
from kvrelay.weights.loader import load_model
from tests.helpers import hf_model, write_tiny_gguf


def _blocks(rows: int, cols: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(rows, cols // GROUP_SIZE, generator=gen) * 0.02
    offset = -torch.rand(rows, cols // GROUP_SIZE, generator=gen) * 0.1
    weight = (q.float().view(rows, -1, GROUP_SIZE) * scale[..., None] + offset[..., None]).view(rows, cols)
    return weight, q, scale, offset


def test_int4_weight_computes_the_product_of_its_blocks():
    weight, q, scale, offset = _blocks(32, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    ref = x @ weight.t()
    out = Int4Weight(weight, q, scale, offset)(x)
    assert out.dtype == torch.float32 and out.shape == (3, 32)
    # bf16 activations and output: ~3 significant digits of the exact product
    assert float((out - ref).abs().max()) < 1e-2 * float(ref.abs().max())


def test_int4_weight_rejects_blocks_of_another_shape():
    weight, q, scale, offset = _blocks(32, 64)
    with pytest.raises(ValueError, match="do not cover"):
        Int4Weight(weight, q[:16], scale[:16], offset[:16])


def test_linear_takes_the_4bit_path_only_in_decode_steps_on_its_own_unchanged_weight():
    weight, q, scale, offset = _blocks(32, 64)
    bias = torch.randn(32)
    stand_in = Int4Weight(weight, q, scale, offset)
    x = torch.randn(40, 64)  # any number of rows
    assert torch.equal(linear(x, weight, bias, stand_in), F.linear(x, weight, bias))  # outside a decode step
    with decode_steps():
        assert torch.equal(linear(x, weight, bias, stand_in), stand_in(x) + bias)
        assert not torch.equal(linear(x, weight, bias, stand_in), F.linear(x, weight, bias))
        same_values = weight.clone()  # another tensor, even with equal values, is not what the blocks stand for
        assert torch.equal(linear(x, same_values, None, stand_in), F.linear(x, same_values))
        weight.mul_(2.0)  # weights loaded into the model in place: the blocks no longer stand for them
        assert torch.equal(linear(x, weight, None, stand_in), F.linear(x, weight))
    assert torch.equal(linear(x, weight, None, None), F.linear(x, weight))


def test_a_decode_step_off_the_4bit_path_runs_on_the_packed_weight(monkeypatch):
    """Under inference mode (every forward) a weight the blocks do not stand for takes the oneDNN-packed
    product, not the 4-bit one."""
    from kvrelay.model import packed

    if not packed.available():
        pytest.skip("this torch has no oneDNN weight packing")
    weight, q, scale, offset = _blocks(32, 64)
    stand_in = Int4Weight(weight, q, scale, offset)
    other = torch.randn(32, 64)
    used: list[int] = []
    real = packed.PackedWeight.__call__
    monkeypatch.setattr(packed.PackedWeight, "__call__", lambda self, x, b: used.append(1) or real(self, x, b))
    x = torch.randn(3, 64)
    with torch.inference_mode(), decode_steps():
        assert torch.equal(linear(x, weight, None, stand_in), stand_in(x))
        assert used == []
        torch.testing.assert_close(linear(x, other, None, stand_in), F.linear(x, other), atol=1e-5, rtol=0)
        assert used == [1]


def test_only_the_very_tensor_over_its_own_memory_is_stood_for():
    weight, q, scale, offset = _blocks(32, 64)
    stand_in = Int4Weight(weight, q, scale, offset)
    x = torch.randn(2, 64)
    with decode_steps():
        alias = weight.detach()  # another object over the same memory, with the same version counter
        assert torch.equal(linear(x, alias, None, stand_in), F.linear(x, alias))
        weight.data = torch.zeros(32, 64)  # new memory under the same object, no new version
        assert torch.equal(linear(x, weight, None, stand_in), F.linear(x, weight))


def test_weights_the_kernel_cannot_pack_get_no_stand_in():
    weight, q, scale, offset = _blocks(24, 64)  # rows not a multiple of 16
    assert int4_of(weight, ["w"], {"w": (q, scale, offset)}) is None
    weight, q, scale, offset = _blocks(32, 64)
    assert int4_of(weight, ["w", "missing"], {"w": (q, scale, offset)}) is None
    assert int4_of(weight, ["w"], {"w": (q, scale, offset)}) is not None


def test_a_weight_made_under_inference_mode_gets_its_stand_in():
    with torch.inference_mode():
        weight, q, scale, offset = _blocks(32, 64)
        stand_in = Int4Weight(weight, q, scale, offset)
        x = torch.randn(2, 64)
        with decode_steps():
            assert torch.equal(linear(x, weight, None, stand_in), stand_in(x))


LAYER_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A tiny Llama written as GGUFs whose layer matrices are Q4_0, Q4_1 and Q4_K (super-blocks of 256: a
    wider model, random blocks), loaded with and without int4."""
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("int4")
    mp.setenv("KVRELAY_CACHE", str(folder / "cache"))
    out = {}
    for layer_type in LAYER_TYPES:
        hf = hf_model("llama2", hidden_size=256, intermediate_size=512, num_hidden_layers=2) \
            if layer_type == "Q4_K" else hf_model("llama2")
        path = folder / f"tiny-{layer_type}.gguf"
        write_tiny_gguf(path, hf, layer_type)
        out[layer_type] = (path, load_model(str(path), progress=False),
                           load_model(str(path), progress=False, int4_decode=True))
    yield out
    mp.undo()


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_blocks_read_back_the_dequantized_weights_exactly(tiny_q4, layer_type):
    path, lm, _ = tiny_q4[layer_type]
    blocks = read_int4_blocks(path, lm.config)
    state = lm.model.state_dict()
    assert len(blocks) == lm.config.num_layers * 7  # q, k, v, o, gate, up, down
    for name, (q, scale, offset) in blocks.items():
        weight = (q.float().view(q.shape[0], -1, GROUP_SIZE) * scale[..., None] + offset[..., None]).view(q.shape)
        assert torch.equal(weight, state[name]), name  # the Q/K rows in HF order, as the conversion has them


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_int4_decode_keeps_every_prefill_and_moves_decode_logits_a_little(tiny_q4, layer_type):
    _, lm, lm4 = tiny_q4[layer_type]
    assert lm4.fingerprint != lm.fingerprint and lm4.profile_fingerprint == lm.fingerprint
    assert lm4.decode_weights == f"int4 ({4 * lm.config.num_layers} of {4 * lm.config.num_layers} weights)"
    prompts = [torch.arange(3, 40), torch.arange(5, 9)]  # a prompt, and one shorter than a decode batch
    caches = [[SequenceKV(m.config, m.dtype, "cpu") for _ in prompts] for m in (lm, lm4)]
    for b, prompt in enumerate(prompts):
        first = [m.model.prefill(prompt, c[b]).logits for m, c in zip((lm, lm4), caches, strict=True)]
        assert torch.equal(first[0], first[1])
    # a suffix prefilled after a reused prefix (a handful of rows) is a prefill too
    suffix = torch.cat([prompts[0], torch.arange(50, 56)])
    tails = [m.model.prefill(suffix, c[0], SuffixSchedule(len(prompts[0]))).logits
             for m, c in zip((lm, lm4), caches, strict=True)]
    assert torch.equal(tails[0], tails[1])
    tokens = [int(first[0].argmax())] * len(prompts)
    for _ in range(4):  # batched decode steps, both sequences in one batch
        p, q = (m.model.decode(tokens, c).log_softmax(-1) for m, c in zip((lm, lm4), caches, strict=True))
        assert not torch.equal(p, q)  # the steps did run on the 4-bit weights
        assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3
        assert torch.equal(p.argmax(-1), q.argmax(-1))
        tokens = p.argmax(-1).tolist()


def test_int4_decode_refuses_models_without_4bit_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="on CPU"):
        load_model("random:tiny", int4_decode=True)
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, hf_model("llama2"))
    with pytest.raises(ConfigError, match="no layer weight is stored as Q4_0, Q4_1 or Q4_K"):
        load_model(str(path), progress=False, int4_decode=True)
