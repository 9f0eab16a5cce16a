"""Constrained decoding with xgrammar: the grammar a request's tools or response_format ask for, compiled once
per request, and a per-call ``GrammarMask`` the engine applies before each sample (``GenerateOptions.logits_mask``).

xgrammar is the library because, on our tokenizers on CPU (benchmarks/grammar_mask.py,
benchmarks/results/grammar-mask-cpu.json), its mask and advance cost a quarter (SmolLM2) to 40% (Gemma) of
llguidance's per decode step, and outlines-core, cheaper per step, indexes each schema's regex over the whole
vocabulary at compile time (0.2 s on SmolLM2's, 4.4 s on Gemma's, per request, against xgrammar's 12 and 138 ms)
and cannot say "free text until ``<tool_call>``", which xgrammar's structural tags say directly.

The grammars (the call format is kvrelay.server.tools'):

- ``tool_choice`` "required": one or more calls (one unless ``parallel_tool_calls``), separated by a newline,
  and nothing else; a named tool: exactly one call of it;
- "auto": free text, and from ``<tool_call>`` on a call of a known tool whose arguments follow its schema;
- "none": free text that never contains ``<tool_call`` (nor so ``<tool_call>``, nor a lookalike such as
  ``<tool_call name=...>``; the tools are in the prompt, so a model may try to call
  one: the grammar makes it write something else). A server without xgrammar decodes "none" unconstrained rather
  than refuse it: it is a text answer, which needs no grammar library, and the answer still holds no tool call
  (kvrelay.server.tool_stream.ToolStream reads none under "none"), though its text may then hold the opener;
- ``response_format`` json_object / json_schema: one JSON value of the schema; with "auto" tools, either
  calls or that JSON value (an agent with tools and a typed final answer); with "none", that JSON value only;
  with "required" or a named tool the turn is calls only, so the format does not apply to it.

Each call's ``{"name": ..., "arguments": `` prefix is forced text and its arguments follow the tool's schema. A
stop token is allowed only where the grammar may end, so a forced call cannot stop half-way; max_tokens or a stop
string (matched on the text, whatever the grammar) can still cut it (kvrelay.server.tool_stream.ToolStream says how the
answer reports a cut call). Special tokens other than the stop
tokens, and tokens holding a control character other than tab and newlines, are never allowed while a grammar
runs (xgrammar reads special tokens as plain text, and lets control-character byte tokens into JSON strings).
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import torch

try:  # the ``tools`` extra (see pyproject.toml): without it, requests that need a grammar are refused
    import xgrammar as xgr
except ImportError:
    xgr = None

from kvrelay.engine.constrained import TokenRefused
from kvrelay.server.protocol import ApiError
from kvrelay.server.schemas import check_schema
from kvrelay.server.tool_protocol import ResponseFormat
from kvrelay.server.tools import CALL_CLOSE, CALL_OPEN, CALL_SEP, ToolPlan, call_prefix

# control characters JSON forbids unescaped: xgrammar lets their byte tokens into JSON strings on our vocabularies
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")
MAX_JSON_WHITESPACE = 1  # consecutive whitespace characters inside JSON: a small model otherwise may pad forever


def check_response_format(fmt: ResponseFormat | None) -> dict | None:
    """The JSON schema ``fmt`` asks the output to follow (``{"type": "object"}`` for json_object and for a
    json_schema without ``schema``), None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise ApiError(400, "response_format of type json_schema needs json_schema",
                       param="response_format.json_schema", code="invalid_value")
    # OpenAI types ``schema`` optional: without it, a JSON object as json_object (the tool prompt's answer schema,
    # kvrelay.server.tools.answer_schema, says the same)
    if fmt.json_schema.schema_ is None:
        return {"type": "object"}
    check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema", strict=bool(fmt.json_schema.strict))
    return fmt.json_schema.schema_


class _Vocabulary:
    """xgrammar's view of one tokenizer and the tokens a grammar never allows (shared by all requests)."""

    def __init__(self, tokenizer) -> None:
        size = tokenizer.vocab_size
        pieces = [tokenizer.backend.id_to_token(i) or "" for i in range(size)]
        byte_fallback = any(p == "<0x41>" for p in pieces)  # SentencePiece-style vocabularies (Gemma)
        kind = xgr.VocabType.BYTE_FALLBACK if byte_fallback else xgr.VocabType.BYTE_LEVEL
        stops = sorted(tokenizer.stop_ids)
        info = xgr.TokenizerInfo(pieces, kind, vocab_size=size, stop_token_ids=stops)
        # no cache of the library's: it is shared by every tenant and unbounded (kvrelay.server.grammar_cache)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.size = size
        special = set(tokenizer.backend.get_added_tokens_decoder()) - set(stops)
        keep = np.ones(size, dtype=bool)
        keep[[i for i in special if i < size]] = False
        keep[[i for i in range(size) if _CONTROL.search(tokenizer.decode([i], skip_special_tokens=False))]] = False
        # the same packing as xgrammar's bitmask (bit i of word i // 32): AND-ed into every mask
        self.keep_words = torch.from_numpy(np.packbits(np.pad(keep, (0, -size % 32)), bitorder="little")
                                           .view(np.int32).copy())


