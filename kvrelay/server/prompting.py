"""Prompt ids of a request, with every returned completion it quotes spliced in as generated ids.

The chat template is the model's own. A quoted output is cut out of its message before rendering
and replaced by a private-use marker; the rendered text is tokenized piece by piece around the
markers and each marker becomes the output's generated ids (as the pipeline runner splices).

A chat prompt also says which tokens are message contents: the template's framing around them (turn
tokens, role headers) reads differently after each agent's own system prompt, so the server matches
stored runs only inside contents and computes the framing in the request's own context.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from kvrelay.errors import ContextLengthError
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.server.chat_template_params import TemplateParams
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
    # token ranges [start, end) of the messages' contents, in order; None: no message structure (a raw
    # completion prompt, or a template that does not show the contents verbatim)
    content_ranges: list[tuple[int, int]] | None = None


def _mark(content: str, registry: OutputRegistry, namespace: str, found: list[RegisteredOutput]) -> str:
    pieces, pos = [], 0
    for hit in registry.find(content, namespace):
        pieces += [content[pos : hit.start], f"{_OPEN}{len(found)}{_CLOSE}"]
        found.append(hit.output)
        pos = hit.end
    return "".join(pieces) + content[pos:]


def _tokenize_marked(tokenizer: Tokenizer, text: str, found: list[RegisteredOutput], max_tokens: int | None = None
                     ) -> tuple[PromptBuild, list[tuple[int, int]]]:
    """The prompt with each marker's output spliced in, and every token's character range in ``text``
    (a spliced token gets its marker's). Over ``max_tokens``: ContextLengthError, each piece refused from its
    encoding's length (what the prompt holds so far leaves it less) before its ids become Python objects."""
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    splices: list[Splice] = []
    pos = 0

    def encode_piece(start: int, end: int) -> None:
        allowance = None if max_tokens is None else max(max_tokens - len(ids), 0)
        try:
            piece_ids, piece_offsets = tokenizer.encode_with_offsets(text[start:end], allowance)
        except ContextLengthError:
            raise _over(max_tokens) from None
        ids.extend(piece_ids)
        offsets.extend((start + a, start + b) for a, b in piece_offsets)

    for m in _MARK_RE.finditer(text):
        if m.start() > pos:
            encode_piece(pos, m.start())
        output = found[int(m.group(1))]
        splices.append(Splice(len(ids), len(ids) + len(output.output_ids), output))
        ids += output.output_ids
        offsets += [(m.start(), m.end())] * len(output.output_ids)
        pos = m.end()
    if pos < len(text):
        encode_piece(pos, len(text))
    if max_tokens is not None and len(ids) > max_tokens:  # the spliced outputs took it over
        raise _over(max_tokens)
    return PromptBuild(ids, splices), offsets


def _over(max_tokens: int) -> ContextLengthError:
    return ContextLengthError(f"the prompt has over {max_tokens} tokens, over the model's context of {max_tokens}")


def _content_chars(text: str, contents: list[str]) -> list[tuple[int, int]] | None:
    """Character ranges of the contents in the rendered ``text``, found in order; None if one is not there
    verbatim (a template that rewrites contents beyond stripping them)."""
    ranges, cursor = [], 0
    for content in contents:
        for candidate in (content, content.strip()):
            at = text.find(candidate, cursor) if candidate else -1
            if at >= 0:
                ranges.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
        else:
            if content.strip():
                return None
    return ranges


def _content_tokens(char_ranges: list[tuple[int, int]], offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges of the tokens lying wholly inside each character range (offsets ascend)."""
    starts = [a for a, _ in offsets]
    out = []
    for a, b in char_ranges:
        first = bisect.bisect_left(starts, a)
        last = first
        while last < len(offsets) and offsets[last][1] <= b:
            last += 1
        if last > first:
            out.append((first, last))
    return out


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]], registry: OutputRegistry | None = None,
             namespace: str = "", max_tokens: int | None = None, template: TemplateParams | None = None
             ) -> PromptBuild:
    """Token ids of ``messages`` under the model's chat template (``template``: the request's template parameters,
    kvrelay.server.chat_template_params), quoted outputs spliced in (in a continued final message too), and the
    token ranges of the messages' contents. A prompt over ``max_tokens``: ContextLengthError (``Tokenizer.encode``)."""
    template = template or TemplateParams()
    found: list[RegisteredOutput] = []
    usable = registry is not None and not any(_OPEN in m["content"] or _CLOSE in m["content"] for m in messages)
    if usable:
        messages = [{**m, "content": _mark(m["content"], registry, namespace, found)} for m in messages]
    text = tokenizer.apply_chat_template(messages, template.add_generation_prompt, template.continue_final_message,
                                         template.kwargs)
    if found:
        build, offsets = _tokenize_marked(tokenizer, text, found, max_tokens)
    else:
        ids, offsets = tokenizer.encode_with_offsets(text, max_tokens)
        build = PromptBuild(ids, [])
    chars = _content_chars(text, [m["content"] for m in messages])
    build.content_ranges = None if chars is None else _content_tokens(chars, offsets)
    return build


def completion_ids(tokenizer: Tokenizer, prompt: str, registry: OutputRegistry | None = None,
                   namespace: str = "", max_tokens: int | None = None) -> PromptBuild:
    """Token ids of a raw completion prompt, quoted outputs spliced in; over ``max_tokens``: ContextLengthError."""
    found: list[RegisteredOutput] = []
    if registry is None or _OPEN in prompt or _CLOSE in prompt:
        return PromptBuild(tokenizer.encode(prompt, max_tokens), [])
    marked = _mark(prompt, registry, namespace, found)
    if found:
        return _tokenize_marked(tokenizer, marked, found, max_tokens)[0]
    return PromptBuild(tokenizer.encode(prompt, max_tokens), [])
