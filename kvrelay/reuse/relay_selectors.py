"""The named parts that plug into relay's ``BandSchedule``, one job each.

- ``ThresholdSelector`` (the paper's rule) and ``BudgetSelector`` (a fixed share by score): which span tokens the
  band keeps at its detection layer, either reading their fresh K/V there (``select``) or, where the carried states
  enter at that layer, before they join (``admit``: the refused ones are never computed).
- ``GradualPrune``: which kept tokens a band layer above detection drops.
- ``DriftCorrection``: what the span tokens a pruning layer does not compute get added to their reused K/V.

Each reads the call's ``SpanMarks``: per prompt position, the span openings and ends always kept, the priors the
budget adds to its score, and which computed tokens are the call's own new tokens (the influence's queries).
"""

from __future__ import annotations

import torch

from kvrelay.model.schedule import LayerView
from kvrelay.reuse.band import Kept
from kvrelay.reuse.relay_select import drift_shift, prune_mask, select_tokens, select_top, value_cos_deviation


class SpanMarks:
    """A call's per-position marks, each copied to a device on first use there (a copy per layer would make a GPU
    wait). ``always``: bool [num prompt tokens], span tokens kept through the band whatever the rule says;
    ``priors``: name -> (score [num prompt tokens], weight); ``queries``: bool [num prompt tokens], which computed
    tokens are the call's own new tokens (None: every computed token that is not a span token)."""

    def __init__(self, always: torch.Tensor, priors: dict[str, tuple[torch.Tensor, float]] | None = None,
                 queries: torch.Tensor | None = None) -> None:
        self.num_always = int(always.sum())
        self.weights = {name: weight for name, (_, weight) in (priors or {}).items()}
        self._cpu = {"always": always, **{name: score for name, (score, _) in (priors or {}).items()}}
        if queries is not None:
            self._cpu["queries"] = queries
        self._copies: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, device: torch.device) -> torch.Tensor | None:
        if name not in self._cpu:
            return None
        if (name, device) not in self._copies:
            self._copies[name, device] = self._cpu[name].to(device)
        return self._copies[name, device]

    def always_at(self, idx: torch.Tensor) -> torch.Tensor:
        """Bool [len(idx)]: which of these prompt positions are always kept."""
        return self.get("always", idx.device).index_select(0, idx)

    def priors_at(self, idx: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
        """(score [len(idx)], weight) per prior, in the order they were given."""
        return [(self.get(name, idx.device).index_select(0, idx), weight) for name, weight in self.weights.items()]


class SpanSelector:
    """A rule choosing the span tokens the band keeps, from their value deviation and their influence (the
    attention the call's new tokens pay them). Subclasses say how (``choose``)."""

    def __init__(self, marks: SpanMarks) -> None:
        self.marks = marks

    def choose(self, deviation: torch.Tensor | None, influence: torch.Tensor | None,
               span_idx: torch.Tensor) -> torch.Tensor:
        """Bool keep mask over ``span_idx`` (prompt positions of the span tokens chosen among)."""
        raise NotImplementedError

    def select(self, view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        """``band.Selector``: at the detection layer, with the span tokens' fresh K/V there."""
        deviation = value_cos_deviation(view, span_rows)
        span_idx = view.active_idx.index_select(0, span_rows)
        return self.choose(deviation, self.influence(view, new_rows, span_idx), span_idx)

    def admit(self, view: LayerView, entering_idx: torch.Tensor) -> torch.Tensor:
        """``band.Admission``: before the span tokens entering at the detection layer are computed (no deviation)."""
        every_row = torch.arange(view.active_idx.numel(), device=view.active_idx.device)  # all new tokens
        return self.choose(None, self.influence(view, every_row, entering_idx), entering_idx)

    def query_rows(self, active_idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """Of ``rows`` (among the active ``active_idx``), the call's new tokens: the influence's queries (None: none).
        Span openings computed beside them are span text, attending mostly to their own span, so not queries."""
        queries = self.marks.get("queries", rows.device)
        if queries is not None:
            rows = rows[queries.index_select(0, active_idx.index_select(0, rows))]
        return rows if rows.numel() else None

    def influence(self, view: LayerView, query_rows: torch.Tensor, span_idx: torch.Tensor) -> torch.Tensor | None:
        """The attention the call's new tokens (``query_rows``' queries) pay each span token, over heads and queries."""
        query_rows = self.query_rows(view.active_idx, query_rows)
        if query_rows is None:
            return None
        return view.attention_mass(query_rows).index_select(0, span_idx)  # [n_keys] of [H, n_new, n_keys]


class ThresholdSelector(SpanSelector):
    """The paper's rule: deviation >= ``tau_dev`` x its mean, or influence >= ``tau_inf`` x its mean, or always kept."""

    def __init__(self, marks: SpanMarks, tau_dev: float, tau_inf: float) -> None:
        super().__init__(marks)
        self.tau_dev, self.tau_inf = tau_dev, tau_inf

    def choose(self, deviation: torch.Tensor | None, influence: torch.Tensor | None,
               span_idx: torch.Tensor) -> torch.Tensor:
        return select_tokens(deviation, influence, self.marks.always_at(span_idx), self.tau_dev, self.tau_inf)


class BudgetSelector(SpanSelector):
    """A fixed share: the ``keep_share`` x n span tokens with the highest deviation + influence + weighted priors
    (each over its mean), plus the ones always kept."""

    def __init__(self, marks: SpanMarks, keep_share: float) -> None:
        super().__init__(marks)
        self.keep_share = keep_share

    def choose(self, deviation: torch.Tensor | None, influence: torch.Tensor | None,
               span_idx: torch.Tensor) -> torch.Tensor:
        return select_top(deviation, influence, self.marks.always_at(span_idx), self.keep_share,
                          self.marks.priors_at(span_idx))


class GradualPrune:
    """``band``'s prune: each band layer above detection drops the ``share`` of kept tokens (not always kept) whose
    value deviation there is lowest, so the kept set narrows with depth (CacheBlend's gradual filtering)."""

    def __init__(self, marks: SpanMarks, share: float) -> None:
        self.marks, self.share = marks, share

    def __call__(self, view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> Kept:
        always_mask = self.marks.always_at(view.active_idx.index_select(0, span_rows))
        return prune_mask(value_cos_deviation(view, span_rows), always_mask, self.share, self.marks.num_always)


class DriftCorrection:
    """``band``'s drift: the span tokens a pruning layer does not compute get ``factor`` x the mean K/V move of the
    ones it computes (fresh - reused, keys with RoPE undone). The spans' openings and ends move far more than the
    rest, so they are not the others' estimate."""

    def __init__(self, marks: SpanMarks, factor: float) -> None:
        self.marks, self.factor = marks, factor

    def __call__(self, view: LayerView, span_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        sources = ~self.marks.always_at(view.active_idx.index_select(0, span_rows))
        return drift_shift(view, span_rows, sources, self.factor, span_rows.numel() - self.marks.num_always)
