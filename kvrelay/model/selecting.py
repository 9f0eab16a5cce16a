"""What a schedule sees and decides at a layer where it selects tokens: the view of the active tokens' fresh Q/K/V it
chooses from (``before_attention``, ``admit``), the K/V it moves (``adjust_kv``), the attention probabilities it may
ask for. One forward (``Transformer._layer``) and a layer run as row chunks (``kvrelay.model.row_chunks``) call the
same functions, so they choose alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvrelay.model.layers import DecoderLayer, attention_probs, visible_mask
from kvrelay.model.prefill_state import ActiveSet
from kvrelay.model.rope import apply_rotary, undo_rotary
from kvrelay.model.schedule import LayerView, Schedule

# an admission's active tokens' (Q, K, V), their K/V written, and (the rows ``Schedule.mass_rows`` named, their
# attention mass) or None
Admission = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]

if TYPE_CHECKING:
    from kvrelay.cache.kv import SequenceKV
    from kvrelay.model.transformer import Transformer


def select(model: Transformer, li: int, act: ActiveSet, cache: SequenceKV, schedule: Schedule, q: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor, prev_k: torch.Tensor | None, prev_v: torch.Tensor | None,
           mass: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """A selecting layer's choice, once every active token's Q/K/V are in (the K/V in the cache): the rows the
    schedule keeps (None: all), after it moved the cached K/V of tokens not active here (``adjust_kv``). ``mass``:
    (``Schedule.mass_rows``' rows, their attention mass) where it was summed as the rows ran (``chunk_mass``)."""
    active, n, rope = act.idx, act.n, model.rope_of(li)
    table = act.tables[rope]  # cos, sin of positions 0..n-1
    _, _, cos, sin = act.view(rope, model.config.window_at(li))

    def cos_sin32(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 whatever the model's dtype: undoing and redoing RoPE in bf16 would not invert
        if table[0].dtype == torch.float32:
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
        return model.rope_of(li).cos_sin(positions, torch.float32, n)

    def unrotate(keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if cos.dtype == torch.float32:  # the active set's own tables
            row_cos, row_sin = cos.index_select(0, rows), sin.index_select(0, rows)
        else:
            row_cos, row_sin = cos_sin32(active.index_select(0, rows))
        return undo_rotary(keys.float(), row_cos, row_sin)

    view = LayerView(li, active, None, q, k, v, prev_k, prev_v,
                     _attention_probs=probs_fn(model, q, cache, li, active, n), _unrotate=unrotate, _mass=mass)
    kept = schedule.before_attention(view)
    shift = schedule.adjust_kv(view)
    if shift is not None and shift.slots.numel():
        slot_cos, slot_sin = cos_sin32(shift.slots)
        shift_k = apply_rotary(shift.k.float(), slot_cos, slot_sin)  # [Hkv, 1 or m, hd] by [m, hd] -> [Hkv, m, hd]
        cache.add(li, shift.slots, shift_k.to(k.dtype), shift.v.to(k.dtype))
    return kept


def admit(model: Transformer, layer: DecoderLayer, li: int, h: torch.Tensor, active: torch.Tensor,
          table: tuple[torch.Tensor, torch.Tensor], cache: SequenceKV, schedule: Schedule, entering_idx: torch.Tensor,
          n: int, prepared: Admission | None = None) -> torch.Tensor | None:
    """Admission at layer ``li``: the active tokens' Q/K/V (K/V written to the cache; the layer recomputes
    the same values after), the rows of ``entering_idx`` the schedule admits. ``prepared``: those Q/K/V, already
    written, and the attention mass, summed as a layer run in row chunks projected them (``row_chunks``)."""
    if prepared is None:
        q, k, v = layer.project(h, table[0].index_select(0, active), table[1].index_select(0, active))
        cache.write(li, active, k, v)
        mass = None
    else:
        (q, k, v), mass = prepared
    view = LayerView(li, active, None, q, k, v, None, None,
                     _attention_probs=probs_fn(model, q, cache, li, active, n), _mass=mass)
    return schedule.admit(view, entering_idx)


def chunk_mass(model: Transformer, q: torch.Tensor, positions: torch.Tensor, cache: SequenceKV, layer: int,
               num_keys: int, n: int) -> torch.Tensor:
    """The attention mass ([n] fp32, summed over heads and rows) of rows at ``positions`` (queries ``q`` [H, r, hd])
    over this layer's keys below ``num_keys`` (causal: every key they see, written by then): one chunk's share of
    ``LayerView.attention_mass``, which sums the chunks'. Its scores: r x ``num_keys``."""
    k_all, _ = cache.kv(layer, 0, num_keys)
    probs = attention_probs(q, k_all, visible_mask(positions, num_keys, model.config.window_at(layer)))
    mass = torch.zeros(n, dtype=torch.float32, device=q.device)
    mass[:num_keys] = probs.sum(dim=(0, 1))  # of [H, r, num_keys]
    return mass


def probs_fn(model: Transformer, q: torch.Tensor, cache: SequenceKV, layer: int, active: torch.Tensor, n: int
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``LayerView.attention_probs`` computes: the chosen active rows' attention over every key of ``layer``."""
    def probs(rows: torch.Tensor) -> torch.Tensor:
        k_all, _ = cache.kv(layer, 0, n)
        rows = rows.to(q.device)  # a schedule may name them on the CPU (index_select needs them beside q)
        return attention_probs(q.index_select(1, rows), k_all,
                               visible_mask(active.index_select(0, rows), n, model.config.window_at(layer)))

    return probs
