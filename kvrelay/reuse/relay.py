"""``relay`` (RelayCaching, arXiv 2603.13289): reuse upstream decode KV, repair a band of layers.

Reused spans (an upstream agent's output with the KV it built while decoding; a task input with
the KV an upstream prompt built) are re-rotated to their new positions, then:

- below ``L_start`` and above ``L_end``: reused as is;
- ``[L_start, L_det]``: every span token recomputed, entering at ``L_start`` from the hidden state
  the upstream call carried (a span without it is recomputed from layer 0 instead, and the stats
  say how many tokens that was);
- at ``L_det`` the selector keeps tokens whose value deviation ``1 - cos(v_reused, v_fresh)`` is at
  least ``tau_dev`` x the mean, or whose attention from the call's new tokens is at least ``tau_inf``
  x the mean, plus the last ``l_suf`` tokens of every span (and, with ``l_pre`` > 0, its first
  ``l_pre``: EPIC's observation that a span's opening tokens carry most of the context change; our
  addition, not in the RelayCaching paper); only those stay through ``L_end``. With ``pre_dense``
  the opening tokens are computed at every layer instead, as EPIC computes them.
  With ``top_r`` set (the budget form) the thresholds give way to a fixed share: the ``top_r`` x n
  span tokens with the highest score (deviation / its mean + influence / its mean, or the one the
  ``selector`` names), plus the suffix and opening tokens.
- with ``L_det == L_start`` (detection where the carried states enter) there is no deviation to read: a
  token's fresh K/V there would be the upstream's again. The selection then reads only the influence (the
  call's new tokens attending to the reused keys) and runs before the span tokens join, so the ones it
  refuses are never computed: detection costs the new tokens' Q/K/V at one layer, not a layer of every
  relayed token.
- with ``prune`` (gradual filtering, as CacheBlend's paper describes it), each band layer above ``L_det``
  drops the kept tokens whose value deviation there is low (``prune_mask``) before its attention, so the
  kept set narrows with depth: a wide selection low in the band costs what a narrow one does to the top.
- with ``drift`` (ours, needs ``prune``), each of those layers also corrects the span tokens it does not
  compute: the recomputed ones show how the new context moved their K/V there (fresh - reused, keys
  with RoPE undone), and ``drift`` x the mean of that move is added to the others' reused K/V
  (``drift_shift``). Much of the move is shared across a span's tokens; the recomputed tokens are the
  ones that moved most, hence a factor under 1.
- with ``pos_prior`` or ``away`` (budget form), the score also ranks a span's early tokens first, or the span
  tokens that paid most attention, in the call that stored them, to context outside their span
  (``away_mass``: what a reused span no longer reads; one Q projection of the carried span tokens at L_start
  and their attention over the stored keys there, before the band runs).
  A subclass may hand ``plan_reuse`` more such priors by prompt position (``relay_anchors``: the move its anchors
  expect to miss). ``selector=priors`` ranks by the priors alone (no deviation, no influence): with ``L_det ==
  L_start`` the band then admits its tokens before any of them is computed and reads nothing to choose them.

The layers come from the parameters, else the model's offline profile (``kvrelay.reuse.profile``:
yours from ``kvrelay profile``, else the one shipped with kvrelay); planning never builds one. So does
the selector when the spec sets none of its knobs (``tau_dev``, ``tau_inf``, ``l_suf``, ``l_pre``,
``pre_dense``, ``top_r``, ``prune``, ``prune_by``, ``drift``, ``pos_prior``, ``away``): the profile holds the one chosen
on calibration calls for the model (with the detection layer and band it was chosen with), or none (the paper's). A spec
that sets any selector knob runs on the band search's layers (``searched_band``), not on those the
calibrated selector moved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.schedule import Entry, LayerView, StaticSchedule
from kvrelay.reuse.band import BandSchedule, Kept
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod
from kvrelay.reuse.profile import layer_profile
from kvrelay.reuse.relay_select import (
    PRUNE_RULES,
    drift_shift,
    lost_context_mass,
    position_prior,
    prune_mask,
    select_tokens,
    select_top,
    spread_with_mean,
    value_cos_deviation,
)
from kvrelay.reuse.spans import ReusePlan, collect_reuse

SELECTORS = ("both", "deviation", "influence", "priors")  # priors: the budget form's priors alone
RESERVED_PRIORS = frozenset({"always", "prior", "away"})  # names plan_reuse uses itself
# the paper's selector (second-hand figures, DESIGN.md): the thresholds, the last 10 tokens, no opening tokens,
# no pruning inside the band
PAPER_SELECTOR = {"tau_dev": 1.5, "tau_inf": 1.45, "l_suf": 10, "l_pre": 0, "pre_dense": None, "top_r": None,
                  "prune": None, "prune_by": None, "drift": None, "pos_prior": None, "away": None}


@dataclass(frozen=True)
class SelectorSettings:
    """The selector's knobs as one call uses them (``band.Selector`` is the function built from them)."""

    tau_dev: float
    tau_inf: float
    l_suf: int
    l_pre: int
    pre_dense: bool | None  # None: False (the openings enter the band with the other span tokens)
    top_r: float | None
    prune: float | None
    prune_by: str | None  # None: share
    drift: float | None  # None: no drift correction
    pos_prior: float | None  # weight of the position prior in the budget form's score (None: none)
    away: float | None  # weight of the stored tokens' attention outside their span in that score (None: none)


