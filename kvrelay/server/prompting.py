"""Prompt ids of a request, with every returned completion it quotes spliced in as generated ids.

The chat template is the model's own. A quoted output is cut out of its message before rendering
and replaced by a private-use marker; the rendered text is tokenized piece by piece around the
markers and each marker becomes the output's generated ids (as the pipeline runner splices).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvrelay.model.tokenizer import Tokenizer
from kvrelay.server.registry import OutputRegistry, RegisteredOutput

_OPEN, _CLOSE = "\ue000", "\ue001"  # Unicode private use: no tokenizer or template gives them meaning
_MARK_RE = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


@dataclass(frozen=True)
class Splice:
    """Prompt tokens [start, end) are ``output``'s generated ids."""

    start: int
    end: int
    output: RegisteredOutput


@dataclass
class PromptBuild:
    ids: list[int]
    splices: list[Splice]


def _mark(content: str, registry: OutputRegistry, namespace: str, found: list[RegisteredOutput]) -> str:
    pieces, pos = [], 0
    for hit in registry.find(content, namespace):
        pieces += [content[pos : hit.start], f"{_OPEN}{len(found)}{_CLOSE}"]
        found.append(hit.output)
        pos = hit.end
    return "".join(pieces) + content[pos:]


def _tokenize_marked(tokenizer: Tokenizer, text: str, found: list[RegisteredOutput]) -> PromptBuild:
    ids: list[int] = []
    splices: list[Splice] = []
    pos = 0
    for m in _MARK_RE.finditer(text):
        ids += tokenizer.encode(text[pos : m.start()]) if m.start() > pos else []
        output = found[int(m.group(1))]
        splices.append(Splice(len(ids), len(ids) + len(output.output_ids), output))
        ids += output.output_ids
        pos = m.end()
    ids += tokenizer.encode(text[pos:]) if pos < len(text) else []
    return PromptBuild(ids, splices)


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]], registry: OutputRegistry | None = None,
             namespace: str = "") -> PromptBuild:
    """Token ids of ``messages`` under the model's chat template, quoted outputs spliced in."""
    found: list[RegisteredOutput] = []
    usable = registry is not None and not any(_OPEN in m["content"] or _CLOSE in m["content"] for m in messages)
    if usable:
        messages = [{**m, "content": _mark(m["content"], registry, namespace, found)} for m in messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not found:
        return PromptBuild(tokenizer.encode(text), [])
    return _tokenize_marked(tokenizer, text, found)


def completion_ids(tokenizer: Tokenizer, prompt: str, registry: OutputRegistry | None = None,
                   namespace: str = "") -> PromptBuild:
    """Token ids of a raw completion prompt, quoted outputs spliced in."""
    found: list[RegisteredOutput] = []
    if registry is None or _OPEN in prompt or _CLOSE in prompt:
        return PromptBuild(tokenizer.encode(prompt), [])
    marked = _mark(prompt, registry, namespace, found)
    return _tokenize_marked(tokenizer, marked, found) if found else PromptBuild(tokenizer.encode(prompt), [])
