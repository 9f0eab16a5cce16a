"""The real default model: conversion, tokenizer and forward against transformers' own GGUF loader."""

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.weights.loader import load_model
from tests.helpers import hf_from_alias

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_pair():
    return hf_from_alias("smollm2-135m")


PROMPT = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                                      "half as many clips in May. How many clips did she sell altogether?"}]


def test_tokenizer_matches_transformers(lm, hf_pair):
    _, hf_tok = hf_pair
    for text in ["Natalia sold 48 clips, 12,345.67 + $678 = ?", "<|im_start|>user\nHi!<|im_end|>\n",
                 "  spaces   and\ttabs\n\nnew  lines ünïcödé 日本語 🙂"]:
        assert lm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert lm.tokenizer.decode(lm.tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_and_stop_tokens(lm):
    text = lm.tokenizer.apply_chat_template(PROMPT)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert lm.tokenizer.token_to_id("<|im_end|>") in lm.tokenizer.stop_ids


def test_logits_match_transformers(lm, hf_pair):
    hf, _ = hf_pair
    ids = torch.tensor(lm.tokenizer.encode(lm.tokenizer.apply_chat_template(PROMPT)))
    with torch.no_grad():
        ref32 = hf(ids[None]).logits[0]
    got32 = lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), all_logits=True).logits
    assert torch.equal(got32.argmax(-1), ref32.argmax(-1))
    # fp32 over 30 layers: summation order (GQA in SDPA vs repeated KV) leaves ~1e-4 on logits of ~40.
    assert (got32 - ref32).abs().max() < 2e-4
    # In fp64 the two forwards agree to the final fp32 cast of our logits: the same computation.
    hf64 = hf.double()  # last use of the fixture: transformers will not cast a GGUF model back
    ours64 = load_model("smollm2-135m", dtype=torch.float64)
    with torch.no_grad():
        ref64 = hf64(ids[None]).logits[0]
    got64 = ours64.model.prefill(ids, SequenceKV(ours64.config, torch.float64, "cpu"), all_logits=True).logits
    assert (got64.double() - ref64).abs().max() < 1e-4


def test_int4_decode_on_the_shipped_q4_1_weights(lm):
    from kvrelay.model.int4 import GROUP_SIZE
    from kvrelay.weights.gguf import read_int4_blocks
    from kvrelay.weights.loader import _alias_path

    blocks = read_int4_blocks(_alias_path("smollm2-135m"), lm.config)
    state = lm.model.state_dict()
    assert len(blocks) == 7 * lm.config.num_layers  # every layer matrix ships as Q4_1
    for name, (q, scale, offset) in blocks.items():
        weight = (q.float().view(q.shape[0], -1, GROUP_SIZE) * scale[..., None] + offset[..., None]).view(q.shape)
        assert torch.equal(weight, state[name]), name
    lm4 = load_model("smollm2-135m", int4_decode=True)
    assert lm4.decode_weights == "int4 (120 of 120 weights)"  # fused q/k/v, o, fused gate/up, down x 30 layers
    from kvrelay.reuse.profile import layer_profile

    assert layer_profile(lm4).layers == layer_profile(lm).layers  # relay uses the fp32 path's profile
    ids = torch.tensor(lm.tokenizer.encode(lm.tokenizer.apply_chat_template(PROMPT)))
    caches = [SequenceKV(m.config, m.dtype, "cpu") for m in (lm, lm4)]
    first = [m.model.prefill(ids, c).logits for m, c in zip((lm, lm4), caches, strict=True)]
    assert torch.equal(first[0], first[1])  # a prefill keeps the fp32 weights
    token = int(first[0].argmax())
    for _ in range(8):
        p, q = (m.model.decode([token], [c])[0].log_softmax(-1) for m, c in zip((lm, lm4), caches, strict=True))
        assert not torch.equal(p, q)  # the step ran on the 4-bit weights
        assert float((p.exp() * (p - q)).sum()) < 2e-3  # BENCHMARKS.md: mean 1.7e-4 over 1,260 steps
        assert int(p.argmax()) == int(q.argmax())
        token = int(p.argmax())
