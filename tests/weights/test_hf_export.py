"""``kvrelay export-hf``: the embedded models as Hugging Face folders that transformers (and so vLLM) load with
kvrelay's own numbers: the same config, tokens, chat template, stop ids and logits as kvrelay's ``full`` prefill."""

import importlib.util
import json

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cli import main as cli_main
from kvrelay.errors import ConfigError, ModelNotFoundError
from kvrelay.model import packed
from kvrelay.weights.configs import config_from_hf
from kvrelay.weights.hf_export import export_hf
from kvrelay.weights.loader import ALIASES, load_model

pytestmark = pytest.mark.slow

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did she sell altogether in April and May?")
MODELS = [pytest.param(alias, marks=pytest.mark.skipif(importlib.util.find_spec(ALIASES[alias][0]) is None,
                                                       reason=f"{alias} is not installed"))
          for alias in ("smollm2-135m", "gemma3-270m")]


@pytest.fixture(scope="module", params=MODELS)
def exported(request, tmp_path_factory):
    """(kvrelay's model, transformers' model and tokenizer from the exported folder, the folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    alias = request.param
    folder = tmp_path_factory.mktemp("hf") / alias
    assert cli_main(["export-hf", alias, str(folder)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return load_model(alias), hf, AutoTokenizer.from_pretrained(str(folder)), folder


def _messages(repeat: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Solve the problem step by step."},
            {"role": "user", "content": " ".join([QUESTION] * repeat)}]


def test_config_tokens_template_and_stop_ids_match(exported):
    lm, _, hf_tok, folder = exported
    assert config_from_hf(json.loads((folder / "config.json").read_text())) == lm.config
    messages = _messages(1)
    text = lm.tokenizer.apply_chat_template(messages)
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    # vLLM encodes a rendered chat with add_special_tokens=False and a plain prompt with True: both as kvrelay
    for add_special_tokens in (False, True):
        assert hf_tok.encode(text, add_special_tokens=add_special_tokens) == lm.tokenizer.encode(text)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == set(lm.tokenizer.stop_ids)


def test_logits_match_kvrelay_full_prefill(exported):
    lm, hf, _, _ = exported
    # Gemma 3's local layers see 512 tokens: a prompt past that checks the exported window and layer types
    ids = torch.tensor(lm.tokenizer.encode(lm.tokenizer.apply_chat_template(_messages(16))))
    assert ids.numel() > (lm.config.sliding_window or 0)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    with packed.unpacked():  # the matmuls transformers runs: the same arithmetic
        got = lm.model.prefill(ids, SequenceKV(lm.config, torch.float32, "cpu"), all_logits=True).logits
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max() < 1e-4


def test_refuses_a_non_empty_folder_and_an_unknown_model(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_hf("smollm2-135m", tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "x"
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        export_hf("no-such-model", tmp_path / "out")
    with pytest.raises(ConfigError, match="dtype"):
        export_hf("smollm2-135m", tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_relay_on_the_folder_finds_its_source_models_profile(exported, tmp_path):
    """The folder is a model of its own (its KV is not the GGUF's), but relay's layer profile is the source model's
    (kvrelay.json); a folder whose weights were changed gets none of it."""
    from safetensors.torch import load_file, save_file

    from kvrelay.reuse.profile import layer_profile

    lm, _, _, folder = exported
    on_folder = load_model(str(folder))
    assert on_folder.fingerprint != lm.fingerprint
    assert on_folder.profile_fingerprint == lm.profile_fingerprint
    assert layer_profile(on_folder) == layer_profile(lm)
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in folder.iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    state = load_file(str(folder / "model.safetensors"))
    name = next(iter(state))
    state[name] = state[name] * 1.01
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert load_model(str(changed)).profile_fingerprint == load_model(str(changed)).fingerprint != lm.fingerprint
