"""BandSchedule: the schedule shape that CacheBlend and RelayCaching share.

- ``new_idx`` tokens are computed at every layer.
- span tokens (reused, approximate) enter as ``span_entries`` say: at layer 0 from the embedding,
  or at a higher layer from carried hidden states (below it they read the reused KV as is). They
  are all computed below ``select_layer``. There every one gets its fresh Q/K/V (the fresh V is the
  deviation signal, the fresh K what the influence attention reads), the selector keeps some, and
  only those run that layer's attention and MLP (a dropped token costs its Q/K/V projection there,
  not a whole layer) and stay through ``end_layer`` (inclusive: there they get their fresh K/V and skip
  attention and MLP, whose output nothing reads); above it, all read the reused KV as is. Every span
  token's K/V at ``select_layer`` is fresh, so it counts as computed there, as at the top.
- with an ``admit`` function (every span token entering at ``select_layer`` from carried hidden states,
  and a selector that needs none of their own Q/K/V: their fresh K/V there would equal the reused),
  the selection happens before they join: it reads the new tokens' Q/K/V and the reused keys, and the
  span tokens it refuses are never computed at all.
- with a ``prune`` function, every band layer above ``select_layer`` is a selecting layer too: the kept
  span tokens get their fresh Q/K/V there, ``prune`` may drop some (from their deviation at that
  layer), and those skip that layer's attention and MLP and read the reused KV above it. The kept set
  only shrinks through the band, as CacheBlend's gradual filtering does.
- with a ``drift`` function, every selecting layer then adds to the cached K/V of the span tokens not
  computed there (refused or dropped below) what ``drift`` estimates from the computed ones' fresh
  against reused K/V, before that layer's attention reads them.

On a GPU every count the host reads from the device makes it wait for the queued work. The band keeps the
number of span tokens active on the host instead, so that a layer's rows are found without such a wait. A
selector that says how many it kept (``Kept``: relay's share pruning, cacheblend's budget) costs no wait; a
bare mask is counted on the device (the selection at ``select_layer`` and the admission, once per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvrelay.model.schedule import Entry, KVShift, LayerView, Schedule, rows_of


class Kept(NamedTuple):
    """A selector's keep mask with its count, known on the host (no GPU wait to read it)."""

    mask: torch.Tensor  # bool [num span rows]
    num: int  # int(mask.sum())


