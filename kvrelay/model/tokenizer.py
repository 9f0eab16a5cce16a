"""Tokenizer with the model's chat template, built from GGUF metadata or a HF tokenizer.json.

Uses the ``tokenizers`` library directly (no transformers import: loads stay fast).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvrelay.errors import ContextLengthError, CorruptModelError, UnsupportedModelError

# Pre-tokenizer split patterns of llama.cpp's BPE "pre" types (the same regexes as the HF files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# A text longer than this many times (context x the vocabulary's longest token in characters) is refused before
# it is tokenized: no token covers more characters of the text than its own string has (a byte-level token is one
# character per byte; an SPM piece is the text's characters with spaces as "▁"), so such a text holds more
# tokens than the context. The factor leaves room for a normalizer that shortens text (composing accents).
TEXT_CHARS_SLACK = 2
# appended to the final message to find where it ends in the rendered prompt (transformers' tag, so that a
# continued message is cut where transformers, and so vLLM, cut it)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
STOP_TOKEN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "</s>")
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":  # every digit alone, then GPT-2's regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("gpt2", "default", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer pre-type {pre!r}; supported: smollm, gpt2, llama-bpe, qwen2"
        )
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, extra_stop_ids: tuple[int, ...] = ()) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        stops = set(extra_stop_ids)
        for name in (eos_token, *STOP_TOKEN_NAMES):
            tid = backend.token_to_id(name) if name else None
            if tid is not None:
                stops.add(tid)
        self.stop_ids = frozenset(stops)
        self._template = None
        self._template_variables: frozenset[str] | None = None
        self._max_text_chars_per_token: int | None = None  # 0: no bound (an unknown token covers any word)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. <|im_start|>) are parsed. Over
        ``max_tokens`` tokens: ContextLengthError, before any id becomes a Python object."""
        return self._encoding(text, max_tokens).ids

    def encode_with_offsets(self, text: str, max_tokens: int | None = None) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode`` plus each token's (start, end) character range in ``text``."""
        enc = self._encoding(text, max_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def max_text_chars_per_token(self) -> int:
        """The most characters of a text one token covers (its longest vocabulary string), or 0 when a token may
        cover any number (a model with an unknown token and no byte fallback, or a backend that shows no model)."""
        if self._max_text_chars_per_token is None:
            model = getattr(self.backend, "model", None)
            has_unknown = getattr(model, "unk_token", None) is not None
            unknown_covers_words = has_unknown and not getattr(model, "byte_fallback", False)
            if model is None or unknown_covers_words or not hasattr(self.backend, "get_vocab"):
                self._max_text_chars_per_token = 0
            else:
                self._max_text_chars_per_token = max(map(len, self.backend.get_vocab(with_added_tokens=True)))
        return self._max_text_chars_per_token

    def _encoding(self, text: str, max_tokens: int | None = None):
        # ``encode_batch`` releases the GIL while it runs (``encode`` holds it): a huge text tokenized on a
        # server's request thread does not freeze the engine thread. Its ids and offsets as Python lists do hold
        # it (4M tokens: seconds), so a text over ``max_tokens`` is refused from the encoding's length first; and
        # a text too long for any prompt of ``max_tokens`` tokens is refused before it is tokenized at all (an
        # 8 MB body: 7-10 s of a core, beside the engine's).
        if max_tokens is not None:
            per_token = self.max_text_chars_per_token()
            if per_token and len(text) > TEXT_CHARS_SLACK * max_tokens * per_token:
                raise ContextLengthError(f"the prompt has {len(text)} characters, more than a prompt of the model's "
                                         f"context of {max_tokens} tokens holds")
        enc = self.backend.encode_batch([text], add_special_tokens=False)[0]
        if max_tokens is not None and len(enc) > max_tokens:
            raise ContextLengthError(f"the prompt has {len(enc)} tokens, over the model's context of {max_tokens}")
        return enc

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None
                            ) -> str:
        """The prompt text of ``messages``. ``continue_final_message``: the text ends inside the final message
        (no end of turn after it), as transformers' ``apply_chat_template`` cuts it, so the model continues it.
        ``template_kwargs``: more variables for the template (the caller keeps the ones above out of it)."""
        if continue_final_message:
            if not messages:
                raise ValueError("continue_final_message needs a final message to continue")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        text = self._render(messages, add_generation_prompt, template_kwargs or {})
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise ValueError("continue_final_message is set but the chat template does not show the final message")
        # a template that keeps the message's spacing has the whole tag; one that trims it lost the trailing space
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()

    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (``messages``, ``add_generation_prompt``...)."""
        if self._template_variables is None:
            parsed = jinja2.Environment().parse(self.chat_template) if self.chat_template else None
            self._template_variables = frozenset(meta.find_undeclared_variables(parsed) if parsed else ())
        return self._template_variables

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if not self.chat_template:
            # No template shipped: a plain transcript, so base models still work.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            **kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    # ------------------------------------------------------------------ persistence
    def save(self, directory: Path) -> None:
        self.backend.save(str(directory / "tokenizer.json"))
        meta = {"chat_template": self.chat_template, "bos_token": self.bos_token,
                "eos_token": self.eos_token, "stop_ids": sorted(self.stop_ids)}
        (directory / "tokenizer_meta.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        meta = json.loads((directory / "tokenizer_meta.json").read_text())
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        return cls(backend, meta["chat_template"], meta["bos_token"], meta["eos_token"],
                   tuple(meta["stop_ids"]))

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer:
        path = directory / "tokenizer.json"
        if not path.exists():
            raise CorruptModelError(f"{directory}: no tokenizer.json (a fast tokenizer file is required)")
        backend = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (directory / "tokenizer_config.json").exists():
            cfg = json.loads((directory / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()

        def token_text(value: Any) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        return cls(backend, template, token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token")))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is implemented"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        try:
            backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
        except Exception as exc:  # tokenizers raises a bare Exception on an inconsistent vocab
            raise CorruptModelError(f"GGUF tokenizer vocabulary/merges are inconsistent: {exc}") from exc
        backend.pre_tokenizer = _byte_level_pre(meta.get("tokenizer.ggml.pre", "gpt2"))
        backend.decoder = decoders.ByteLevel()
        specials = [AddedToken(tokens[i], special=True, normalized=False)
                    for i, t in enumerate(types) if t in (GGUF_CONTROL, GGUF_USER_DEFINED)]
        backend.add_special_tokens(specials)

        def token_at(key: str) -> str | None:
            idx = meta.get(key)
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        return cls(backend, meta.get("tokenizer.chat_template"), token_at("tokenizer.ggml.bos_token_id"),
                   token_at("tokenizer.ggml.eos_token_id"))
