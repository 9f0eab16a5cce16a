"""RKSC's approximate ASKS: reuse a branch's decode KV in its verification when the contexts agree.

A verifier prompt is ``root | "Proposed solution:" | branch output | question``; the branch built
the output's K/V while decoding it after ``root | hint | assistant header``. The prefixes before
the output differ, so reusing that K/V is approximate. The gate compares the residual stream
entering the span in both contexts: the hidden state of the token just before the output, at
every layer (the branch recorded it in its prefill; the verifier computes its own prefix first).
When their cosine, averaged over layers, is >= ``tau`` the output's K/V is copied in (keys
re-rotated to the new positions) and only the prefix and the question are computed; otherwise the
output is computed too. Opt-in (``rksc[asks_approx=true]``) and measured against the untimed
full-depth reference, because nothing bounds the error of the reused K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.branches.shared_kv import SharedPrefixKV
from kvrelay.cache.kv import SequenceKV
from kvrelay.model.lm import LoadedModel
from kvrelay.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class BranchSpan:
    """Where a branch's output K/V lives: ``cache`` positions [start, start + num_tokens), and the
    hidden states ([num_layers, hidden]) of the last prompt token, the one right before the output."""

    cache: SequenceKV
    start: int
    num_tokens: int
    boundary_hidden: torch.Tensor


@dataclass
class AsksVerify:
    logits: torch.Tensor  # [vocab] at the verifier prompt's last token
    exit_layer: int | None
    computed_tokens: int  # prompt tokens computed (token-layers / layers, over both chunks)
    cosine: float  # mean over layers of the boundary hidden states' cosine
    num_reused_tokens: int  # output tokens whose K/V came from the branch (0: gate closed)
    cache: SequenceKV


def layer_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over layers of cos(a[l], b[l]); a, b: [num_layers, hidden]."""
    if a.shape != b.shape:
        raise ValueError(f"hidden states of different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())


def copy_span(src: SequenceKV, src_start: int, dst: SequenceKV, dst_start: int, num_tokens: int,
              rope: RotaryEmbedding) -> None:
    """K/V of ``src`` positions [src_start, +num_tokens) into ``dst`` at ``dst_start``, keys re-rotated
    by the position change (values carry no position)."""
    delta = dst_start - src_start
    dst.ensure_capacity(dst_start + num_tokens)
    for layer in range(src.num_layers):
        k, v = src.kv(layer, src_start, src_start + num_tokens)  # [Hkv, num_tokens, hd] each
        dst.write_range(layer, dst_start, rope.shift_keys(k, delta, layer=layer) if delta else k, v)


def verify_with_branch_span(lm: LoadedModel, root_cache: SequenceKV, shared_len: int, ids: list[int],
                            span_start: int, branch: BranchSpan, tau: float, make_schedule) -> AsksVerify:
    """Verify one branch: prefix [shared_len, span_start) computed, gate, then the rest.

    ``make_schedule(start, first)`` builds the method's schedule computing [start, n): the first chunk
    (``first=True``) records the last token's hidden states and must not exit; the second has the
    method's layer exit and attention probe.
    """
    model = lm.model
    n = len(ids)
    if not shared_len < span_start < n:
        raise ValueError(f"the branch output must start after the shared root ({shared_len}) and before the "
                         f"prompt's end ({n}), got {span_start}")
    cache = SharedPrefixKV(root_cache, shared_len, capacity=n - shared_len + 1)
    probe = make_schedule(shared_len, True)
    first = model.prefill(torch.tensor(ids[:span_start]), cache, probe)  # the verifier's own prefix
    cosine = layer_cosine(torch.stack(probe.hidden), branch.boundary_hidden)
    num_reused = min(branch.num_tokens, n - 1 - span_start) if cosine >= tau else 0
    if num_reused:
        copy_span(branch.cache, branch.start, cache, span_start, num_reused, model.rope)
    rest = model.prefill(torch.tensor(ids), cache, make_schedule(span_start + num_reused, False))
    computed = (first.num_computed_token_layers + rest.num_computed_token_layers) // lm.config.num_layers
    return AsksVerify(rest.logits, rest.exit_layer, computed, cosine, num_reused, cache)
