"""Decode on a GGUF's 4-bit weights: the blocks read back exactly, the kernel computes their product, and
only matmuls over a few rows of the very weight they stand for take that path."""

import pytest
import torch
import torch.nn.functional as F

from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import ConfigError
from kvrelay.model import int4
from kvrelay.model.int4 import GROUP_SIZE, Int4Weight, linear
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


def test_linear_takes_the_4bit_path_only_on_few_rows_of_its_own_unchanged_weight():
    weight, q, scale, offset = _blocks(32, 64)
    bias = torch.randn(32)
    stand_in = Int4Weight(weight, q, scale, offset)
    few = torch.randn(int4.MAX_ROWS, 64)
    assert torch.equal(linear(few, weight, bias, stand_in), stand_in(few) + bias)
    assert not torch.equal(linear(few, weight, bias, stand_in), F.linear(few, weight, bias))
    many = torch.randn(int4.MAX_ROWS + 1, 64)
    assert torch.equal(linear(many, weight, bias, stand_in), F.linear(many, weight, bias))
    other = weight.clone()
    assert torch.equal(linear(few, other, None, stand_in), F.linear(few, other))
    weight.mul_(2.0)  # weights loaded into the model in place: the blocks no longer stand for them
    assert torch.equal(linear(few, weight, None, stand_in), F.linear(few, weight))


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A tiny Llama written as GGUFs whose layer matrices are Q4_0 and Q4_1, loaded with and without int4."""
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("int4")
    mp.setenv("KVRELAY_CACHE", str(folder / "cache"))
    hf = hf_model("llama2")
    out = {}
    for layer_type in ("Q4_0", "Q4_1"):
        path = folder / f"tiny-{layer_type}.gguf"
        write_tiny_gguf(path, hf, layer_type)
        out[layer_type] = (path, load_model(str(path), progress=False),
                           load_model(str(path), progress=False, int4_decode=True))
    yield out
    mp.undo()


@pytest.mark.parametrize("layer_type", ["Q4_0", "Q4_1"])
def test_blocks_read_back_the_dequantized_weights_exactly(tiny_q4, layer_type):
    path, lm, _ = tiny_q4[layer_type]
    blocks = read_int4_blocks(path, lm.config)
    state = lm.model.state_dict()
    assert len(blocks) == lm.config.num_layers * 7  # q, k, v, o, gate, up, down
    for name, (q, scale, offset) in blocks.items():
        weight = (q.float().view(q.shape[0], -1, GROUP_SIZE) * scale[..., None] + offset[..., None]).view(q.shape)
        assert torch.equal(weight, state[name]), name  # the Q/K rows in HF order, as the conversion has them


@pytest.mark.parametrize("layer_type", ["Q4_0", "Q4_1"])
def test_int4_decode_keeps_prefill_and_moves_decode_logits_a_little(tiny_q4, layer_type):
    _, lm, lm4 = tiny_q4[layer_type]
    assert lm4.fingerprint != lm.fingerprint
    for layer in lm4.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert None not in (attn.int4_qkv, attn.int4_o, mlp.int4_gate_up, mlp.int4_down)
    prompt = torch.arange(3, 3 + int4.MAX_ROWS + 8)  # more rows than the 4-bit path takes
    caches = [SequenceKV(m.config, m.dtype, "cpu") for m in (lm, lm4)]
    first = [m.model.prefill(prompt, c).logits for m, c in zip((lm, lm4), caches, strict=True)]
    assert torch.equal(first[0], first[1])
    token = int(first[0].argmax())
    for _ in range(6):
        p, q = (m.model.decode([token], [c])[0].log_softmax(-1) for m, c in zip((lm, lm4), caches, strict=True))
        assert not torch.equal(p, q)  # the step did run on the 4-bit weights
        assert float((p.exp() * (p - q)).sum()) < 1e-3
        assert int(p.argmax()) == int(q.argmax())
        token = int(p.argmax())


def test_int4_decode_refuses_models_without_4bit_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="on CPU"):
        load_model("random:tiny", int4_decode=True)
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, hf_model("llama2"))
    with pytest.raises(ConfigError, match="no layer weight is stored as Q4_0 or Q4_1"):
        load_model(str(path), progress=False, int4_decode=True)