# (view, rows of span tokens among the active rows, rows of new tokens) -> keep mask over span rows (a bare mask
# is counted on the device: one wait on a GPU)
Selector = Callable[[LayerView, torch.Tensor, torch.Tensor], "torch.Tensor | Kept"]
# (view of the active tokens, prompt indices of the span tokens entering) -> keep mask over them
Admission = Callable[[LayerView, torch.Tensor], torch.Tensor]
# (view, rows of span tokens among the active rows) -> (K before RoPE, V) [Hkv, 1, hd] each to add to the
# span tokens not active at that layer, or None
Drift = Callable[[LayerView, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]
# (active prompt indices, rows of them the choice may query) -> the rows whose ``attention_mass`` the selector or the
# admission reads (``Schedule.mass_rows``), or None
MassRows = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def _counted(keep: torch.Tensor | Kept) -> Kept:
    return keep if isinstance(keep, Kept) else Kept(keep, int(keep.sum()))


class BandSchedule(Schedule):
    has_layer_hook = True

    def __init__(self, new_idx: torch.Tensor, span_entries: dict[int, Entry], select_layer: int, end_layer: int,
                 selector: Selector | None, prune: Selector | None = None, admit: Admission | None = None,
                 drift: Drift | None = None, mass_rows: MassRows | None = None) -> None:
        enter = [layer for layer, e in span_entries.items() if e.token_idx.numel()]
        if enter and not max(enter) <= select_layer <= end_layer:
            raise ValueError(f"band layers must satisfy enter {max(enter)} <= select {select_layer} <= end {end_layer}")
        if admit is not None and (select_layer == 0 or any(
                e.token_idx.numel() for layer, e in span_entries.items() if layer != select_layer)):
            raise ValueError(f"admission at layer {select_layer} needs every span token to enter there, above 0")
        if (admit is None) == (selector is None):
            raise ValueError("a band selects with either a selector or an admission, one of them")
        for layer, e in span_entries.items():
            if layer > 0 and e.token_idx.numel() and e.hidden is None:
                raise ValueError(f"span tokens entering at layer {layer} need carried hidden states")
        self.new_idx, self.span_entries = new_idx, span_entries
        spans = [e.token_idx for e in span_entries.values()]
        self.span_idx = torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)
        self.select_layer, self.end_layer, self.selector, self.prune = select_layer, end_layer, selector, prune
        self._admit, self._drift, self._mass_rows = admit, drift, mass_rows
        self.num_selected: int | None = None  # span tokens kept at the select layer (for stats)
        self.num_pruned = 0  # span tokens dropped above the select layer (for stats)
        self._span_mask: torch.Tensor | None = None  # bool [num prompt tokens]: a span token (set by entries)
        self._num_span_active: int | None = None  # span tokens active once the band selected (None: every entered)
        # (layer, its span rows, their count, the is-span mask over its active rows)
        self._split: tuple[int, torch.Tensor, int, torch.Tensor] | None = None

    def entries(self, num_tokens: int) -> dict[int, Entry]:
        self._span_mask = torch.zeros(num_tokens, dtype=torch.bool)
        self._span_mask[self.span_idx] = True
        self._num_span_active, self._split = None, None
        entries = {0: Entry(self.new_idx)}
        for layer, e in self.span_entries.items():
            if not e.token_idx.numel():
                continue
            if layer == 0:
                entries[0] = Entry(torch.cat([entries[0].token_idx, e.token_idx]))
            else:
                entries[layer] = e
        return entries

    def _num_span(self, layer: int) -> int:
        """Span tokens active at ``layer`` (known on the host): every one that entered until the band selects."""
        if self._num_span_active is not None:
            return self._num_span_active
        return sum(e.token_idx.numel() for at, e in self.span_entries.items() if at <= layer)

    def _is_span(self, active_idx: torch.Tensor) -> torch.Tensor:
        """Bool mask over ``active_idx``: which are span tokens (a lookup, not a set test per layer)."""
        if self._span_mask.device != active_idx.device:
            self._span_mask = self._span_mask.to(active_idx.device)
        return self._span_mask.index_select(0, active_idx)

    def _span_rows(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(span rows, is-span mask over the active rows, their count) of the view's layer, before it selects."""
        if self._split is None or self._split[0] != view.layer:
            is_span, num_span = self._is_span(view.active_idx), self._num_span(view.layer)
            self._split = (view.layer, rows_of(is_span, num_span), num_span, is_span)
        return self._split[1], self._split[3], self._split[2]

    def _prunes_at(self, layer: int) -> bool:
        return self.prune is not None and self.select_layer < layer <= self.end_layer

    def needs_prev_kv(self, layer: int) -> bool:
        return (self._admit is None and layer == self.select_layer) or self._prunes_at(layer)

    def _chooses_at(self, layer: int) -> bool:
        """Whether the selector or ``prune`` picks span tokens at ``layer``: the selector not where the band's top is
        its select layer (every span token leaves there anyway); ``prune`` at every band layer above the select one,
        its top included (where it only counts and drifts: the kept tokens skip attention and MLP there too)."""
        return (self._admit is None and layer == self.select_layer != self.end_layer) or self._prunes_at(layer)

    def selects_before_attention(self, layer: int) -> bool:
        # at the band's top the span tokens' output feeds nothing: they need their K/V there, not attention and MLP
        return self._chooses_at(layer) or (layer == self.end_layer and self._num_span(layer) > 0)

    def admits_at(self, layer: int) -> bool:
        return self._admit is not None and layer == self.select_layer

    def mass_rows(self, layer: int, active_idx: torch.Tensor) -> torch.Tensor | None:
        # the admission queries every active token (the span tokens are not in yet), the selector the new ones
        if self._mass_rows is None or not self._num_span(layer):
            return None
        if self.admits_at(layer):
            return self._mass_rows(active_idx, torch.arange(active_idx.numel(), device=active_idx.device))
        if self._admit is None and layer == self.select_layer != self.end_layer:
            is_span = self._is_span(active_idx)
            return self._mass_rows(active_idx, rows_of(~is_span, active_idx.numel() - self._num_span(layer)))
        return None

    def admit(self, view: LayerView, entering_idx: torch.Tensor) -> torch.Tensor:
        kept = rows_of(self._admit(view, entering_idx))  # the call's one read-back of a count
        self.num_selected = self._num_span_active = kept.numel()
        return kept

    def adjust_kv(self, view: LayerView) -> KVShift | None:
        if self._drift is None or not self._chooses_at(view.layer):
            return None
        span_rows, _, num_span = self._span_rows(view)  # (also moves the span mask beside the active set)
        num_targets = self.span_idx.numel() - num_span  # span tokens not computed at this layer
        if not num_targets:
            return None
        not_active = self._span_mask.clone()
        not_active.index_fill_(0, view.active_idx, False)
        shift = self._drift(view, span_rows) if num_span else None
        return None if shift is None else KVShift(rows_of(not_active, num_targets), *shift)

    def after_layer(self, view: LayerView) -> torch.Tensor | None:
        if view.layer != self.end_layer:
            return None
        num_span = self._num_span(view.layer)
        if not num_span:
            return None
        self._num_span_active = 0  # above the band: reuse as is
        return rows_of(~self._is_span(view.active_idx), view.active_idx.numel() - num_span)

    def before_attention(self, view: LayerView) -> torch.Tensor | None:
        span_rows, is_span, num_span = self._span_rows(view)
        if not num_span:
            return None
        new_rows = rows_of(~is_span, view.active_idx.numel() - num_span)
        if self._chooses_at(view.layer):
            if view.layer == self.select_layer:
                chosen = _counted(self.selector(view, span_rows, new_rows))
                self.num_selected = chosen.num
            else:
                chosen = _counted(self.prune(view, span_rows, new_rows))
                self.num_pruned += num_span - chosen.num
            if view.layer != self.end_layer:
                self._num_span_active = chosen.num
                keep = torch.ones_like(is_span)
                keep[span_rows] = chosen.mask
                return rows_of(keep, view.active_idx.numel() - num_span + chosen.num)
        self._num_span_active = 0  # the band's top: its span tokens need only their K/V here
        return new_rows
