"""The interface every reuse method implements: look at the prompt and the store, build a plan.

A plan is the spans to load into the sequence cache (re-rotated to their new positions) and the
schedule that says, per layer, which prompt tokens the forward computes. A method never touches
the forward loop (if it must, the schedule interface is wrong).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import PromptError, SpanRefError
from kvrelay.model.schedule import Schedule

if TYPE_CHECKING:
    from kvrelay.cache.kv import SequenceKV
    from kvrelay.model.lm import LoadedModel


@dataclass(frozen=True)
class SpanRef:
    """Prompt tokens [start, end) are a copy of tokens [src_start, src_start + end - start) of a stored span.

    The runner knows these (it splices upstream outputs and task inputs in as ids); the server
    finds them by matching token runs against the store.
    """

    start: int
    end: int
    span_id: str
    src_start: int
    kind: str = "output"  # "output" (an upstream agent's generated ids) or "input" (a task input)
    name: str = ""  # the placeholder it fills in the prompt template ("question", "agent1"), if known

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end or self.src_start < 0:
            raise SpanRefError(f"SpanRef of {self.span_id!r}: needs 0 <= start <= end and src_start >= 0, got "
                               f"[{self.start}, {self.end}) from {self.src_start}")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def check_ref(ref: SpanRef, prompt_ids: list[int], span_ids: tuple[int, ...] | list[int]) -> None:
    """A SpanRefError unless the stored span holds ``ref``'s source range and its tokens there are the prompt's:
    loaded anyway, another text's KV would stand in for these tokens without a word (a wrong ``src_start``), or the
    load would fail deep in the cache (a range past the span's end)."""
    src_end = ref.src_start + ref.num_tokens
    if src_end > len(span_ids):
        raise SpanRefError(f"SpanRef of {ref.span_id!r} asks for its tokens [{ref.src_start}, {src_end}) (for prompt "
                           f"tokens [{ref.start}, {ref.end})), past the span's {len(span_ids)} tokens")
    got = span_ids[ref.src_start : src_end]
    want = prompt_ids[ref.start : ref.end]
    if tuple(got) != tuple(want):
        k = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        raise SpanRefError(
            f"SpanRef of {ref.span_id!r}: its tokens [{ref.src_start}, {src_end}) (of {len(span_ids)}) are not prompt "
            f"tokens [{ref.start}, {ref.end}): they differ first at prompt token {ref.start + k} (span has "
            f"{got[k]}, prompt {want[k]}); src_start is where the copy starts in the span (an upstream output's: "
            f"the length of that call's prompt)")


_TOKENIZE_HINT = "tokenize text first: lm.tokenizer.encode(text), or chat_prompt_ids(lm.tokenizer, messages).ids"


def prompt_id_list(prompt: object) -> list[int]:
    """``prompt`` as a list of int token ids (the same list when it is one already), or a PromptError: text, bytes,
    floats and bools would otherwise run as something else or fail deep inside the model."""
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    if prompt is None or isinstance(prompt, (str, bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise PromptError(f"prompt must be a list of int token ids, got {type(prompt).__name__} ({_TOKENIZE_HINT})")
    ids = []
    for k, token in enumerate(prompt):
        try:  # numpy ints and 0-d integer tensors are ints by ``__index__``; floats and strings are not
            if isinstance(token, bool):
                raise TypeError
            ids.append(token.__index__())
        except (TypeError, AttributeError):
            raise PromptError(f"prompt must be a list of int token ids; item {k} is {token!r} "
                              f"({type(token).__name__}) ({_TOKENIZE_HINT})") from None
    return ids


def role_key(system_prompt: str) -> str:
    """The key of an agent's role: a digest of its system prompt's text ("" without one). A pipeline's agent and a
    server request with the same system message get the same key (the server's quality guard keeps its records per
    role)."""
    return hashlib.sha256(system_prompt.encode()).hexdigest()[:16] if system_prompt else ""


@dataclass
class CallInput:
    """What a method sees of one agent call: the prompt ids and the known copies in it."""

    prompt_ids: list[int]
    refs: list[SpanRef] = field(default_factory=list)
    name: str = ""
    role: str = ""  # ``role_key`` of the agent's system prompt ("": unknown)

    def __post_init__(self) -> None:
        self.prompt_ids = prompt_id_list(self.prompt_ids)
        # a ref past the prompt would otherwise be planned as loads the prompt has no room for, or dropped silently
        outside = [ref for ref in self.refs if ref.end > len(self.prompt_ids)]
        if outside:
            ref = outside[0]
            raise SpanRefError(f"SpanRef of {ref.span_id!r} covers prompt tokens [{ref.start}, {ref.end}), past the "
                               f"prompt's {len(self.prompt_ids)} tokens")


@dataclass(frozen=True)
class SpanLoad:
    """Copy tokens [src_start, src_end) of a stored span to prompt positions from dst_start."""

    span_id: str
    src_start: int
    src_end: int
    dst_start: int

    @property
    def num_tokens(self) -> int:
        return self.src_end - self.src_start


@dataclass
class KVPatch:
    """K/V a method writes into the sequence cache after the loads: ``add`` offsets to loaded rows,
    or set rows that no stored span holds (KVCOMM's template segments). Both at prompt positions
    [dst_start, dst_start + n), keys rotated for those positions, or (``keys_without_rope``) without RoPE: the cache
    then rotates them as it writes them (one pass over the rows instead of a rotated copy and an add)."""

    dst_start: int
    k: torch.Tensor  # [num_layers, num_kv_heads, n, head_dim], post-RoPE unless keys_without_rope
    v: torch.Tensor  # [num_layers, num_kv_heads, n, head_dim]
    add: bool
    keys_without_rope: bool = False

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]


@dataclass
class Plan:
    schedule: Schedule
    loads: list[SpanLoad] = field(default_factory=list)
    patches: list[KVPatch] = field(default_factory=list)
    fallback: str | None = None  # why the method fell back to a full prefill, if it did
    note: str | None = None  # anything else the stats should say (e.g. tokens recomputed from layer 0)
    state: object = None  # the method's own record of this plan, handed back to ``observe``
    # the sequence cache to run on, given its capacity in positions (None: a fresh SequenceKV); a cache
    # that already holds positions counts them in ``num_preloaded``
    make_cache: Callable[[int], SequenceKV] | None = None
    num_preloaded: int = 0

    @property
    def num_reused_tokens(self) -> int:
        return (sum(load.num_tokens for load in self.loads) + sum(p.num_tokens for p in self.patches if not p.add)
                + self.num_preloaded)


class ReuseMethod(ABC):
    name: ClassVar[str]
    stateful: ClassVar[bool] = False  # learns across calls in ``observe`` (the bench can warm it up first)

    def capture_layers(self, lm: LoadedModel) -> tuple[int, ...]:
        """Layers whose input hidden states upstream calls must carry for this method."""
        return ()

    def settings(self, lm: LoadedModel) -> dict:
        """What this method resolved for ``lm`` beyond its spec (e.g. relay's layers and selector from the model's
        profile), for a bench's JSON to record; empty when the spec says it all."""
        return {}

    @abstractmethod
    def plan(self, call: CallInput, store: KVStore | None, lm: LoadedModel) -> Plan:
        """Decide what to reuse for this call; must leave the last prompt token active."""

    def observe(self, call: CallInput, plan: Plan, cache: SequenceKV, store: KVStore | None,
                lm: LoadedModel) -> None:
        """Learn from a finished prefill of ``plan`` (``cache`` holds every prompt token's K/V).

        Called after the first token, outside TTFT. Stateless methods ignore it; KVCOMM adds anchors.
        """
        return None

    def dense_plan(self, call: CallInput) -> Plan | None:
        """The plan of a dense prefill of ``call`` as this method would have made it, for ``observe`` to learn from
        a dense prefill someone else ran (the quality guard's shadow ``full`` reference, whose cache equals a dense
        prefill's): None when the method learns nothing from a dense prefill (every stateless method)."""
        return None
