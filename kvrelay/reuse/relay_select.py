"""The selection rules relay's band applies at a layer: per-token scores and the masks they give (no plan).

- ``value_cos_deviation``: how far a span token's fresh V moved from its reused V.
- ``select_tokens`` (the paper's thresholds) and ``select_top`` (a budget): which span tokens the band keeps.
- ``position_prior`` and ``away_mass``: scores the budget form can add, known before the band runs
  (``shared_context_len`` and ``spread_with_mean`` serve the latter).
- ``prune_mask``: which kept tokens a band layer above the selection drops.
- ``drift_shift``: the mean K/V move that the tokens not computed at a layer get.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.errors import ScheduleError
from kvrelay.model.layers import DecoderLayer, attention_probs, repeat_kv, visible_mask
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.schedule import LayerView, count_checks_out, rows_of
from kvrelay.reuse.band import Kept
from kvrelay.reuse.base import CallInput, SpanLoad

# 1 - cos below this is float noise (fresh vs reused V of the same input through different matmul
# shapes), not a deviation; SmolLM2's real mid-layer deviations average ~1e-2.
DEVIATION_FLOOR = 1e-4


def value_cos_deviation(view: LayerView, rows: torch.Tensor) -> torch.Tensor:
    """1 - cos(v_fresh, v_reused) per row, over all KV heads: [len(rows)]."""
    fresh = view.v.index_select(1, rows).transpose(0, 1).flatten(1).float()  # [n, Hkv * hd]
    reused = view.prev_v.index_select(1, rows).transpose(0, 1).flatten(1).float()
    dev = 1 - torch.nn.functional.cosine_similarity(fresh, reused, dim=-1)
    return torch.where(dev < DEVIATION_FLOOR, torch.zeros_like(dev), dev)


def select_tokens(deviation: torch.Tensor | None, influence: torch.Tensor | None, always_mask: torch.Tensor,
                  tau_dev: float, tau_inf: float) -> torch.Tensor:
    """Union of: deviation >= tau_dev x mean, influence >= tau_inf x mean, ``always_mask`` (the spans'
    suffix and opening tokens). Bool [n].

    A zero score never selects: tokens entering at L_start from carried hidden states have fresh V
    equal to the reused V at that layer, so all deviations are 0 there and "0 >= tau x 0" would keep all.
    """
    keep = always_mask.clone()
    if deviation is not None and deviation.numel():
        keep |= (deviation >= tau_dev * deviation.mean()) & (deviation > 0)
    if influence is not None and influence.numel():
        keep |= (influence >= tau_inf * influence.mean()) & (influence > 0)
    return keep


POSITION_SCALE_TOKENS = 16.0


def position_prior(span_pos: torch.Tensor) -> torch.Tensor:
    """1 / (1 + position in its span / 16) per token ([n], fp32): a span's early tokens first. A span token's
    position alone finds more of the tokens whose recompute helps the continuation most than influence does
    (``research/relay_oracle_signals.py``)."""
    return 1 / (1 + span_pos.float() / POSITION_SCALE_TOKENS)


SINK_LEN = 1  # a stored sequence's first position: an attention sink, the same token wherever a span goes
AWAY_ROWS_PER_BLOCK = 256  # queries per attention block: bounds the fp32 [H, rows, keys] probabilities
# a span's mass costs its tokens x its stored context in attention scores at one layer: cheap on agent answers (on
# GSM8K about 2% of relay's TTFT), but on copy-agents' long spans (409 tokens over 2,112 keys) +12%; above this many
# scores per head a span is not measured (its tokens count as average)
AWAY_MAX_SCORES = 1 << 18


@torch.no_grad()
def away_mass(layer: DecoderLayer, rope: RotaryEmbedding, h: torch.Tensor, keys: torch.Tensor, context_start: int,
              window: int | None) -> torch.Tensor:
    """How much of its attention each stored token of a span paid, where it was computed, to the context the span
    no longer has: [m] fp32, summed over heads.

    ``keys`` [Hkv, num_keys, hd]: the stored sequence's keys at ``layer``, from its first token (at position 0) to
    the span's end; ``h`` [m, hidden]: the layer's input for the last m of those tokens (the span's, carried from
    the call that stored them). The lost context is keys [SINK_LEN, context_start): what precedes the span where it
    was stored, less the sink and less what precedes it in the new prompt too (``shared_context_len``).

    A token that read much of that context moves more when it is reused elsewhere (Cache-Craft's cue). On SmolLM2
    GSM8K train calls it ranks the span tokens whose keys move most better than the new tokens' attention does
    (``research/relay_oracle_signals.py``). Cost: a Q projection of the m tokens and m x num_keys attention scores.
    """
    num_keys = keys.shape[1]
    query_pos = torch.arange(num_keys - h.shape[0], num_keys, device=h.device)  # the m tokens' stored positions
    q, _, _ = layer.project(h, *rope.cos_sin(query_pos, h.dtype, num_keys))  # q [H, m, hd]
    keys = repeat_kv(keys.float(), q.shape[0] // keys.shape[0])  # [H, num_keys, hd], once for every block
    mass = []
    for lo in range(0, h.shape[0], AWAY_ROWS_PER_BLOCK):
        rows = slice(lo, lo + AWAY_ROWS_PER_BLOCK)
        probs = attention_probs(q[:, rows], keys, visible_mask(query_pos[rows], num_keys, window))  # [H, rows, keys]
        mass.append(probs[:, :, SINK_LEN:context_start].sum(dim=(0, 2)))
    return torch.cat(mass)


def shared_context_len(prompt_ids: Sequence[int], dst_start: int, stored_ids: Sequence[int], src_start: int) -> int:
    """How many tokens right before a span are the same in the new prompt and where the span was stored (a ref cut
    short by the exact prefix or by an earlier ref has its own first tokens there): context the span keeps."""
    num_shared = 0
    while (num_shared < min(dst_start, src_start)
           and prompt_ids[dst_start - 1 - num_shared] == stored_ids[src_start - 1 - num_shared]):
        num_shared += 1
    return num_shared


def spread_with_mean(values: torch.Tensor, positions: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[num_positions]: ``values`` at ``positions``, their mean everywhere else, so that tokens with no measure count
    as average in a mean-normalized sum, not as low. One copy of ``positions`` to the values' device, no read back."""
    out = values.mean().expand(num_positions).clone()
    return out.index_copy_(0, positions.to(values.device), values)


def select_top(deviation: torch.Tensor | None, influence: torch.Tensor | None, always_mask: torch.Tensor,
               top_r: float, priors: Sequence[tuple[torch.Tensor, float]] = ()) -> torch.Tensor:
    """Budget form: ``always_mask`` plus the round(top_r x n) tokens with the highest mean-normalized
    deviation + influence (a missing or all-zero score adds nothing), plus weight x the mean-normalized score of
    each (score [n], weight) in ``priors`` (``position_prior``, ``away_mass``). Bool [n]."""
    score = torch.zeros(always_mask.shape, dtype=torch.float32, device=always_mask.device)
    for part, weight in ((deviation, 1.0), (influence, 1.0), *priors):
        if part is not None and weight and part.numel() and float(part.mean()) > 0:
            score += weight * part.float() / part.float().mean()
    keep = always_mask.clone()
    num_keep = min(round(top_r * score.numel()), int((score > 0).sum()))
    if num_keep:
        keep[score.topk(num_keep).indices] = True
    return keep


def drift_shift(view: LayerView, span_rows: torch.Tensor, source_mask: torch.Tensor,
                factor: float, num_sources: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``factor`` x the mean move (fresh - reused) of the K/V of span rows ``span_rows[source_mask]``, keys
    with RoPE undone: (K, V) [Hkv, 1, hd] each in fp32, or None without sources. ``num_sources``: how many
    ``source_mask`` holds, where the host knows it (``rows_of``)."""
    if num_sources == 0:
        return None
    rows = span_rows.index_select(0, rows_of(source_mask, num_sources))
    if not rows.numel():
        return None
    dk = view.k.index_select(1, rows).float() - view.prev_k.index_select(1, rows).float()  # [Hkv, m, hd]
    dv = view.v.index_select(1, rows).float() - view.prev_v.index_select(1, rows).float()
    return factor * view.unrotate(dk, rows).mean(1, keepdim=True), factor * dv.mean(1, keepdim=True)


def prune_mask(deviation: torch.Tensor, always_mask: torch.Tensor, share: float,
               num_always: int | None = None) -> Kept:
    """Which kept span tokens stay at a band layer above L_det, from their value deviation there: bool [n] and
    how many. Drops the lowest ``share`` (rounded down) of the tokens not in ``always_mask`` (the spans' suffix and
    opening tokens, which stay to the band's end). ``num_always``: how many ``always_mask`` holds, where the host
    knows it; what stays is then counted without reading a count back from the device.
    """
    keep = torch.ones_like(always_mask)
    if num_always is None:
        num_always = int(always_mask.sum())
    elif not 0 <= num_always <= always_mask.numel() or not count_checks_out(always_mask, num_always):
        raise ScheduleError(f"pruning counted {num_always} always-kept tokens among {always_mask.numel()}, "
                            f"its mask holds {int(always_mask.sum())}")
    num_free = always_mask.numel() - num_always
    num_drop = int(share * num_free)
    if num_drop:
        ranked = deviation.masked_fill(always_mask, torch.inf)
        keep.index_fill_(0, ranked.topk(num_drop, largest=False).indices, False)
    return Kept(keep, keep.numel() - num_drop)


def lost_context_mass(lm, call: CallInput, load: SpanLoad, span: StoredSpan, h: torch.Tensor, layer: int
                      ) -> torch.Tensor | None:
    """``away_mass`` at ``layer`` of a carried span's tokens (``h``: their states there): zeros for a span that lost
    no context (its stored context precedes it in the new prompt too, or it has none but the sink); None (not
    measured) for one stored without its sequence's start (its tokens attended to context the store does not hold)
    and for one whose attention would cost more than ``AWAY_MAX_SCORES`` scores per head."""
    if span.start_pos != 0 or h.shape[0] * load.src_end > AWAY_MAX_SCORES:
        return None
    context_start = load.src_start - shared_context_len(call.prompt_ids, load.dst_start, span.token_ids,
                                                        load.src_start)
    if context_start <= SINK_LEN:
        return torch.zeros(h.shape[0], device=lm.model.device)
    device, dtype = lm.model.device, lm.model.dtype  # a span may be held elsewhere (a tier's spans are on the CPU)
    keys = span.k[layer][:, : load.src_end].to(device, dtype)  # [Hkv, src_end, hd]
    return away_mass(lm.model.model.layers[layer], lm.model.rope_of(layer), h.to(device, dtype), keys,
                     context_start, lm.config.window_at(layer))
