"""Streaming text out of token ids: stop strings, held-back partial text, per-token logprobs."""

from __future__ import annotations

import base64

import numpy as np
import torch

_REPLACEMENT = "\ufffd"  # what a decoder shows for a character whose bytes are not all generated yet


class IncrementalDecoder:
    """The output's text, decoding only the tokens since the last complete character each step
    (decoding the whole output every step would cost O(n) per token)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to the end of ``text``
        self.read_offset = 0
        self.text = ""

    def feed(self, ids: list[int]) -> str:
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new = self.tokenizer.decode(ids[self.prefix_offset :], self.skip_special_tokens)
        if len(new) > len(prefix) and not new.endswith(_REPLACEMENT):  # a split character waits for its bytes
            self.text += new[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text


class StopMatcher:
    """Cuts the output at the first stop string and says which text is safe to send so far.

    As vLLM's: with ``include_in_output`` the stop string stays in the text (cut after it); a stop string counts
    only where it ends past ``min_end_chars`` (the text of the first ``min_tokens`` tokens, which the job raises
    until that many tokens were generated)."""

    def __init__(self, stops: list[str], include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self.min_end_chars = 0
        self.num_sent_chars = 0
        self.hit = False
        self._cut = 0

    def _first_stop(self, text: str, start: int) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string in ``text`` from ``start`` that ends past ``min_end_chars``."""
        found = []
        for stop in self.stops:
            i = text.find(stop, max(start, self.min_end_chars - len(stop) + 1))
            if i >= 0:
                found.append((i, i + len(stop)))
        return min(found) if found else None

    def feed(self, text: str) -> tuple[str, bool]:
        """The new text to send, given the whole decoded output so far; True once a stop string matched."""
        if self.hit:
            return "", True
        start = max(0, self.num_sent_chars - max((len(s) for s in self.stops), default=0))
        found = self._first_stop(text, start)
        if found:
            self.hit, self._cut = True, found[1] if self.include_in_output else found[0]
            delta = text[self.num_sent_chars : self._cut]
            self.num_sent_chars = max(self.num_sent_chars, self._cut)
            return delta, True
        safe = len(text)
        while safe > self.num_sent_chars and text[safe - 1] == _REPLACEMENT:
            safe -= 1
        safe -= self._held_back(text[:safe])
        delta = text[self.num_sent_chars : safe] if safe > self.num_sent_chars else ""
        self.num_sent_chars = max(self.num_sent_chars, safe)
        return delta, False

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could be the start of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def final_text(self, text: str) -> str:
        return text[: self._cut] if self.hit else text

    def flush(self, final_text: str) -> str:
        """Whatever of the final text was not sent yet."""
        delta = final_text[self.num_sent_chars :]
        self.num_sent_chars = len(final_text)
        return delta


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "id": token_id}


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int, tokenizer) -> dict:
    """OpenAI's logprobs entry of one token: its log-probability and the ``num_top`` most likely."""
    logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
    entry = _entry(tokenizer, token_id, float(logprobs[token_id]))
    top = torch.topk(logprobs, num_top) if num_top > 0 else None
    # a token a grammar masked out (-inf) is no alternative, and JSON has no -inf: fewer are listed then
    entry["top_logprobs"] = [] if top is None else [
        _entry(tokenizer, int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        if v > float("-inf")]
    return entry


def encode_logprobs(logits: torch.Tensor) -> str:
    """The whole next-token distribution as log-probabilities: base64 of little-endian float32 [vocab]."""
    logprobs = torch.log_softmax(logits.float().cpu(), dim=-1).numpy().astype("<f4")
    return base64.b64encode(logprobs.tobytes()).decode("ascii")


def decode_logprobs(text: str) -> torch.Tensor:
    """``encode_logprobs``' inverse: float32 [vocab] (what a client reads back)."""
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").copy())