_VOCABULARIES: dict[int, _Vocabulary] = {}
_LOCK = threading.Lock()


def vocabulary(tokenizer) -> _Vocabulary:
    with _LOCK:
        vocab = _VOCABULARIES.get(id(tokenizer))
        if vocab is None:
            vocab = _VOCABULARIES[id(tokenizer)] = _Vocabulary(tokenizer)
        return vocab


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor, size: int) -> torch.Tensor:
    """A copy of ``logits`` ([vocab]) with the tokens whose bit is 0 in ``words`` (int32 [ceil(vocab/32)], bit i
    of word i // 32) at -inf. torch.where over the unpacked bits: 2-4x faster on CPU than xgrammar's own apply
    kernel (benchmarks/grammar_mask.py)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:size].view(np.bool_)
    allowed = torch.from_numpy(bits).to(logits.device)
    return torch.where(allowed[: logits.shape[-1]], logits, float("-inf"))


class GrammarMask:
    """One call's grammar state (``kvrelay.engine.sequence.LogitsMask``)."""

    def __init__(self, compiled, vocab: _Vocabulary) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab = vocab
        self.words = xgr.allocate_token_bitmask(1, vocab.size)[0]
        self.first_words: torch.Tensor | None = None  # the first step's mask (the first token's logprobs)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.words.unsqueeze(0))
        self.words &= self.vocab.keep_words
        if self.first_words is None:
            self.first_words = self.words.clone()
        return apply_bitmask(logits, self.words, self.vocab.size)

    def mask_first(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([vocab], the first token's) as the first step's mask left them: the first token is sampled
        inside the engine's prefill, before the server sees its logits, which are the unmasked ones."""
        return logits if self.first_words is None else apply_bitmask(logits, self.first_words, self.vocab.size)

    @property
    def ended(self) -> bool:
        """The grammar took its end (a stop token): nothing may follow, whatever ``ignore_eos`` says."""
        return self.matcher.is_terminated()

    def advance(self, token_id: int) -> None:
        """Take ``token_id``; ``TokenRefused`` (the matcher's state unchanged) when xgrammar's matcher refuses a
        token its own bitmask allowed: the engine then samples another, so the request goes on."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            raise TokenRefused(f"the grammar refused token {token_id} its own mask allowed")


class Constraint:
    """A request's compiled grammar; ``new_mask()`` per call (the worker makes one when the call starts)."""

    def __init__(self, compiled, vocab: _Vocabulary) -> None:
        self.compiled, self.vocab = compiled, vocab

    def new_mask(self) -> GrammarMask:
        return GrammarMask(self.compiled, self.vocab)


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _calls_format(plan: ToolPlan) -> dict:
    """One or more calls (one unless parallel), separated by a newline, and nothing else."""
    tags = [{"type": "tag", "begin": call_prefix(name), "content": json_format(plan.schema_of(name)),
             "end": "}" + CALL_CLOSE} for name in plan.callable_names]
    return {"type": "tags_with_separator", "tags": tags, "separator": CALL_SEP, "at_least_one": True,
            "stop_after_first": not plan.parallel}


def tool_format(plan: ToolPlan, schema: dict | None) -> dict:
    if not plan.may_call:  # "none": JSON of the format, or text that never opens a call
        return json_format(schema) if schema is not None else {"type": "any_text", "excludes": [CALL_OPEN[:-1]]}
    calls = _calls_format(plan)
    if plan.mode != "auto":
        return calls
    if schema is not None:  # the answer is JSON of the schema, unless the model calls a tool instead
        return {"type": "or", "elements": [calls, json_format(schema)]}
    return {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": calls["tags"], "at_least_one": False,
            "stop_after_first": not plan.parallel}


# xgrammar's messages start with its log prefix: "[06:40:17] /path/json_schema_converter.cc:5082: "
_LOG_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")


def library_reason(exc: Exception) -> str:
    """The grammar library's reason, without its log line's time, source file and line."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def constraint_for(plan: ToolPlan | None, fmt: ResponseFormat | None, tokenizer) -> Constraint | None:
    """The request's compiled grammar, or None when its output is free text; a 400 when the library cannot
    compile a schema (naming the field)."""
    schema = check_response_format(fmt)
    if plan is None and schema is None:
        return None
    param = "tools" if plan is not None and plan.may_call else "response_format"
    if xgr is None and schema is None and not plan.may_call:  # "none": unconstrained text (see the docstring)
        return None
    if xgr is None:
        raise ApiError(400, f"{param} needs constrained decoding, and this server has no grammar library: install "
                            "it with pip install 'kvrelay[tools]' (xgrammar)", param=param, code="unsupported")
    vocab = vocabulary(tokenizer)
    spec = {"type": "structural_tag",
            "format": tool_format(plan, schema) if plan is not None else json_format(schema)}
    try:
        compiled = vocab.compiler.compile_structural_tag(json.dumps(spec))
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for schemas it cannot take
        raise ApiError(400, f"{param}: this JSON schema cannot be used for constrained decoding: "
                            f"{library_reason(exc)}", param=param, code="invalid_value") from exc
    return Constraint(compiled, vocab)
