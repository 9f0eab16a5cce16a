"""vLLM's extra request parameters (what clients send through the openai client's ``extra_body``): which ones
``kvrelay serve`` serves with vLLM's semantics, and which it refuses by name.

A parameter vLLM honours and this server dropped would give a different answer than asked for, with no error. So
each is either served as vLLM serves it (``SERVED``; sampling in ``kvrelay.model.sampling``, logit adjustments in
``kvrelay.engine.penalties``, stopping in the engine and ``kvrelay.server.textstream``), refused with a 400
(``code: "unsupported"``, ``param`` naming it) unless it holds its no-op value (``REFUSED``: clients send the
defaults), or accepted because it cannot change the answer here (``NO_OPS``). ``vllm_sampling(body, ...)`` checks a
request's and returns what the engine and the text stream need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.server.protocol import ApiError

#: served with vLLM's semantics: name -> what it does
SERVED: dict[str, str] = {
    "top_k": "sample among the k most likely tokens (ties with the k-th kept); 0 or -1: off",
    "min_p": "drop tokens whose probability is below min_p x the top token's, in [0, 1]; 0: off",
    "repetition_penalty": "a token seen in the prompt or the output: positive logit divided by it, negative one "
                          "multiplied (> 0; 1: off); applies to greedy too",
    "min_tokens": "the end-of-sequence ids and stop_token_ids cannot be sampled before this many tokens; stop "
                  "strings count only where they end after them",
    "stop_token_ids": "token ids that end the answer (finish_reason \"stop\"), ids in the vocabulary",
    "ignore_eos": "the end-of-sequence ids do not end the answer (max_tokens or a stop does)",
    "include_stop_str_in_output": "the matched stop string (or a stop_token_ids token's text) stays in the text",
    "skip_special_tokens": "false: special tokens' text (e.g. <|im_end|>) stays in the answer",
    "spaces_between_special_tokens": "true (vLLM's default) is what this tokenizer's decoding gives; false with "
                                     "skip_special_tokens false is refused",
}


@dataclass(frozen=True)
class Refused:
    name: str
    is_no_op: Callable[[Any], bool]  # the value (None when absent) leaves the answer as without it
    why: str  # what it would do, and why it is not served


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {} or value == ""


#: refused unless their no-op value: name, no-op test, what it does
REFUSED: tuple[Refused, ...] = (
    Refused("use_beam_search", _off, "beam search: this server samples one sequence"),
    Refused("length_penalty", lambda v: v is None or v == 1, "beam search's length penalty"),
    Refused("watermarking", _off, "a watermark in the sampled tokens"),
    Refused("truncate_prompt_tokens", lambda v: v is None, "truncating the prompt: a prompt over the context is a "
            "400 (context_length_exceeded) here"),
    Refused("prompt_logprobs", lambda v: v is None, "the prompt's log-probabilities"),
    Refused("logprob_token_ids", _off, "log-probabilities of chosen token ids"),
    Refused("allowed_token_ids", lambda v: v is None, "sampling among given token ids only; logit_bias -100 bans "
            "tokens here"),
    Refused("bad_words", _off, "banned words"),
    Refused("thinking_token_budget", lambda v: v is None, "a reasoning budget: no reasoning parser here"),
    Refused("vllm_xargs", _off, "arguments of vLLM's custom extensions"),
    Refused("kv_transfer_params", _off, "vLLM's disaggregated KV transfer"),
    Refused("ec_transfer_params", _off, "vLLM's encoder-cache transfer"),
    Refused("repetition_detection", lambda v: v is None, "ending the answer at a repeated n-gram"),
    Refused("documents", _off, "RAG documents for the chat template"),
    Refused("chat_template", _off, "a request's own chat template: the model's is used"),
    Refused("mm_processor_kwargs", _off, "multimodal processing: this server takes text"),
    Refused("media_io_kwargs", _off, "multimodal inputs: this server takes text"),
    Refused("prompt_embeds", lambda v: v is None, "prompt embeddings: send text or token ids"),
    Refused("priority", lambda v: v is None or v == 0, "priority scheduling (vLLM's default first-come scheduler "
            "refuses it too): requests are admitted first come, first served"),
    Refused("return_token_ids", _off, "token ids in the response; kvrelay.debug returns the prompt and output ids"),
    Refused("return_tokens_as_token_ids", _off, "logprob tokens written as token_id:<id>"),
    Refused("return_prompt_text", _off, "the rendered prompt in the response"),
)

#: accepted and ignored: they cannot change the answer here
NO_OPS: dict[str, str] = {
    "request_id": "the response id is the server's own (the x-request-id header names the request in its logs)",
    "session_id": "no session routing: one engine",
    "stream_interval": "tokens per streamed chunk: every chunk is sent as soon as its text is final",
    "truncation_side": "only with truncate_prompt_tokens (refused)",
    "include_reasoning": "no reasoning parser: the answer has no separate reasoning",
    "routed_experts_prompt_start": "no mixture-of-experts data is returned",
    "return_token_offsets": "render endpoints only in vLLM",
    "mm_payload": "render endpoints only in vLLM",
    "return_mm_kwargs": "render endpoints only in vLLM",
}


@dataclass(frozen=True)
class VllmSampling:
    """What a request's vLLM parameters ask of the engine and the text stream (vLLM's defaults: nothing)."""

    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_ids: frozenset[int] | None = None  # the ids that end the answer; None: the tokenizer's (its EOS ids)
    min_tokens_stop_ids: tuple[int, ...] = ()  # held back until min_tokens: EOS ids and stop_token_ids
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def _unsupported(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="unsupported")


def _invalid(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="invalid_value")


def adds_special_tokens(tokenizer) -> bool:
    """Whether the tokenizer's own encoding adds tokens (a BOS) around a text: what add_special_tokens asks."""
    backend = tokenizer.backend
    return backend.encode("a", add_special_tokens=True).ids != backend.encode("a", add_special_tokens=False).ids


