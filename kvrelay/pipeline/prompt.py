"""Prompt assembly: render a chat template, then splice upstream outputs in as token ids.

An upstream agent's output enters a downstream prompt as the very token ids it generated (not
re-tokenized text), so its span matches the stored KV exactly; the ``full`` reference is fed the
same ids, so comparisons are fair.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from kvrelay.errors import InputError, SpliceError
from kvrelay.model.tokenizer import Tokenizer

# ⟦<nonce>:name⟧ marks where an output is spliced in: no chat template or tokenizer alters it, and
# the per-process random nonce means no user text can produce or trigger one. Text that merely
# looks like a marker (``What does ⟦x⟧ mean?``) is ordinary text, tokenized as written.
_NONCE = secrets.token_hex(8)
_MARK_RE = re.compile(f"\u27e6{_NONCE}:([^\u27e7]+)\u27e7")


def splice_marker(name: str) -> str:
    """Text to put in a message where the output ``name`` should be spliced in as token ids."""
    return f"\u27e6{_NONCE}:{name}\u27e7"


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens: text tokenized here (ref None) or an upstream output (ref = its name)."""

    start: int
    end: int
    ref: str | None


@dataclass
class PromptIds:
    ids: list[int]
    segments: list[Segment]

    def span_of(self, ref: str) -> Segment:
        for seg in self.segments:
            if seg.ref == ref:
                return seg
        raise SpliceError(f"no spliced output {ref!r} in this prompt")


def check_messages(messages: object) -> None:
    """An InputError unless ``messages`` is a list of {"role": str, "content": str} dicts (the chat template would
    otherwise fail inside jinja, or on adding None to a string)."""
    if not isinstance(messages, (list, tuple)):
        raise InputError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{type(messages).__name__}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InputError(f"messages[{k}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else f"a {type(message[key]).__name__}"
                raise InputError(f"messages[{k}][{key!r}] must be a string, got {got}")


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]],
                    splices: dict[str, list[int]] | None = None, add_generation_prompt: bool = True
                    ) -> PromptIds:
    """Token ids of ``messages`` under the chat template; each ⟦name⟧ becomes ``splices[name]``."""
    splices = splices or {}
    check_messages(messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ids: list[int] = []
    segments: list[Segment] = []
    pos = 0
    for m in _MARK_RE.finditer(text):
        name = m.group(1)
        if name not in splices:
            raise SpliceError(f"prompt refers to output {name!r}, which was not given (splices has "
                              f"{sorted(splices) or 'none'})")
        for piece, ref in ((text[pos : m.start()], None), (None, name)):
            piece_ids = tokenizer.encode(piece) if ref is None else list(splices[ref])
            if piece_ids:
                segments.append(Segment(len(ids), len(ids) + len(piece_ids), ref))
                ids.extend(piece_ids)
        pos = m.end()
    tail = tokenizer.encode(text[pos:])
    if tail:
        segments.append(Segment(len(ids), len(ids) + len(tail), None))
        ids.extend(tail)
    return PromptIds(ids, segments)
