"""Model loading: GGUF conversion (on a tiny GGUF written here), HF folders, the cache, bad input."""

import json
import os
import struct

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import (
    ConfigError,
    ContextLengthError,
    CorruptModelError,
    DeviceError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from kvrelay.model.config import ModelConfig
from kvrelay.weights import gguf_digests, integrity, loader
from kvrelay.weights.loader import load_model
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


def _said(capsys, caplog) -> str:
    """What the loader told the user since the last call: stderr, and its notices (under pytest, logging records)."""
    said = capsys.readouterr().err + caplog.text
    caplog.clear()
    return said


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


def test_damaged_conversion_cache_is_rebuilt(tiny_gguf, cache_env, capsys, caplog):
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    (next((cache_env / "models").iterdir()) / "model.safetensors").write_bytes(b"garbage")
    again = load_model(str(path), progress=False)
    assert "model.safetensors: size 7 bytes" in _said(capsys, caplog)
    assert again.fingerprint == first.fingerprint


def test_not_a_gguf_file(tmp_path, cache_env, capsys):
    """Refused on its magic before anything else: not hashed into the digest index, no conversion announced."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        load_model(str(bad))
    assert not (cache_env / gguf_digests.DIGEST_INDEX).exists() and not (cache_env / "models").exists()
    assert "converting" not in capsys.readouterr().err


def test_an_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown dtype 'float7'; use float32"):
        load_model("random:tiny", dtype="float7")


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


# ---------------------------------------------------------------- converted-cache integrity


def _converted(cache_env):
    (folder,) = (cache_env / "models").iterdir()
    return folder


def _overwrite(path, offset, data, keep_mtime=False):
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    if keep_mtime:  # bit rot: the content changes, the mtime does not
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


NAN_BYTES = struct.pack("<f", float("nan")) * 64


def sampled(monkeypatch):
    """Treat the tiny weights file as a large one: fast path = 6 sampled 256-byte blocks (of ~540 KB)."""
    monkeypatch.setattr(integrity, "SMALL_FILE_BYTES", 0)
    monkeypatch.setattr(integrity, "SAMPLE_BLOCK_BYTES", 256)
    monkeypatch.setattr(integrity, "SAMPLE_BLOCKS", 4)


@pytest.mark.parametrize("file_size", ["small", "large"])
@pytest.mark.parametrize("where,data", [
    ("header", b"\x00" * 16), ("first tensor", b"\xff" * 7), ("middle", NAN_BYTES), ("middle", b"\0" * 4096),
    ("last byte", b"\x01"), ("random", bytes(range(256)) * 8)])
def test_corrupt_weights_are_detected_and_rebuilt(tiny_gguf, cache_env, capsys, caplog, monkeypatch, where, data,
                                                  file_size):
    if file_size == "large":
        sampled(monkeypatch)
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    ids = torch.arange(12)
    want = _logits(first.model, ids)
    weights = _converted(cache_env) / "model.safetensors"
    size = weights.stat().st_size
    offset = {"header": 8, "first tensor": 4096, "middle": size // 2, "last byte": size - 1,
              "random": size // 3 + 77}[where]
    original = weights.read_bytes()[offset: offset + len(data)]
    assert original != data[: len(original)]  # the write really changes the file
    _overwrite(weights, offset, data)
    again = load_model(str(path), progress=False)
    err = _said(capsys, caplog)
    assert "failed its check (model.safetensors" in err and "converting again" in err
    torch.testing.assert_close(_logits(again.model, ids), want, atol=0, rtol=0)


def test_bit_rot_with_unchanged_mtime(tiny_gguf, cache_env, capsys, caplog, monkeypatch):
    """The fast path hashes sampled blocks; --verify hashes everything."""
    path, _ = tiny_gguf
    sampled(monkeypatch)
    load_model(str(path), progress=False)
    assert "converting" in _said(capsys, caplog)  # the first load converts, and says so
    weights = _converted(cache_env) / "model.safetensors"
    size = weights.stat().st_size
    unsampled = size // 10 + 1000  # between the first sampled block and the next
    _overwrite(weights, unsampled, NAN_BYTES, keep_mtime=True)
    load_model(str(path), progress=False)  # missed by the sample: the cost of the fast path
    assert _said(capsys, caplog) == ""
    load_model(str(path), progress=False, verify=True)
    assert "model.safetensors: sha256 differs" in _said(capsys, caplog)
    _overwrite(weights, size - 100, NAN_BYTES[:8], keep_mtime=True)  # inside the last sampled block
    load_model(str(path), progress=False)
    assert "model.safetensors: sampled blocks differ" in _said(capsys, caplog)


def test_touched_weights_are_verified_in_full_once(tiny_gguf, cache_env, capsys, caplog, monkeypatch):
    path, _ = tiny_gguf
    sampled(monkeypatch)
    load_model(str(path), progress=False)
    assert "converting" in _said(capsys, caplog)  # the first load converts, and says so
    weights = _converted(cache_env) / "model.safetensors"
    os.utime(weights, ns=(0, 10**18))  # same content, new mtime: hashed in full, then recorded
    calls = []
    monkeypatch.setattr(integrity, "file_sha256", lambda p, *a: calls.append(p.name) or real_sha(p))
    load_model(str(path), progress=False)
    assert "model.safetensors" in calls and _said(capsys, caplog) == ""
    meta = json.loads((_converted(cache_env) / "meta.json").read_text())
    assert meta["integrity"]["files"]["model.safetensors"]["mtime_ns"] == 10**18


real_sha = integrity.file_sha256


def test_edited_config_in_meta_is_detected(tiny_gguf, cache_env, capsys, caplog):
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    meta_file = _converted(cache_env) / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["rope_theta"] *= 2
    meta_file.write_text(json.dumps(meta))
    again = load_model(str(path), progress=False)
    assert "the model config differs" in _said(capsys, caplog)
    assert again.config.rope_theta == first.config.rope_theta


@pytest.mark.parametrize("missing", ["meta.json", "tokenizer.json", "model.safetensors"])
def test_partial_cache_folder_is_repaired(tiny_gguf, cache_env, capsys, caplog, missing):
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    (_converted(cache_env) / missing).unlink()
    for _ in range(2):  # repaired once, then loaded from the cache
        again = load_model(str(path), progress=False)
        assert again.fingerprint == first.fingerprint
    err = _said(capsys, caplog)
    assert err.count("converting again") == 1 and f"({missing} is missing" in err
    assert (_converted(cache_env) / missing).exists()


def test_killed_conversions_leftovers_are_removed(tiny_gguf, cache_env):
    path, _ = tiny_gguf
    models = cache_env / "models"
    stale, fresh = models / ".tmp-killed", models / ".tmp-running"
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
    os.utime(stale, (0, 0))
    load_model(str(path), progress=False)
    assert not stale.exists() and fresh.exists()  # a conversion in progress elsewhere is left alone


def test_folder_written_meanwhile_is_replaced(tiny_gguf, cache_env, monkeypatch):
    """Another process leaves a partial folder at the target while this one converts: ours replaces it."""
    from kvrelay.weights import gguf

    path, _ = tiny_gguf
    real_read = gguf.read_gguf

    def read_and_race(p, progress=True):
        out = loader._conversion_dir(p)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        return real_read(p, progress=progress)

    monkeypatch.setattr(gguf, "read_gguf", read_and_race)
    first = load_model(str(path), progress=False)
    monkeypatch.setattr(gguf, "read_gguf", real_read)
    assert load_model(str(path), progress=False).fingerprint == first.fingerprint
    assert (_converted(cache_env) / "meta.json").exists()


@pytest.mark.parametrize("device,match", [
    ("cuda", "CUDA is not available"), ("cuda:0", "CUDA is not available"), ("mps", "MPS"),
    ("bogus", "unknown device"), ("cpu:3", "no index 3"), ("meta", "unsupported device type")])
def test_unavailable_device_is_refused_before_the_cache_is_touched(tiny_gguf, cache_env, device, match,
                                                                   monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    path, _ = tiny_gguf
    load_model(str(path), progress=False)
    folder = _converted(cache_env)
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    for ref in (str(path), "random:tiny"):
        with pytest.raises(DeviceError, match=match):
            load_model(ref, device=device, progress=False)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before


def test_presets_do_not_import_the_loader():
    """One-way dependency: loader -> presets (no import cycle, not even a lazy one)."""
    import ast
    import inspect

    from kvrelay.weights import presets

    tree = ast.parse(inspect.getsource(presets))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("loader" in (m or "") for m in imported), imported


def test_loading_restores_module_init(tiny_gguf, cache_env):
    """The weights skip their random init while the model is built; modules built afterwards get it."""
    path, _ = tiny_gguf

    def fresh() -> list[torch.Tensor]:
        torch.manual_seed(0)
        return [torch.nn.Linear(8, 8).weight.detach(), torch.nn.Embedding(8, 8).weight.detach()]

    before = fresh()
    load_model(str(path), progress=False)
    for a, b in zip(before, fresh(), strict=True):
        assert torch.equal(a, b)  # the seeded init ran, not left as allocated


def test_loading_a_converted_model_does_not_import_dynamo(tiny_gguf, cache_env):
    """Building on the meta device imported torch._dynamo (over a second per load): the build must not."""
    import subprocess
    import sys

    path, _ = tiny_gguf
    load_model(str(path), progress=False)  # convert once in this process
    code = ("import sys; from kvrelay.weights.loader import load_model; "
            f"load_model({str(path)!r}, progress=False); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KVRELAY_CACHE": str(cache_env)})
    assert out.stdout.split()[-1] == "False"


def test_a_conversion_says_so_without_its_progress_bar(tiny_gguf, cache_env, capsys, caplog):
    """``kvrelay serve --log-format json`` loads without the bar (it would break JSON lines); the notice that the
    start converts the model once must not go with it (it did: a start seconds longer, with no word why)."""
    path, _ = tiny_gguf
    load_model(str(path), progress=False)
    assert f"converting {path.name} once" in _said(capsys, caplog)
    load_model(str(path), progress=False)
    assert "converting" not in _said(capsys, caplog)  # once: the next load reads the cache


# ---------------------------------------------------------------- the conversion's key: the GGUF's content


def _gguf_hashes(monkeypatch) -> list[str]:
    """The GGUF files the loader hashes from now on (its seam: ``gguf_digests.file_sha256``)."""
    calls: list[str] = []
    real = gguf_digests.file_sha256
    monkeypatch.setattr(gguf_digests, "file_sha256",
                        lambda p, *a: (calls.append(str(p)) if str(p).endswith(".gguf") else None) or real(p, *a))
    return calls


def _copy(src, dst, mtime_ns=10**18):
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    os.utime(dst, ns=(mtime_ns, mtime_ns))
    return dst


def test_the_same_gguf_at_two_paths_converts_once(tiny_gguf, cache_env, tmp_path, capsys, caplog):
    """A new venv or clone has the same file at a new path with a new mtime: it reuses the conversion."""
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    assert "converting" in _said(capsys, caplog)
    folder = _converted(cache_env)
    copy = _copy(path, tmp_path / "fresh-clone" / ".venv" / "other-name.gguf")
    second = load_model(str(copy), progress=False)
    assert _said(capsys, caplog) == ""  # neither converted nor moved: the very same folder
    assert second.fingerprint == first.fingerprint
    assert _converted(cache_env) == folder


def test_a_different_gguf_converts_separately(tiny_gguf, cache_env, tmp_path, capsys, caplog):
    path, _ = tiny_gguf
    other = tmp_path / "tiny.gguf"  # same name, size and mtime; other weights
    write_tiny_gguf(other, hf_model("smollm2", seed=1))
    os.utime(other, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    first = load_model(str(path), progress=False)
    second = load_model(str(other), progress=False)
    assert _said(capsys, caplog).count("converting") == 2
    assert second.fingerprint != first.fingerprint
    assert len(list((cache_env / "models").iterdir())) == 2
    assert load_model(str(path), progress=False).fingerprint == first.fingerprint
    mine, theirs = loader._conversion_dir(path), loader._conversion_dir(other)  # folders swapped: each is caught
    mine.rename(tmp_path / "swap")
    theirs.rename(mine)
    (tmp_path / "swap").rename(theirs)
    _said(capsys, caplog)
    assert load_model(str(path), progress=False).fingerprint == first.fingerprint
    assert "meta.json records another GGUF's sha256" in _said(capsys, caplog)


def test_a_known_path_is_not_hashed_again(tiny_gguf, cache_env, monkeypatch):
    path, _ = tiny_gguf
    hashed = _gguf_hashes(monkeypatch)
    load_model(str(path), progress=False)
    assert hashed == [str(path)]  # once, for the key; the conversion's record reuses that digest
    load_model(str(path), progress=False)
    loader.load_tokenizer(str(path))
    assert hashed == [str(path)]
    os.utime(path)  # touched: its content is hashed again (and found the same: no conversion)
    load_model(str(path), progress=False)
    assert hashed == [str(path)] * 2


@pytest.mark.parametrize("damage", ["not json", "no entries", "entry not a dict", "digest not hex", "stale size"])
def test_a_corrupt_index_entry_is_recomputed(tiny_gguf, cache_env, monkeypatch, capsys, caplog, damage):
    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    _said(capsys, caplog)
    index_file = cache_env / gguf_digests.DIGEST_INDEX
    index = json.loads(index_file.read_text())
    entry = index["entries"][str(path.resolve())]
    if damage == "not json":
        index_file.write_text('{"entries": {')
    else:
        if damage == "no entries":
            index = {"entries": [entry]}
        elif damage == "entry not a dict":
            index["entries"][str(path.resolve())] = entry["sha256"]
        elif damage == "digest not hex":
            entry["sha256"] = "../../" + entry["sha256"][6:]
        else:
            entry["size_bytes"] += 1
        index_file.write_text(json.dumps(index))
    hashed = _gguf_hashes(monkeypatch)
    again = load_model(str(path), progress=False)
    assert hashed == [str(path)] and again.fingerprint == first.fingerprint
    assert _said(capsys, caplog) == ""  # no conversion: the recomputed digest finds the folder
    repaired = json.loads(index_file.read_text())["entries"][str(path.resolve())]
    assert repaired["sha256"] == real_sha(path) and repaired["size_bytes"] == path.stat().st_size
    load_model(str(path), progress=False)
    assert hashed == [str(path)]  # the repaired entry is used


def test_older_path_keyed_copies_are_reused_and_removed(tiny_gguf, cache_env, tmp_path, capsys, caplog):
    """Before content keys each path converted again: the first load now keeps one such copy of this GGUF
    (renamed) and removes the others; another GGUF's, and a newer conversion version's, stay."""
    import shutil

    path, _ = tiny_gguf
    first = load_model(str(path), progress=False)
    _said(capsys, caplog)
    models = cache_env / "models"
    (current,) = models.iterdir()
    legacy = [models / f"tiny-{i:012x}" for i in range(3)]
    for folder in legacy:
        shutil.copytree(current, folder)
    kept = {}
    for name, change in [("other-aaaaaaaaaaaa", {"weights_sha256": "0" * 64}),
                         ("sha256-feed-v99", {"version": loader.CONVERSION_VERSION + 1})]:
        shutil.copytree(current, models / name)
        meta = json.loads((models / name / "meta.json").read_text())
        (models / name / "meta.json").write_text(json.dumps({**meta, **change}))
        kept[name] = models / name
    shutil.rmtree(current)
    (cache_env / gguf_digests.DIGEST_INDEX).unlink()  # a cache the older kvrelay wrote has no index
    again = load_model(str(path), progress=False)
    said = _said(capsys, caplog)
    assert "converting" not in said and f"reusing the conversion in {legacy[0]}" in said
    assert "removed 2 other conversions of the same GGUF" in said
    assert again.fingerprint == first.fingerprint
    assert sorted(p.name for p in models.iterdir()) == sorted([current.name, *kept])