def check_refused(body, tokenizer) -> None:
    """A 400 naming the first vLLM parameter set to a value this server would not honour."""
    for refused in REFUSED:
        value = getattr(body, refused.name, None)
        if not refused.is_no_op(value):
            raise _unsupported(refused.name, f"{refused.name} is not supported ({refused.why}); omit it or send "
                               "its default")
    if getattr(body, "add_special_tokens", None) and adds_special_tokens(tokenizer):
        raise _unsupported("add_special_tokens", "add_special_tokens: true is not supported with this model: its "
                           "tokenizer would add tokens the prompt here does not hold; omit it or send false")
    if getattr(body, "skip_special_tokens", None) is False and getattr(body, "spaces_between_special_tokens",
                                                                       None) is False:
        raise _unsupported("spaces_between_special_tokens", "spaces_between_special_tokens: false is not supported "
                           "with skip_special_tokens: false; omit it")


def vllm_sampling(body, tokenizer, vocab_size: int, max_tokens: int | None) -> VllmSampling:
    """``body``'s vLLM parameters checked (a 400 naming the first bad or refused one) and resolved; ``max_tokens``:
    the request's own limit (None: the server's default), which ``min_tokens`` may not exceed (vLLM's check)."""
    check_refused(body, tokenizer)
    stop_token_ids = list(dict.fromkeys(body.stop_token_ids or []))
    for i, token_id in enumerate(stop_token_ids):
        if not 0 <= token_id < vocab_size:
            raise _invalid(f"stop_token_ids.{i}", f"stop_token_ids holds {token_id}, not a token id in "
                           f"[0, {vocab_size})")
    min_tokens = body.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _invalid("min_tokens", f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
    eos_ids = tuple(sorted(tokenizer.stop_ids))
    stop_ids = None
    if body.ignore_eos or stop_token_ids:
        stop_ids = frozenset(stop_token_ids) | (frozenset() if body.ignore_eos else frozenset(eos_ids))
    return VllmSampling(  # greedy ignores top_k and min_p (kvrelay.model.sampling), as vLLM resets them
        top_k=0 if body.top_k in (None, -1) else body.top_k, min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=min_tokens, stop_ids=stop_ids,
        min_tokens_stop_ids=tuple(sorted(set(eos_ids) | set(stop_token_ids))) if min_tokens else (),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False)
