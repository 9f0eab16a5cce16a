"""Gemma 3 from GGUF without the real weights: a tiny model written the way llama.cpp lays it out, a toy
SentencePiece vocabulary against transformers' own GGUF tokenizer, and models shipped in chunk packages."""

import hashlib

import numpy as np
import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import CorruptModelError
from kvrelay.weights import loader
from kvrelay.weights.chunked import assembled
from kvrelay.weights.loader import load_model
from kvrelay.weights.spm import tokenizer_from_gguf
from tests.helpers import gguf_writer

SPACE = "\u2581"
# llama.cpp's names for Gemma 3's tensors (its ffn_norm is the MLP's input norm)
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def toy_spm_metadata(vocab_size: int) -> dict:
    """A SentencePiece-style vocabulary as Gemma's GGUF spells it: controls, byte fallbacks, ▁ spaces, a
    run of two spaces stored as spaces, newline runs as user-defined tokens; padded with unused controls."""
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\n", "\n\n", "  ", SPACE, "a", "b", "c", "ab", "abc", SPACE + "a", SPACE + "ab", "1", "2", "12"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = controls + pieces + byte_tokens
    types = [3] * len(controls) + [4, 4, 4] + [1] * (len(pieces) - 3) + [6] * 256
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    types += [3] * (vocab_size - len(types))
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0}


TEXTS = ["abc ab a  b\n\nc", " ab", "  abc   12 121", "zz ünï 日本 🙂", "<start_of_turn>user\nab<end_of_turn>\n", ""]


def test_toy_sentencepiece_vocab_matches_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = toy_spm_metadata(300)
    ours = tokenizer_from_gguf(meta)
    hf_dict = {"tokenizer_type": "llama", "tokens": meta["tokenizer.ggml.tokens"],
               "token_type": meta["tokenizer.ggml.token_type"], "scores": meta["tokenizer.ggml.scores"]}
    hf, _ = convert_gguf_tokenizer("gemma3", hf_dict)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("  ") == [ours.token_to_id(SPACE * 2)]  # the spaces-spelled token, respelled
    assert ours.encode("ab") == [ours.token_to_id("ab")]


def test_gemma3_chat_template_and_stops_when_the_gguf_has_none():
    tok = tokenizer_from_gguf(toy_spm_metadata(300))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Sure?"}]
    assert tok.apply_chat_template(msgs) == ("<bos><start_of_turn>user\nBe brief.\n\nHi?<end_of_turn>\n"
                                             "<start_of_turn>model\nYes.<end_of_turn>\n"
                                             "<start_of_turn>user\nSure?<end_of_turn>\n<start_of_turn>model\n")
    assert {tok.token_to_id("<end_of_turn>"), tok.token_to_id("<eos>")} <= tok.stop_ids


def _tiny_gemma3():
    import transformers

    torch.manual_seed(0)
    # 6 layers: llama.cpp's fixed pattern makes layer 5 global; query_pre_attn_scalar = head_dim as it assumes
    cfg = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def write_gemma3_gguf(path, hf) -> None:
    """``hf`` as llama.cpp's converter writes Gemma 3 (F32): norm weights stored as 1 + w, no Q/K permute."""
    cfg = hf.config
    w = gguf_writer(path, "gemma3", cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    w.add_sliding_window(cfg.sliding_window)
    meta = toy_spm_metadata(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    for name, t in hf.state_dict().items():
        arr = t.float().numpy().copy()
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            arr = arr + 1.0
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            out = f"blk.{layer}.{NAMES[module]}.{suffix}"
        w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma3_gguf_loads_and_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    hf = _tiny_gemma3()
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma3_gguf(path, hf)
    lm = load_model(str(path), progress=False)
    cfg = lm.config
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (8, 10000.0, 32.0)
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = lm.model.prefill(ids, SequenceKV(cfg, torch.float32, "cpu"), all_logits=True).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    again = load_model(str(path), progress=False)  # from the conversion cache
    assert again.config == cfg and again.tokenizer.encode(TEXTS[0]) == lm.tokenizer.encode(TEXTS[0])


# ---------------------------------------------------------------- models in chunk packages


def _chunked_packages(root, data: bytes, sha: str) -> None:
    """``fakemodel`` (lists the SHA-256) and ``fakemodel_part1``/``_part2``, each with one chunk."""
    (root / "fakemodel" / "data").mkdir(parents=True)
    (root / "fakemodel" / "__init__.py").write_text("raise ImportError('kvrelay must not import me')\n")
    (root / "fakemodel" / "data" / "SHA256SUMS").write_text(f"{sha}  m.gguf\n")
    for i, chunk in enumerate((data[:7], data[7:]), start=1):
        part = root / f"fakemodel_part{i}"
        (part / "data").mkdir(parents=True)
        (part / "__init__.py").write_text("raise ImportError('kvrelay must not import me')\n")
        (part / "data" / f"m.gguf.part{i - 1:02d}").write_bytes(chunk)


def test_alias_in_chunk_packages_is_joined_once_into_the_cache(tmp_path, monkeypatch):
    data = bytes(np.random.default_rng(0).integers(0, 256, 20, dtype=np.uint8))
    _chunked_packages(tmp_path / "site", data, hashlib.sha256(data).hexdigest())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(loader.ALIASES, "fake", ("fakemodel", "m.gguf", "pip install fakemodel"))
    path = loader._alias_path("fake")
    assert path == tmp_path / "cache" / "gguf" / "m.gguf" and path.read_bytes() == data
    mtime = path.stat().st_mtime_ns
    assert loader._alias_path("fake") == path and path.stat().st_mtime_ns == mtime  # not joined again
    assert not (tmp_path / "site" / "fakemodel" / "m.gguf").exists()  # nothing written into site-packages


def test_chunks_that_do_not_match_the_listed_sha256_are_refused(tmp_path, monkeypatch):
    data = b"0123456789abcdefghij"
    _chunked_packages(tmp_path / "site", data, hashlib.sha256(b"something else").hexdigest())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(CorruptModelError, match="does not match its SHA-256.*pip install fakemodel"):
        assembled(tmp_path / "site" / "fakemodel", "fakemodel", "m.gguf", tmp_path / "out", "pip install fakemodel")
    assert list((tmp_path / "out").iterdir()) == []  # no half-written or wrong file left behind
