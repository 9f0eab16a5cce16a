"""Tiny random-weight models of every family, built from a transformers config (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvrelay.model.lm import LoadedModel
from kvrelay.model.transformer import Transformer
from kvrelay.weights.configs import config_from_hf

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 100000.0, "tie_word_embeddings": True,
                                                    "num_key_value_heads": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # local layers with an 8-token window and their own RoPE base, globals between; scores not scaled
    # by head_dim; sequences in the tests are longer than the window
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24, "max_position_embeddings": 512,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
}


def hf_model(family: str, seed: int = 0, **shape):
    """A random transformers model of ``family`` (``shape`` overrides config fields); norms and biases
    perturbed so they matter."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**{**COMMON, **extra, **shape})
    config._attn_implementation = "sdpa"
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from_hf(hf) -> Transformer:
    cfg = config_from_hf(hf.config.to_dict())
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def tiny_lm(family: str = "llama2", seed: int = 0, yes_no: bool = False) -> LoadedModel:
    """Our model wrapped as a LoadedModel, with a byte-level toy tokenizer (for engine tests).

    ``yes_no``: the tokenizer also has single tokens for "Yes" and "No" (a verifier's answers).
    """
    from kvrelay.model.tokenizer import Tokenizer

    model = ours_from_hf(hf_model(family, seed))
    meta = toy_tokenizer_metadata()
    if yes_no:
        meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["Ye", "Yes", "No"]
        meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1, 1, 1]
        meta["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"] + ["Y e", "Ye s", "N o"]
    tok = Tokenizer.from_gguf_metadata(meta)
    return LoadedModel(f"tiny-{family}", model, tok, model.config, f"fp-{family}-{seed}", "test")


def toy_tokenizer_metadata() -> dict:
    """GGUF-style metadata of a 259-token byte-level BPE (256 bytes, 2 chat specials, one merge)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<|im_start|>", "<|im_end|>", "ab"]
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(alphabet) + [3, 3, 1], "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": len(alphabet), "tokenizer.ggml.eos_token_id": len(alphabet) + 1,
        "tokenizer.chat_template": template,
    }


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's conversion permutation of Q/K rows (what kvrelay must undo)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_writer(path: Path, arch: str, cfg):
    """A GGUFWriter for ``arch`` with the shape keys every family has, from a transformers config."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


def hf_from_alias(alias: str):
    """transformers' model and tokenizer reading the same GGUF file as ``load_model(alias)``: an
    independent dequantization, config and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvrelay.weights.loader import _alias_path

    path = _alias_path(alias)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def random_q4_k(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random Q4_K blocks for a [N, K] weight (the gguf package cannot quantize to Q4_K): small fp16 d and
    dmin, random 6-bit scales and mins and nibbles. Bytes [N, K / 256 * 144]."""
    rows, cols = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):  # d, dmin
        blocks[..., at : at + 2] = rng.uniform(2e-5, 5e-5, size=(rows, cols // 256, 1)).astype(np.float16).view(
            np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, hf, layer_type: str = "F32") -> None:
    """Write ``hf`` (a Llama) as a GGUF file the way llama.cpp's converter lays it out: F32, or the layers'
    matrices quantized to ``layer_type`` (Q4_0, Q4_1...) as a quantized GGUF stores them."""
    import gguf

    cfg = hf.config
    w = gguf_writer(path, "llama", cfg)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    meta = toy_tokenizer_metadata()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in hf.state_dict().items():
        arr = t.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{suffix}"
            if module == "self_attn.q_proj":
                arr = _permute(arr, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                arr = _permute(arr, cfg.num_key_value_heads)
            if layer_type != "F32" and arr.ndim == 2:
                kind = gguf.GGMLQuantizationType[layer_type]
                data = random_q4_k(arr.shape, len(out)) if layer_type == "Q4_K" else gguf.quants.quantize(arr, kind)
                w.add_tensor(out, data, raw_dtype=kind)
                continue
        w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def generate(lm: LoadedModel, call, method="full", store=None, sampling=None, capture_layers: tuple[int, ...] = (),
             keep_cache: bool = False, forced_output_ids=None, learn: bool = True, feed_last: bool | None = None):
    """One call on a fresh ``Engine`` (the tests' shorthand; the engine carries ``capture_layers`` too)."""
    from kvrelay.engine import Engine, GenerateOptions
    from kvrelay.model.sampling import SamplingConfig

    options = GenerateOptions(sampling or SamplingConfig(), keep_cache, forced_output_ids, learn, feed_last)
    return Engine(lm, store, capture_layers=capture_layers).generate(call, method, options)


def publish(store, span_id: str, out, lm: LoadedModel, pin: bool = False):
    from kvrelay.engine import Engine

    return Engine(lm, store).publish(span_id, out, pin)


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in [0, 256), the same for the same seed."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def relayed_call(family: str):
    """(lm, store, call) of a tiny model: an upstream call (24 prompt, 10 output tokens, layer 1's hidden states
    captured) published as span "up", and a call holding its prompt as an exact prefix, its output moved 3 positions
    later, then 29 new tokens."""
    from kvrelay.cache.store import KVStore
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.reuse.base import CallInput, SpanRef

    lm = tiny_lm(family)
    store = KVStore(1 << 30)
    upstream = generate(lm, random_ids(24, 1), "full", store, SamplingConfig(max_new_tokens=10), keep_cache=True,
                        capture_layers=(1,))
    publish(store, "up", upstream, lm)
    ids = upstream.prompt_ids + random_ids(3, 6) + upstream.output_ids + random_ids(29, 5)
    return lm, store, CallInput(ids, refs=[SpanRef(27, 37, "up", 24)])