class _OnDevice:
    """Tensors by name, each copied to a device on first use there (a copy per layer would make a GPU wait)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self._copies = {(name, t.device): t for name, t in tensors.items()}
        self._cpu = tensors

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        if (name, device) not in self._copies:
            self._copies[name, device] = self._cpu[name].to(device)
        return self._copies[name, device]


def _recalibration_flags(profile, workload: str) -> str:
    """The ``kvrelay profile`` flags that calibrate ``workload``'s entry again: the workload (or pipeline file)
    and data it was calibrated on."""
    recorded = profile.workload_selectors[workload].get("calibration", {}).get("selector_workloads", {})
    name, data = next(iter(recorded.items()), (workload, "default"))
    return f" --for-workload --workload {name}" + (f" --data {data}" if data != "default" else "")


@dataclass
class RelayMethod(ReuseMethod):
    # The selector's knobs. None everywhere: the one the model's profile chose on calibration calls (the paper's
    # without one); any of them set: the paper's values for the others.
    tau_dev: float | None = field(default=None, metadata={
        "help": "keep span tokens whose value deviation at L_det is >= tau_dev x its mean (None: the profile's)"})
    tau_inf: float | None = field(default=None, metadata={
        "help": "keep span tokens the call's new tokens attend to >= tau_inf x the mean (None: the profile's)"})
    l_suf: int | None = field(default=None, metadata={
        "help": "keep each span's last l_suf tokens (None: the profile's)"})
    l_pre: int | None = field(default=None, metadata={
        "help": "keep each span's first l_pre tokens too, EPIC's idea inside the band (None: the profile's)"})
    top_r: float | None = field(default=None, metadata={
        "help": "budget form: keep this share of span tokens by score instead of the tau_* thresholds"})
    selector: str = field(default="both", metadata={
        "help": "token score: both (deviation + influence), deviation, influence, or priors (budget form's priors)"})
    band: bool = field(default=True, metadata={
        "help": "False (ablation): recompute the selected tokens from layer 0 to the top instead of in the band"})
    # True: each span's first l_pre tokens are computed at every layer from the embedding, as EPIC computes
    # them, instead of entering the band at L_start from the upstream hidden state and leaving it at L_end
    pre_dense: bool | None = field(default=None, metadata={
        "help": "compute the first l_pre tokens at every layer from the embedding, as EPIC does (None: profile's)"})
    # gradual filtering inside the band (selector knobs too): at each band layer above L_det, drop kept span
    # tokens whose value deviation there is low (``prune_mask``; None: keep them all to L_end)
    prune: float | None = field(default=None, metadata={
        "help": "above L_det, drop kept tokens whose value deviation is low at each band layer (None: keep to L_end)"})
    prune_by: str | None = field(default=None, metadata={
        "help": "what prune counts: a share of the kept tokens (None) or x their peers' deviation (peers)"})
    # at each pruning layer, add drift x the recomputed span tokens' mean K/V move to the other span tokens
    # (``drift_shift``; None: none)
    drift: float | None = field(default=None, metadata={
        "help": "at each pruning layer, add drift x the recomputed tokens' mean K/V move to the other span tokens"})
    # budget form: add pos_prior x the mean-normalized ``position_prior`` (a span's early tokens first) to the score
    pos_prior: float | None = field(default=None, metadata={
        "help": "budget form: add pos_prior x a prior favouring a span's early tokens to the score"})
    # budget form: add away x the mean-normalized ``away_mass`` (the attention a span token paid, where it was
    # stored, to the context it no longer has) to the score; read from the carried states at L_start
    away: float | None = field(default=None, metadata={
        "help": "budget form: add away x the attention a span token paid to context it no longer has to the score"})
    l_start: int | None = field(default=None, metadata={
        "help": "first band layer: span tokens recomputed from there on (None: the model's profile)"})
    l_det: int | None = field(default=None, metadata={
        "help": "the band layer where the selector picks the tokens kept (None: the model's profile)"})
    l_end: int | None = field(default=None, metadata={
        "help": "last band layer: kept tokens recomputed through it, reused above (None: the model's profile)"})
    name = "relay"

    def __post_init__(self) -> None:
        if self.selector not in SELECTORS:
            raise ConfigError(f"relay: selector must be one of {SELECTORS}, got {self.selector!r}")
        if self.selector == "priors" and (self.top_r is None or not (self.pos_prior or self.away
                                                                     or self.has_own_prior())):
            raise ConfigError("relay: selector=priors needs top_r and a prior to rank by (pos_prior, away, or the "
                              "method's own, such as relay_anchors' anchor_select)")
        if any(v is not None and v < 0 for v in (self.l_suf, self.l_pre, self.tau_dev, self.tau_inf)):
            raise ConfigError("relay: l_suf, l_pre, tau_dev and tau_inf must be >= 0")
        if self.top_r is not None and not 0 <= self.top_r <= 1:
            raise ConfigError(f"relay: top_r must be in [0, 1], got {self.top_r}")
        if self.prune_by is not None and self.prune_by not in PRUNE_RULES:
            raise ConfigError(f"relay: prune_by must be one of {PRUNE_RULES}, got {self.prune_by!r}")
        if self.prune_by is not None and self.prune is None:
            raise ConfigError("relay: prune_by needs prune (the share or the factor it applies)")
        if self.pre_dense is not None and not isinstance(self.pre_dense, bool):
            raise ConfigError(f"relay: pre_dense must be true or false, got {self.pre_dense!r}")
        if self.pre_dense and not self.l_pre:
            raise ConfigError("relay: pre_dense needs l_pre > 0 (the span openings it computes at every layer)")
        if self.drift is not None and not 0 <= self.drift <= 1:
            raise ConfigError(f"relay: drift must be in [0, 1], got {self.drift}")
        if self.drift is not None and self.prune is None:
            raise ConfigError("relay: drift needs prune (it corrects at the band's pruning layers)")
        if self.pos_prior is not None and self.pos_prior < 0:
            raise ConfigError(f"relay: pos_prior must be >= 0, got {self.pos_prior}")
        if self.pos_prior and self.top_r is None:
            raise ConfigError("relay: pos_prior needs top_r (it adds to the budget form's score)")
        if self.away is not None and self.away < 0:
            raise ConfigError(f"relay: away must be >= 0, got {self.away}")
        if self.away and self.top_r is None:
            raise ConfigError("relay: away needs top_r (it adds to the budget form's score)")
        if self.prune is not None and not (0 <= self.prune <= 1 if self.prune_by != "peers" else self.prune >= 0):
            raise ConfigError(f"relay: prune must be in [0, 1] (a share) or >= 0 (prune_by=peers), got {self.prune}")

    def has_own_prior(self) -> bool:
        """Whether this method hands ``plan_reuse`` a prior of its own (a subclass's; relay has none)."""
        return False

    @property
    def own_selector(self) -> bool:
        """Whether the selector comes from the model's profile (the spec sets none of its knobs)."""
        return all(getattr(self, k) is None for k in PAPER_SELECTOR)

    def selector_settings(self, lm, role: str = "") -> SelectorSettings:
        """The selector a call of ``role`` uses: the knobs given, else the profile's calibrated choice (its
        workload's, ``LayerProfile.for_role``), else the paper's."""
        given = {k: getattr(self, k) for k in PAPER_SELECTOR}
        if not self.own_selector:
            return SelectorSettings(**{k: PAPER_SELECTOR[k] if v is None else v for k, v in given.items()})
        try:
            profile = layer_profile(lm)
        except ConfigError:  # no profile (the layers were given): the paper's selector
            profile = None
        chosen = profile.for_role(role)[1] if profile else {}
        unknown = sorted(set(chosen) - set(PAPER_SELECTOR))
        try:
            if unknown:
                raise ConfigError(f"unknown knobs {unknown}")
            RelayMethod(**chosen)  # the same checks as a spec's knobs
        except ConfigError as exc:
            workload = profile.workload_of(role)  # a selector came from a profile: there is one
            which, flags = (f"{workload}'s selector", _recalibration_flags(profile, workload)) if workload else \
                ("selector", "")
            raise ConfigError(f"relay: the {which} in {lm.name}'s profile is not valid ({exc}); "
                              f"`kvrelay profile --model {lm.name} --selector-only{flags}` writes a new one") from exc
        return SelectorSettings(**{**PAPER_SELECTOR, **chosen})

    def layers(self, lm, role: str = "") -> tuple[int, int, int]:
        """(L_start, L_det, L_end) for a call of ``role`` on this model: each override given, else the profile's
        (a ConfigError says how to get one when the model has none and a layer is not given)."""
        num_layers = lm.config.num_layers
        given = (self.l_start, self.l_det, self.l_end)
        # each layer not given comes from the profile (relay[l_end=25] moves only the band's end): its layers
        # with its own selector (the role's workload's, if it has one), else the band search's (a selector chosen
        # to detect at L_start moved L_det there, one with a band of its own the band)
        if None in given:
            profile = layer_profile(lm)
            profiled = profile.for_role(role)[0] if self.own_selector else \
                tuple(profile.searched_band or profile.layers)
        else:
            profiled = given
        start, det, end = (g if g is not None else p for g, p in zip(given, profiled, strict=True))
        if not self.band:
            start, end = 0, num_layers - 1
        if start == det == end == num_layers:
            return start, det, end  # the empty band: nothing recomputed (equals naive)
        if not 0 <= start <= det <= end < num_layers:
            raise ConfigError(f"relay: need 0 <= L_start {start} <= L_det {det} <= L_end {end} < {num_layers} "
                              f"(or all = {num_layers}: the empty band)")
        return start, det, end

    def _roles(self, lm) -> dict[str, str]:
        """workload -> one of its roles, for each workload selector in the profile this spec uses."""
        if not self.own_selector:
            return {}
        try:
            entries = layer_profile(lm).workload_selectors
        except ConfigError:
            return {}
        return {name: next(iter(entry["roles"].values()), "") for name, entry in entries.items()}

    def settings(self, lm) -> dict:
        def resolved(role: str) -> dict:
            return {"layers": list(self.layers(lm, role)), "selector": asdict(self.selector_settings(lm, role))}

        per_workload = {name: resolved(role) for name, role in self._roles(lm).items()}
        return resolved("") | ({"workload_selectors": per_workload} if per_workload else {})

    def capture_layers(self, lm) -> tuple[int, ...]:
        start = self.layers(lm)[0]  # a profile's workload selectors enter where its own does (``LayerProfile``)
        return (start,) if 0 < start < lm.config.num_layers else ()

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        return self.plan_reuse(call, store, lm, collect_reuse(call, store, lm.fingerprint))

    def plan_reuse(self, call: CallInput, store: KVStore | None, lm, reuse: ReusePlan,
                   priors: dict[str, tuple[torch.Tensor, float]] | None = None,
                   count_over: tuple[str, float] | None = None) -> Plan:
        """``plan`` on the call's reuse already collected (a subclass that reads it first need not collect it twice).
        ``priors``: more of the budget form's priors, name -> (a score by prompt position [num prompt tokens], its
        weight), as a subclass knows them (``relay_anchors``: the move its anchors expect to miss). ``count_over``:
        (a prior's name, a threshold): the budget form keeps as many of the band's candidates (beside those always
        kept) as that prior scores above the threshold, in place of ``top_r`` x their number."""
        start, det, end = self.layers(lm, call.role)
        if start >= lm.config.num_layers:
            return Plan(StaticSchedule(reuse.new_idx(len(call.prompt_ids))), reuse.loads)
        sel = self.selector_settings(lm, call.role)
        if count_over is not None and (sel.top_r is None or count_over[0] not in (priors or {})):
            raise ValueError(f"relay: count_over {count_over[0]!r} needs the budget form (top_r) and that prior")
        carried, carried_h, from_zero, always, dense = [], [], [], [], []
        if sel.away and start == 0:
            raise ConfigError("relay: away reads the span tokens' states carried to L_start, which is 0 here: "
                              "set l_start > 0")
        away_parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (prompt positions, their ``away_mass``)
        for load in reuse.approx:
            idx = torch.arange(load.dst_start, load.dst_start + load.num_tokens)
            num_dense = min(sel.l_pre, load.num_tokens) if sel.pre_dense else 0
            dense.append(idx[:num_dense])  # computed like the call's new tokens, outside the band
            idx = idx[num_dense:]
            if not idx.numel():
                continue
            always += [idx[-sel.l_suf:] if sel.l_suf else idx[:0], idx[: sel.l_pre - num_dense]]
            src_start = load.src_start + num_dense
            span = store.get(load.span_id)
            h = span.hidden_rows(start, src_start, load.src_end) if start > 0 else None
            if h is not None:
                carried.append(idx)
                carried_h.append(h)
                if sel.away and (mass := lost_context_mass(lm, call, load, span, h, start)) is not None:
                    away_parts.append((idx, mass))
            else:
                from_zero.append(idx)
        entries = {}  # (at start == 0 nothing is carried: every span token is in from_zero)
        if from_zero:
            entries[0] = Entry(torch.cat(from_zero))
        if carried:
            entries[start] = Entry(torch.cat(carried), torch.cat(carried_h))
        always_pos = torch.zeros(len(call.prompt_ids), dtype=torch.bool)  # by prompt position: a span end
        if always:
            always_pos[torch.cat(always)] = True
        # every such token is kept at the selection and never pruned: this many are active through the band
        num_always = int(always_pos.sum())
        scores = {}  # by prompt position: the budget form's priors
        if sel.pos_prior:
            span_pos = torch.zeros(len(call.prompt_ids))  # the token's place in its span
            for load in reuse.approx:
                span_pos[load.dst_start : load.dst_start + load.num_tokens] = torch.arange(load.num_tokens)
            scores["prior"] = position_prior(span_pos)
        if away_parts:  # by prompt position, on the model's device; a token with no measure counts as average
            scores["away"] = spread_with_mean(torch.cat([m for _, m in away_parts]),
                                              torch.cat([i for i, _ in away_parts]), len(call.prompt_ids))
        weights = {"prior": sel.pos_prior, "away": sel.away}
        for name, (score, weight) in (priors or {}).items():
            if name in RESERVED_PRIORS:
                raise ValueError(f"relay: prior {name!r} is taken (reserved: {sorted(RESERVED_PRIORS)})")
            scores[name], weights[name] = score, weight
        by_pos = _OnDevice(always=always_pos, **scores)  # copied to the device once, not per layer

        def is_always(span_idx: torch.Tensor) -> torch.Tensor:
            return by_pos.get("always", span_idx.device).index_select(0, span_idx)

        def choose(dev: torch.Tensor | None, inf: torch.Tensor | None, span_idx: torch.Tensor) -> torch.Tensor:
            always_mask = is_always(span_idx)
            if sel.top_r is not None:
                priors = [(by_pos.get(name, span_idx.device).index_select(0, span_idx), weights[name])
                          for name in scores]
                top_r = sel.top_r
                if count_over is not None and span_idx.numel():  # one read of a count back, once per call
                    over = by_pos.get(count_over[0], span_idx.device).index_select(0, span_idx) > count_over[1]
                    top_r = int((over & ~always_mask).sum()) / span_idx.numel()
                return select_top(dev, inf, always_mask, top_r, priors)
            return select_tokens(dev, inf, always_mask, sel.tau_dev, sel.tau_inf)

        dense_idx = torch.cat(dense) if dense else torch.empty(0, dtype=torch.long)
        # the influence's queries are the call's own new tokens: the spans' dense openings are computed beside
        # them but are span text, attending mostly to their own span (a mask by prompt position, only with them)
        new_pos = None
        if dense_idx.numel():
            new_pos = torch.ones(len(call.prompt_ids), dtype=torch.bool)
            new_pos[dense_idx] = False

        def influence(view: LayerView, query_rows: torch.Tensor, span_idx: torch.Tensor) -> torch.Tensor | None:
            """The attention the call's new tokens (among ``query_rows``) pay each span token, over heads and
            queries."""
            if self.selector not in ("both", "influence"):
                return None
            if new_pos is not None:
                is_new = new_pos.to(query_rows.device).index_select(0, view.active_idx.index_select(0, query_rows))
                query_rows = query_rows[is_new]
            if not query_rows.numel():
                return None
            return view.attention_probs(query_rows).sum(dim=(0, 1)).index_select(0, span_idx)  # of [H, n_new, n_keys]

        def selector(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
            dev = value_cos_deviation(view, span_rows) if self.selector in ("both", "deviation") else None
            span_idx = view.active_idx.index_select(0, span_rows)
            return choose(dev, influence(view, new_rows, span_idx), span_idx)

        def prune(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> Kept:
            always_mask = is_always(view.active_idx.index_select(0, span_rows))
            return prune_mask(value_cos_deviation(view, span_rows), always_mask, sel.prune, sel.prune_by or "share",
                              num_always)

        def admit(view: LayerView, entering_idx: torch.Tensor) -> torch.Tensor:
            every_row = torch.arange(view.active_idx.numel(), device=view.active_idx.device)  # all new tokens
            return choose(None, influence(view, every_row, entering_idx), entering_idx)

        def drift(view: LayerView, span_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
            # the spans' openings and ends move far more than the rest: they are not the others' estimate
            sources = ~is_always(view.active_idx.index_select(0, span_rows))
            return drift_shift(view, span_rows, sources, sel.drift, span_rows.numel() - num_always)

        # selecting where the carried states enter: their own K/V there equal the reused ones (no deviation
        # to read), so the selection runs before they join and the refused ones are never computed
        admits = det == start > 0 and not from_zero
        new_idx = torch.cat([reuse.new_idx(len(call.prompt_ids)), dense_idx]).unique()  # sorted
        schedule = BandSchedule(new_idx, entries, det, end, None if admits else selector,
                                prune if sel.prune is not None else None, admit if admits else None,
                                drift if sel.drift else None)
        num_from_zero = sum(i.numel() for i in from_zero) if start > 0 else 0
        notes = [f"{num_from_zero} span tokens had no hidden state at L_start={start}: recomputed from layer 0"] \
            if num_from_zero else []
        num_unmeasured = sum(i.numel() for i in carried) - sum(i.numel() for i, _ in away_parts) if sel.away else 0
        if num_unmeasured:  # their spans were stored without their start or past the score budget
            notes.append(f"{num_unmeasured} span tokens had no away measure: scored as the others' mean")
        return Plan(schedule, reuse.loads, note="; ".join(notes) or None)
