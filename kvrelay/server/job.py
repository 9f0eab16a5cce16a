"""One request from the queue to its last token (``Job``), and how its tokens become the events its HTTP side reads:
text held back at a possible stop string or a split character, tool-call pieces, logprobs riding on the first delta
after them, and the done event with the response's ``kvrelay`` object. The engine worker (kvrelay.server.scheduler)
drives it; this file holds no scheduling.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvrelay.engine import GenerationOutput, Sequence
from kvrelay.engine.prefill import PrefillTask
from kvrelay.model.sampling import SamplingConfig
from kvrelay.server.catalog import CallBuild
from kvrelay.server.events import DeltaEvent, DoneEvent, Event, ToolCall, delta_of, tool_call_of, tool_calls_of
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.request_ids import current_request_id
from kvrelay.server.textstream import IncrementalDecoder, StopMatcher, encode_logprobs, token_logprobs
from kvrelay.server.vllm_params import VllmSampling


@dataclass
class Job:
    """One request, from the queue to its last token."""

    build: Callable[[], tuple[PromptBuild, str]]  # prompt ids + agent name; runs on the worker (registry access)
    namespace: str
    method: str
    max_tokens: int | None
    default_max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    num_top_logprobs: int | None  # None: no logprobs
    debug: bool
    emit: Callable[[Event], None]  # thread-safe: delivers an event to the request's asyncio side
    cache_output: bool = True
    role: str = ""  # ``role_key`` of the request's system message (the agent: per-role state keys on it)
    first_token_logprobs: bool = False
    # tool calling: splits the output into content and tool-call deltas (kvrelay.server.tool_stream.ToolStream)
    tool_stream: Any = None
    # constrained decoding: ``new_mask()`` gives the call's LogitsMask (kvrelay.server.grammar.Constraint)
    constraint: Any = None
    # logit_bias and penalties (kvrelay.engine.penalties.Penalties); None: none that change anything
    penalties: Any = None
    # vLLM's parameters: top_k, min_p, stop ids, min_tokens, stop text and special tokens (kvrelay.server.vllm_params)
    vllm: VllmSampling = field(default_factory=VllmSampling)
    method_named: bool = False  # the request named its method: the guard measures it, never replaces it
    prompt_param: str = "messages"  # the request field holding the prompt, which a prompt's 400s name
    quality: Any = None  # the quality guard's tag (kvrelay.server.quality_serving.QualityTag); None: guard off
    # the HTTP request's id (kvrelay.server.request_ids), read where the job is made: the worker's lines name it
    request_id: str = field(default_factory=current_request_id)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created_s: float = field(default_factory=time.perf_counter)
    disconnect_checked_s: float = 0.0  # asyncio side: when the client's connection was last checked
    # worker state
    seq: Sequence | None = None
    built: CallBuild | None = None
    sampling: SamplingConfig | None = None  # set by ``prepare``
    task: PrefillTask | None = None  # while its prefill runs
    penalized: Any = None  # its call's PenalizedLogits (its logprobs are read before the bias), set by the worker
    num_skipped_turns: int = 0  # turns its prefill got no budget
    matcher: StopMatcher | None = None
    decoder: IncrementalDecoder | None = None
    logprobs: list[dict] = field(default_factory=list)
    num_logprobs_sent: int = 0
    # stamped by kvrelay.server.request_metrics (its clock, as ``created_s``'s): prefill start, first and latest token
    admitted_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    # ------------------------------------------------------------------ its output, as events
    def record_logprobs(self, tokenizer) -> None:
        """With logprobs asked: keep the first token's, and each later step's (its sequence's sampler wrapped)."""
        if self.num_top_logprobs is None:
            return
        if self.seq.output_ids:
            first = self.seq.first_logits
            if self.constraint is not None:  # a grammar's tokens only (kvrelay.server.grammar.GrammarMask)
                first = self.seq.options.logits_mask.mask_first(first)  # a PenalizedLogits passes it through
            self.logprobs.append(token_logprobs(first, self.seq.output_ids[0], self.num_top_logprobs, tokenizer))
        self.seq.sampler = _RecordingSampler(self.seq.sampler, self, tokenizer)

    def emit_text(self) -> None:
        """Send the text that is final so far (held back: a possible stop-string start, a split character)."""
        text = self.decoder.feed(self.seq.output_ids)
        if len(self.seq.output_ids) <= self.vllm.min_tokens:  # a stop string ending in these tokens' text is none
            self.matcher.min_end_chars = len(text)
        delta, hit = self.matcher.feed(text)
        if hit:
            self.seq.cancel()
        if delta:
            self._emit_deltas([DeltaEvent(delta)] if self.tool_stream is None
                              else [delta_of(d) for d in self.tool_stream.feed(delta)])

    def _emit_deltas(self, events: list[DeltaEvent]) -> None:
        """Send delta events; the logprobs of the tokens since the last sent ride on the first one. With tools, on
        the first that is content: tokens that wrote call markup only are left out (OpenAI's chat logprobs cover the
        content), while tokens whose text may still become content (``ToolStream.undecided``) wait."""
        at = 0
        if self.tool_stream is not None:
            at = next((i for i, e in enumerate(events) if e.tool_call is None and e.text), None)
            if at is None and not self.tool_stream.undecided:
                self._logprobs_upto()  # call markup only
        for i, event in enumerate(events):
            self.emit(replace(event, logprobs=self._logprobs_upto() if i == at else None))

    def _logprobs_upto(self) -> list[dict] | None:
        if self.num_top_logprobs is None:
            return None
        count = len(self.seq.output_ids)
        new = self.logprobs[self.num_logprobs_sent : count]
        self.num_logprobs_sent = count
        return new

    def output_text(self, out: GenerationOutput, tokenizer) -> str:
        """The answer's whole text, as vLLM's: special tokens as asked, the stop token's text (a stop_token_ids
        token's) with ``include_stop_str_in_output``, cut at a stop string."""
        ids = out.output_ids
        if self.vllm.include_stop_str_in_output and out.stop_token_id is not None:
            ids = [*ids, out.stop_token_id]
        return self.matcher.final_text(tokenizer.decode(ids, self.vllm.skip_special_tokens))

    def close_output(self, out: GenerationOutput, text: str, stop_string: bool, span_id: str | None) -> DoneEvent:
        """Send the text held back until the end (the tool stream's last pieces too); the done event, not yet sent.
        ``text``: the whole output (a stop string cut off); ``span_id``: where its KV was published, or None."""
        delta = self.matcher.flush(text)
        finish_reason = "stop" if stop_string or out.stop_reason == "stop" else "length"
        tool_calls: tuple[ToolCall, ...] = ()
        cut_call: ToolCall | None = None
        runs: tuple[tuple[int, str], ...] = ()
        if self.tool_stream is None:
            self._emit_deltas([DeltaEvent(delta)] if delta else [])
        else:
            fed = self.tool_stream.feed(delta) if delta else []
            deltas, answer = self.tool_stream.close(finish_reason)
            self._emit_deltas([delta_of(d) for d in fed + deltas])
            text, tool_calls, finish_reason = answer["text"], tool_calls_of(answer["tool_calls"]), \
                answer["finish_reason"]
            cut_call, runs = tool_call_of(answer["cut_call"]), tuple(answer["text_runs"])
        stats = out.stats
        return DoneEvent(finish_reason, text, stats.num_prompt_tokens, len(out.output_ids), stats.num_reused_tokens,
                         self._extension(out, span_id), tool_calls, cut_call, runs)

    def _extension(self, out: GenerationOutput, span_id: str | None) -> dict:
        """The response's ``kvrelay`` object: what reuse did for this request, and how long it waited."""
        stats = out.stats
        ext = {"method": stats.method, "reuse_rate": stats.reuse_rate,
               "num_reused_tokens": stats.num_reused_tokens,
               "num_computed_token_layers": stats.num_computed_token_layers,
               "num_recomputed_token_layers": stats.num_recomputed_token_layers,
               "fallback": stats.fallback, "ttft_ms": stats.ttft_ms, "num_prefill_chunks": stats.num_prefill_chunks,
               "queue_ms": (self.first_token_s - self.created_s) * 1e3 - stats.ttft_ms}
        if self.debug:
            call = self.built.call
            ext["debug"] = {"prompt_ids": call.prompt_ids, "output_ids": out.output_ids, "span_id": span_id,
                            "refs": [r.__dict__ for r in call.refs], "agent": call.name,
                            "role": call.role, "tier_decisions": [_own_decision(d) for d in
                                               self.built.tier_decisions + stats.tier_decisions]}
        if self.quality is not None:
            ext["quality"] = self.quality.public()
        if self.first_token_logprobs:
            ext["first_token_logprobs"] = encode_logprobs(out.first_logits)
        return ext


# what a request's debug object shows of a shared-tier decision: the facts of its own lookup. The tier's running
# estimates (bytes/s, latency and the estimated times built on them) average every tenant's fetches, so they are left
# out: a tenant does not watch another's traffic through them (docs/tenants.md)
_OWN_DECISION_FIELDS = ("span_id", "action", "reason", "num_tokens", "value_bytes", "fetch_ms")


def _own_decision(decision: dict) -> dict:
    return {k: decision.get(k) for k in _OWN_DECISION_FIELDS}


class _RecordingSampler:
    """Wraps a sequence's sampler to keep each step's logprobs (OpenAI ``logprobs``), one entry per output position:
    a constraint that refuses a sampled token has it sampled again in the same step
    (kvrelay.engine.constrained.sample_masked), and the new pick replaces the refused one's entry, read from the
    step's first logits (the resample's have the refused token at -inf)."""

    def __init__(self, inner, job: Job, tokenizer) -> None:
        self.inner, self.job, self.tokenizer = inner, job, tokenizer
        self._position, self._logits = -1, None  # the step being sampled and its first logits

    def __call__(self, logits: torch.Tensor) -> int:
        token_id = self.inner(logits)
        if self.job.penalized is not None:  # OpenAI's logprobs are the model's, before logit_bias and penalties
            logits = self.job.penalized.logprob_logits(logits)
        position = len(self.job.seq.output_ids)  # this step's token's index in the output
        if position == self._position:  # a resample after a refusal: the step's entry is replaced
            logits = self._logits
        else:
            self._position, self._logits = position, logits
        del self.job.logprobs[position:]
        self.job.logprobs.append(token_logprobs(logits, token_id, self.job.num_top_logprobs or 0, self.tokenizer))
        return token_id


def ids_of_text(tokenizer, output_ids: list[int], text: str) -> list[int] | None:
    """The leading output ids whose decoded text is exactly ``text`` (what a client will quote back)."""
    for k in range(len(output_ids), max(len(output_ids) - 8, 0) - 1, -1):
        if tokenizer.decode(output_ids[:k]) == text:
            return output_ids[:k]
    return None
