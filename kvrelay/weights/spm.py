"""Tokenizers from GGUF metadata: SentencePiece-style BPE (``tokenizer.ggml.model = "llama"``), as
Gemma 3 ships it, next to the byte-level BPE that ``Tokenizer.from_gguf_metadata`` builds.

A SentencePiece vocabulary in a GGUF has tokens, scores and types but no merges; spaces are ``▁``
and bytes outside the vocabulary fall back to ``<0x..>`` tokens. The merges are rebuilt from the
vocabulary: every way to cut a token into two tokens is a merge, ranked by the token's place in the
file (Gemma's scores do not follow its merge order; its file order does). This reproduces the
tokenizer ``transformers`` builds from the same file, token for token.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvrelay.errors import CorruptModelError
from kvrelay.model.tokenizer import GGUF_CONTROL, GGUF_USER_DEFINED, Tokenizer

SPACE = "\u2581"  # SentencePiece's visible space

# Gemma 3's chat template (from its instruction-tuned tokenizer config), for GGUFs that carry none:
# no system role, so a system message is prepended to the first user turn.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
DEFAULT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (byte-level or SentencePiece BPE), with its chat template."""
    if meta.get("tokenizer.ggml.model") != "llama":
        return Tokenizer.from_gguf_metadata(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CorruptModelError(f"GGUF tokenizer: {len(tokens)} tokens but {len(types)} token types")
    # Runs of two or more spaces are stored as spaces; the text they match has been normalised to ▁.
    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(spelled)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    try:
        backend = HFTokenizer(models.BPE(vocab, _merges(vocab), fuse_unk=True, byte_fallback=True,
                                         unk_token=None if unk is None else tokens[unk]))
    except Exception as exc:  # tokenizers raises a bare Exception on an inconsistent vocab
        raise CorruptModelError(f"GGUF SentencePiece vocabulary is inconsistent: {exc}") from exc
    backend.normalizer = normalizers.Replace(" ", SPACE)
    # (after the normaliser no space is left to split on: the whole text is one BPE word, as in SentencePiece)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True) if kind == GGUF_CONTROL])
    # user-defined tokens (Gemma: runs of newlines) always match whole, but are text, not control
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types, strict=True) if kind == GGUF_USER_DEFINED and t in vocab])

    def token_at(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    template = meta.get("tokenizer.chat_template") or DEFAULT_TEMPLATES.get(meta.get("general.architecture"))
    return Tokenizer(backend, template, token_at("tokenizer.ggml.bos_token_id"),
                     token_at("tokenizer.ggml.eos_token_id"))


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best first: earlier tokens first, then longer left and
    right pieces, then lower piece ids."""
    ranked = []
    for tok, idx in vocab.items():
        splits = [(tok[:j], tok[j:]) for j in range(1, len(tok)) if tok[:j] in vocab and tok[j:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(left, right, -idx) for left, right in splits]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep id order
    return [(left, right) for left, right, _ in ranked]
