"""benchmarks/gguf_formats.py: a GGUF rewritten in Q8_0/F16/F32 reads back, through our own reader, as the
same model (the Q/K permutation kept, the tokenizer metadata copied)."""

import numpy as np
import pytest
import torch

from benchmarks.gguf_formats import write_gguf_as
from kvrelay.weights.gguf import _open, read_gguf
from tests.helpers import hf_model, write_tiny_gguf

# Worst-case rounding of each format relative to a tensor's largest |value| (Q8_0: scale/2 per block of 32)
_REL_TOL = {"F32": 0.0, "F16": 2.0 ** -10, "Q8_0": 1.0 / 127}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf_model("smollm2"))
    return path


@pytest.mark.parametrize("fmt", ["F32", "F16", "Q8_0"])
def test_rewritten_gguf_reads_back_as_the_same_weights(tiny_gguf, tmp_path, fmt):
    out = write_gguf_as(tiny_gguf, tmp_path / f"tiny.{fmt}.gguf", fmt)
    meta_src, cfg_src, state_src = read_gguf(tiny_gguf, progress=False)
    meta_out, cfg_out, state_out = read_gguf(out, progress=False)
    assert cfg_out == cfg_src
    assert {k: v for k, v in meta_out.items() if k != "general.file_type"} == \
        {k: v for k, v in meta_src.items() if k != "general.file_type"}
    assert state_out.keys() == state_src.keys()
    for name, ref in state_src.items():
        bound = _REL_TOL[fmt] * float(ref.abs().max())
        torch.testing.assert_close(state_out[name], ref, atol=bound, rtol=0, msg=name)
    types = {t.name: t.tensor_type.name for t in _open(out).tensors}
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}  # llama.cpp wants F32 norms
    assert types["blk.0.attn_q.weight"] == fmt


def test_unknown_format_is_a_clear_error(tiny_gguf, tmp_path):
    with pytest.raises(ValueError, match="Q8_0, F16, F32"):
        write_gguf_as(tiny_gguf, tmp_path / "x.gguf", "Q2_K")
    assert not np.any([p.exists() for p in tmp_path.iterdir()])
