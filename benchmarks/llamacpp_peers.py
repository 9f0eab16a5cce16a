"""llama.cpp (through llama-cpp-python) on given token ids: full prefill, and its own two ways to reuse KV.

- ``full``: the prompt evaluated from an empty cache, then the first token (argmax of the last logits).
- ``prefix``: the server's slot save/restore (``llama_state_seq_get/set_data``, one sequence's KV): the
  saved call whose tokens share the longest prefix with the prompt is restored, the cells past that
  prefix are dropped and the rest is evaluated.
- ``cache_reuse``: the server's ``--cache-reuse N`` (llama.cpp ``tools/server``): after the common
  prefix, chunks of at least N cached tokens that appear in the prompt in the same order are moved
  to their new positions (``llama_memory_seq_rm`` + ``llama_memory_seq_add``: RoPE shift, no repair
  of the context they saw); evaluation resumes where the first unmatched prompt token is.
Each TTFT includes restoring the saved KV (``restore_ms`` is that part alone: a server slot that still
holds the KV skips it).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class SavedSeq:
    token_ids: list[int]
    data: ctypes.Array  # llama_state_seq_get_data of sequence 0


@dataclass
class PeerTiming:
    ttft_ms: float
    restore_ms: float
    num_reused_tokens: int
    first_token: int


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cache_reuse_moves(cached: list[int], prompt: list[int], min_chunk: int) -> tuple[int, list[tuple[int, int, int]]]:
    """The server's cache_reuse scan: (tokens reused, [(head_p, head_c, num_matched)] moves to apply)."""
    head_p = head_c = common_prefix_len(cached, prompt)
    moves = []
    while head_c < len(cached) and head_p < len(prompt):
        n = 0
        while head_c + n < len(cached) and head_p + n < len(prompt) and cached[head_c + n] == prompt[head_p + n]:
            n += 1
        if n >= min_chunk:
            moves.append((head_p, head_c, n))
            head_c += n
            head_p += n
        else:
            head_c += 1
    return head_p, moves


class LlamaCpp:
    """One GGUF file in llama.cpp with one sequence (a server slot), ``num_threads`` for prompt and decode."""

    def __init__(self, path: Path, num_ctx_tokens: int, num_threads: int, flash_attn: bool) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.path = path
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=num_ctx_tokens, n_threads=num_threads,
                                   n_threads_batch=num_threads, flash_attn=flash_attn, verbose=False)
        self.ctx = self.llm._ctx.ctx
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.num_vocab = self.llm.n_vocab()

    def last_logits(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.num_vocab,))

    def _eval_from(self, num_kept: int, token_ids: list[int]) -> int:
        """Evaluate ``token_ids`` after ``num_kept`` cached ones (Llama.eval drops every cell past them)."""
        self.llm.n_tokens = num_kept
        self.llm.eval(token_ids)
        return int(np.argmax(self.last_logits()))

    def full(self, prompt_ids: list[int]) -> PeerTiming:
        t0 = time.perf_counter()
        token = self._eval_from(0, prompt_ids)
        return PeerTiming((time.perf_counter() - t0) * 1e3, 0.0, 0, token)

    def greedy(self, prompt_ids: list[int], num_tokens: int) -> tuple[np.ndarray, list[int]]:
        """First-token logits (a copy) and ``num_tokens`` greedy tokens."""
        out = [self._eval_from(0, prompt_ids)]
        first = self.last_logits().copy()
        while len(out) < num_tokens:
            out.append(self._eval_from(len(prompt_ids) + len(out) - 1, [out[-1]]))
        return first, out

    def save(self, token_ids: list[int]) -> SavedSeq:
        """Evaluate ``token_ids`` (untimed) and keep sequence 0's KV, as a server slot that served them."""
        self._eval_from(0, token_ids)
        size = self.lib.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        if self.lib.llama_state_seq_get_data(self.ctx, buf, size, 0) != size:
            raise RuntimeError(f"{self.path.name}: llama_state_seq_get_data copied a different size than announced")
        return SavedSeq(list(token_ids), buf)

    def _restore(self, saved: SavedSeq) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        if self.lib.llama_state_seq_set_data(self.ctx, saved.data, len(saved.data), 0) == 0:
            raise RuntimeError(f"{self.path.name}: llama_state_seq_set_data failed")

    def prefix(self, prompt_ids: list[int], saved: list[SavedSeq]) -> PeerTiming:
        """Restore the saved call with the longest common token prefix, evaluate the rest."""
        best = max(saved, key=lambda s: common_prefix_len(s.token_ids, prompt_ids), default=None)
        n = 0 if best is None else min(common_prefix_len(best.token_ids, prompt_ids), len(prompt_ids) - 1)
        if n == 0:
            return self.full(prompt_ids)
        t0 = time.perf_counter()
        self._restore(best)
        restore_ms = (time.perf_counter() - t0) * 1e3
        token = self._eval_from(n, prompt_ids[n:])
        return PeerTiming((time.perf_counter() - t0) * 1e3, restore_ms, n, token)

    def cache_reuse(self, prompt_ids: list[int], saved: list[SavedSeq], min_chunk: int) -> PeerTiming:
        """Restore the saved call the server's scan reuses most from, move its chunks, evaluate the rest."""
        scans = [(cache_reuse_moves(s.token_ids, prompt_ids, min_chunk), s) for s in saved]
        best = max(scans, key=lambda x: x[0][0], default=None)
        if best is None or best[0][0] == 0:
            return self.full(prompt_ids)
        (n, moves), seq = best
        n = min(n, len(prompt_ids) - 1)  # the last prompt token is evaluated: its logits are the point
        t0 = time.perf_counter()
        self._restore(seq)
        restore_ms = (time.perf_counter() - t0) * 1e3
        for head_p, head_c, num in moves:
            self.lib.llama_memory_seq_rm(self.mem, 0, head_p, head_c)
            self.lib.llama_memory_seq_add(self.mem, 0, head_c, head_c + num, head_p - head_c)
        token = self._eval_from(n, prompt_ids[n:])
        return PeerTiming((time.perf_counter() - t0) * 1e3, restore_ms, n, token)
