"""Write a GGUF model (an embedded alias or a .gguf path) as a Hugging Face folder that transformers and vLLM load.

vLLM does not load these GGUF files itself, and kvrelay's tests must not download a model: the folder is built
from the same dequantized weights and tokenizer that ``load_model`` reads, so the engine under test and kvrelay
compute with the same numbers. The folder holds config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template, which renders tools too), generation_config.json (the stop
tokens) and kvrelay.json: which model the folder was exported from and the fingerprint that model's relay layer
profile is found under, so that ``relay`` on the folder (``kvrelay serve --model FOLDER``, the vLLM connector)
uses the source model's profile without a setting, for as long as the weights file is the one exported.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvrelay.errors import ConfigError, ModelNotFoundError
from kvrelay.model.config import ModelConfig
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.weights.export_record import EXPORT_RECORD, WEIGHTS_FILE
from kvrelay.weights.tool_template import tool_chat_template

# ModelConfig.family -> (architecture class, config.json model_type) as transformers and vLLM name them
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def _int_if_whole(value: float | None) -> float | int | None:
    """transformers' strict config fields take an int where the model's own config.json writes one."""
    return int(value) if value is not None and float(value).is_integer() else value


def hf_config(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json for ``config`` in transformers 5's layout (``rope_parameters``); ``config_from_hf`` reads it
    back to the same ``ModelConfig``."""
    architecture, model_type = _ARCHITECTURES[config.family]
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta,
            **{k: v for k, v in config.rope_scaling.items() if k != "rope_type"}}
    eos = list(config.eos_token_ids)
    out: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type, "dtype": dtype,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "attention_bias": config.qkv_bias, "attention_dropout": 0.0, "use_cache": True,
    }
    if config.family == "gemma3":
        local = {"rope_type": "default", "rope_theta": config.rope_local_theta}
        out.update(hidden_activation="gelu_pytorch_tanh", rope_parameters={"full_attention": rope,
                                                                          "sliding_attention": local},
                   sliding_window=config.sliding_window, layer_types=list(config.layer_types),
                   query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar), final_logit_softcapping=None,
                   attn_logit_softcapping=None, pad_token_id=0)
    else:
        out.update(hidden_act="silu", rope_parameters=rope, mlp_bias=False)
        if config.family in ("qwen2", "qwen3", "mistral"):
            out.update(sliding_window=config.sliding_window, use_sliding_window=config.sliding_window is not None)
    return out


def tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the fast tokenizer as it is (no BOS added by encoding: the chat template writes
    it where the model wants it, as kvrelay's own tokenizer does), its special tokens and chat template, which
    also renders OpenAI tools in kvrelay serve's format (kvrelay.weights.tool_template: vLLM's tool calling needs
    a template that renders them, and neither embedded model's has one)."""
    template = tool_chat_template(tokenizer.chat_template) if tokenizer.chat_template else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "chat_template": template,
            "model_max_length": max_length, "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False}


def generation_config(config: ModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """generation_config.json: every id kvrelay stops on (end of turn as well as end of text), so vLLM ends
    a chat turn where kvrelay does."""
    return {"bos_token_id": config.bos_token_id, "eos_token_id": sorted(tokenizer.stop_ids)}


def export_hf(model: str, out_dir: str | Path, dtype: str = "float32", overwrite: bool = False,
              progress: bool = True) -> Path:
    """Write ``model`` (alias such as ``smollm2-135m``, or a .gguf path) as a Hugging Face folder ``out_dir``.

    The weights are the GGUF's dequantized to fp32 (kvrelay's own numbers), then cast to ``dtype``. The folder
    is written next to ``out_dir`` and renamed into place, so a stopped export leaves no half folder."""
    import torch
    from safetensors.torch import save_file

    from kvrelay.weights.gguf import read_gguf
    from kvrelay.weights.integrity import file_sha256
    from kvrelay.weights.loader import ALIASES, gguf_path, load_model
    from kvrelay.weights.spm import tokenizer_from_gguf

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    source = gguf_path(model) if model in ALIASES else Path(model).expanduser()
    if not (source.is_file() and source.suffix == ".gguf"):
        raise ModelNotFoundError(f"unknown model {model!r}: not an embedded alias ({', '.join(ALIASES)}) "
                                 "nor an existing .gguf file")
    meta, config, state = read_gguf(source, progress=progress)
    if config.family not in _ARCHITECTURES:
        raise ConfigError(f"{model}: no Hugging Face architecture known for family {config.family!r}")
    tokenizer = tokenizer_from_gguf(meta)
    torch_dtype = getattr(torch, dtype)
    state = {name: t.to(torch_dtype).contiguous() for name, t in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        tokenizer.backend.save(str(tmp / "tokenizer.json"))
        files = {"config.json": hf_config(config, dtype),
                 "tokenizer_config.json": tokenizer_config(tokenizer, config.max_position_embeddings),
                 "generation_config.json": generation_config(config, tokenizer)}
        files[EXPORT_RECORD] = {"exported_from": model, "dtype": dtype,
                                "profile_fingerprint": load_model(model, progress=False).profile_fingerprint,
                                "weights_sha256": file_sha256(tmp / WEIGHTS_FILE)}
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        for path in tmp.iterdir():  # a model folder others may serve from (mkdtemp makes it private)
            path.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
