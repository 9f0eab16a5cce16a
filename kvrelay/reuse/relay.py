"""``relay`` (RelayCaching, arXiv 2603.13289): reuse upstream decode KV, repair a band of layers.

Reused spans (an upstream agent's output with the KV it built while decoding; a task input with the KV an upstream
prompt built) are re-rotated to their new positions, then:

- below ``L_start`` and above ``L_end``: reused as is;
- from ``L_start``: every span token is recomputed, entering from the hidden state the upstream call carried (a span
  without one is recomputed from layer 0, and the plan's note says how many tokens that was);
- at ``L_det`` a selector (``relay_selectors``) keeps some of them through ``L_end``: ``threshold`` (the paper's:
  value deviation or the new tokens' attention over a multiple of its mean) or ``budget`` (a fixed share by score).
  With ``L_det == L_start`` the carried states' own K/V there equal the reused ones, so the selection reads only the
  new tokens' attention and runs before the span tokens join: the refused ones are never computed.

Around the selector, what the research line found to pay (``BandPolicy``): each span's first tokens computed at
every layer (EPIC's observation that a span's opening carries most of the context change), gradual pruning inside
the band (CacheBlend's), and the drift correction (ours): a pruning layer adds a share of the computed span tokens'
mean K/V move to the ones it leaves. The budget may also rank first the span tokens that paid most attention, where
they were stored, to context their span no longer has (``relay_select.away_mass``).

A plain ``relay`` runs the band and policy the model's profile holds (``kvrelay.reuse.profile``: yours from
``kvrelay profile``, else the one shipped with kvrelay), the same for every call; each setting given replaces only
its part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.schedule import Entry, StaticSchedule
from kvrelay.reuse.band import BandSchedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod
from kvrelay.reuse.profile import LayerProfile, layer_profile
from kvrelay.reuse.relay_policy import PAPER_POLICY, PAPER_SELECTOR, BandPolicy
from kvrelay.reuse.relay_select import lost_context_mass, position_prior, spread_with_mean
from kvrelay.reuse.relay_selectors import (
    BudgetSelector,
    DriftCorrection,
    GradualPrune,
    SpanMarks,
    SpanSelector,
    ThresholdSelector,
)
from kvrelay.reuse.spans import ReusePlan, collect_reuse

__all__ = ["PAPER_SELECTOR", "SELECTORS", "RelayMethod", "SpanParts", "parse_band"]

SELECTORS = ("profile", "budget", "threshold")
Layers = tuple[int, int, int]


def parse_band(text: str) -> Layers:
    """``"start:det:end"`` as three layer indices in order (a ConfigError otherwise). Their order needs no model, so
    it is checked here, as the spec comes in; ``RelayMethod.layers`` checks them against the model's layer count."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise ConfigError(f"relay: band must be three layers as start:det:end (e.g. 2:2:29), got {text!r}")
    start, det, end = (int(p) for p in parts)
    if not 0 <= start <= det <= end:
        raise ConfigError(f"relay: band {text!r}: need 0 <= L_start {start} <= L_det {det} <= L_end {end}")
    return start, det, end


@dataclass
class SpanParts:
    """Where a call's span tokens enter the band and which are kept whatever the selector says, by prompt position."""

    carried: list[torch.Tensor] = field(default_factory=list)  # enter at L_start from carried hidden states
    carried_h: list[torch.Tensor] = field(default_factory=list)  # their states there, [n, hidden] each
    from_zero: list[torch.Tensor] = field(default_factory=list)  # no carried state: enter at layer 0
    always: list[torch.Tensor] = field(default_factory=list)  # span openings and ends kept through the band
    dense: list[torch.Tensor] = field(default_factory=list)  # openings computed at every layer, as new tokens are
    away: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (positions, their away mass)

    def dense_idx(self) -> torch.Tensor:
        return torch.cat(self.dense) if self.dense else torch.empty(0, dtype=torch.long)


@dataclass
class RelayMethod(ReuseMethod):
    selector: str = field(default="profile", metadata={
        "help": "profile (the model profile's calibrated choice), budget (a fixed share by score) or threshold "
                "(the paper's)"})
    keep_share: float | None = field(default=None, metadata={
        "help": "budget: share of span tokens kept through the band (None: the profile's, else 0.3)"})
    span_openings: int | None = field(default=None, metadata={
        "help": "each span's first tokens, always recomputed (EPIC's finding; None: the profile's)"})
    prune_share: float | None = field(default=None, metadata={
        "help": "each band layer above detection drops this share of the kept tokens (0: off, and the profile's "
                "drift with it; None: the profile's)"})
    drift: float | None = field(default=None, metadata={
        "help": "span tokens a band layer leaves get this share of the recomputed ones' mean K/V move (0: off)"})
    band: str | None = field(default=None, metadata={
        "help": "the band's layers start:det:end, e.g. 2:2:29 (None: the model's profile)"})
    name = "relay"
    # a band and policy fixed in advance, for the profile's own searches (``with_knobs``); not a setting
    fixed: tuple[Layers, BandPolicy] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.selector not in SELECTORS:
            raise ConfigError(f"relay: selector must be one of {SELECTORS}, got {self.selector!r}")
        if self.selector == "threshold" and self.keep_share is not None:
            raise ConfigError("relay: keep_share is the budget's; selector=threshold keeps by the paper's thresholds")
        if self.span_openings is not None and self.span_openings < 0:
            raise ConfigError(f"relay: span_openings must be >= 0, got {self.span_openings}")
        PAPER_POLICY.overridden(self.keep_share, self.span_openings, self.prune_share, self.drift)  # range checks
        if self.band is not None:
            parse_band(self.band)

    @classmethod
    def with_knobs(cls, layers: Layers, knobs: dict) -> RelayMethod:
        """relay on fixed layers with a policy in the profile's knob vocabulary (``relay_policy.KNOBS``): what
        ``kvrelay profile`` scores its candidate bands and selectors with."""
        method = cls()
        method.fixed = (tuple(layers), BandPolicy.from_knobs(knobs))
        return method

    def pin(self, profile: LayerProfile) -> None:
        """Run ``profile``'s band and selector (a profile given by path, not the one found for the model), resolved
        as ``layers`` and ``policy`` resolve the model's own, the settings given in place of their parts."""
        base = PAPER_POLICY if self.selector == "threshold" else BandPolicy.from_knobs(profile.selector)
        layers = parse_band(self.band) if self.band is not None else self._profile_band(profile)
        self.fixed = (layers, self._with_settings(base))

    def policy(self, lm) -> BandPolicy:
        """The band policy relay runs: the profile's (the paper's without a profile, or with ``selector=threshold``),
        with the settings given in place of its parts."""
        if self.fixed is not None:
            return self.fixed[1]
        return self._with_settings(PAPER_POLICY if self.selector == "threshold" else _profile_policy(lm))

    def _with_settings(self, base: BandPolicy) -> BandPolicy:
        return base.overridden(self.keep_share, self.span_openings, self.prune_share, self.drift,
                               budget=self.selector == "budget")

    def _profile_band(self, profile: LayerProfile) -> Layers:
        """The profile's band: the band search's for the paper's thresholds, else the one calibrated with its
        selector."""
        return tuple(profile.searched_band or profile.layers) if self.selector == "threshold" else tuple(profile.layers)

    def layers(self, lm) -> Layers:
        """(L_start, L_det, L_end): ``band`` if given, else the profile's (the band search's for the paper's
        thresholds, else the one calibrated with its selector). All equal to the number of layers: the empty band
        (nothing recomputed, as naive)."""
        num_layers = lm.config.num_layers
        if self.fixed is not None:
            start, det, end = self.fixed[0]
        elif self.band is not None:
            start, det, end = parse_band(self.band)
        else:
            start, det, end = self._profile_band(layer_profile(lm))
        if start == det == end == num_layers or 0 <= start <= det <= end < num_layers:
            return start, det, end
        raise ConfigError(f"relay: need 0 <= L_start {start} <= L_det {det} <= L_end {end} < {num_layers} "
                          f"(or all = {num_layers}: the empty band)")

    def settings(self, lm) -> dict:
        """The layers and policy relay runs, as plain data (the bench JSON records them)."""
        return {"layers": list(self.layers(lm)), "selector": self.policy(lm).to_dict()}

    def capture_layers(self, lm) -> tuple[int, ...]:
        start = self.layers(lm)[0]
        return (start,) if 0 < start < lm.config.num_layers else ()

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        return self.plan_reuse(call, store, lm, collect_reuse(call, store, lm.fingerprint))

    def plan_reuse(self, call: CallInput, store: KVStore | None, lm, reuse: ReusePlan) -> Plan:
        """``plan`` on the call's reuse already collected."""
        start, det, end = self.layers(lm)
        if start >= lm.config.num_layers:
            return Plan(StaticSchedule(reuse.new_idx(len(call.prompt_ids))), reuse.loads, note=reuse.note)
        policy = self.policy(lm)
        if policy.away and start == 0:
            raise ConfigError("relay: away reads the span tokens' states carried to L_start, which is 0 here: "
                              "set a band starting above 0")
        parts = span_parts(call, store, lm, reuse, start, policy)
        marks = span_marks(call, reuse, parts, policy)
        schedule = band_schedule(len(call.prompt_ids), reuse, parts, make_selector(policy, marks), policy, marks,
                                 (start, det, end))
        notes = [note for note in (reuse.note, plan_note(parts, start, policy)) if note]
        return Plan(schedule, reuse.loads, note="; ".join(notes) or None)


def span_parts(call: CallInput, store: KVStore | None, lm, reuse: ReusePlan, start: int,
               policy: BandPolicy) -> SpanParts:
    """Each approximate span's tokens by how they enter (carried to ``start``, from layer 0, or dense openings),
    which are always kept, and, for the budget's ``away`` prior, the carried ones' lost-context mass."""
    parts = SpanParts()
    for load in reuse.approx:
        idx = torch.arange(load.dst_start, load.dst_start + load.num_tokens)
        num_dense = min(policy.open_tokens, load.num_tokens) if policy.dense_openings else 0
        parts.dense.append(idx[:num_dense])  # computed like the call's new tokens, outside the band
        idx = idx[num_dense:]
        if not idx.numel():
            continue
        parts.always += [idx[-policy.end_tokens:] if policy.end_tokens else idx[:0],
                         idx[: policy.open_tokens - num_dense]]
        span = store.get(load.span_id)
        h = span.hidden_rows(start, load.src_start + num_dense, load.src_end) if start > 0 else None
        if h is None:
            parts.from_zero.append(idx)
            continue
        parts.carried.append(idx)
        parts.carried_h.append(h)
        if policy.away and (mass := lost_context_mass(lm, call, load, span, h, start)) is not None:
            parts.away.append((idx, mass))
    return parts


def span_marks(call: CallInput, reuse: ReusePlan, parts: SpanParts, policy: BandPolicy) -> SpanMarks:
    """The call's ``SpanMarks``: always-kept positions, the budget's priors, and (with dense openings, which are
    computed beside them) which computed tokens are the call's new tokens."""
    num_tokens = len(call.prompt_ids)
    always = torch.zeros(num_tokens, dtype=torch.bool)
    if parts.always:
        always[torch.cat(parts.always)] = True
    priors = {}
    if policy.pos_prior:
        span_pos = torch.zeros(num_tokens)  # the token's place in its span
        for load in reuse.approx:
            span_pos[load.dst_start : load.dst_start + load.num_tokens] = torch.arange(load.num_tokens)
        priors["prior"] = (position_prior(span_pos), policy.pos_prior)
    if parts.away:  # on the model's device; a token with no measure counts as average
        priors["away"] = (spread_with_mean(torch.cat([m for _, m in parts.away]),
                                           torch.cat([i for i, _ in parts.away]), num_tokens), policy.away)
    queries = None
    dense_idx = parts.dense_idx()
    if dense_idx.numel():
        queries = torch.ones(num_tokens, dtype=torch.bool)
        queries[dense_idx] = False
    return SpanMarks(always, priors, queries)


def make_selector(policy: BandPolicy, marks: SpanMarks) -> SpanSelector:
    if policy.keep_share is None:
        return ThresholdSelector(marks, policy.tau_dev, policy.tau_inf)
    return BudgetSelector(marks, policy.keep_share)


def band_schedule(num_tokens: int, reuse: ReusePlan, parts: SpanParts, selector: SpanSelector, policy: BandPolicy,
                  marks: SpanMarks, layers: Layers) -> BandSchedule:
    """The band: span tokens enter as ``parts`` says, ``selector`` keeps some at L_det (before they are computed,
    where every one enters there from a carried state), pruning and drift above it as ``policy`` says."""
    start, det, end = layers
    entries = {}  # (at start == 0 nothing is carried: every span token is in from_zero)
    if parts.from_zero:
        entries[0] = Entry(torch.cat(parts.from_zero))
    if parts.carried:
        entries[start] = Entry(torch.cat(parts.carried), torch.cat(parts.carried_h))
    admits = det == start > 0 and not parts.from_zero
    new_idx = torch.cat([reuse.new_idx(num_tokens), parts.dense_idx()]).unique()  # sorted
    prune = GradualPrune(marks, policy.prune_share) if policy.prune_share is not None else None
    drift = DriftCorrection(marks, policy.drift) if policy.drift else None
    return BandSchedule(new_idx, entries, det, end, None if admits else selector.select, prune,
                        selector.admit if admits else None, drift, selector.query_rows)


def plan_note(parts: SpanParts, start: int, policy: BandPolicy) -> str | None:
    """What the plan could not do as asked: span tokens without a carried state, or without an away measure."""
    num_from_zero = sum(i.numel() for i in parts.from_zero) if start > 0 else 0
    notes = [f"{num_from_zero} span tokens had no hidden state at L_start={start}: recomputed from layer 0"] \
        if num_from_zero else []
    num_unmeasured = sum(i.numel() for i in parts.carried) - sum(i.numel() for i, _ in parts.away) \
        if policy.away else 0
    if num_unmeasured:  # their spans were stored without their start or past the score budget
        notes.append(f"{num_unmeasured} span tokens had no away measure: scored as the others' mean")
    return "; ".join(notes) or None


def _profile_policy(lm) -> BandPolicy:
    """The policy the model's profile chose (the paper's without a profile), or a ConfigError saying how to write a
    valid one."""
    try:
        profile = layer_profile(lm)
    except ConfigError:  # no profile (the band was given): the paper's selector
        return PAPER_POLICY
    try:
        return BandPolicy.from_knobs(profile.selector)
    except ConfigError as exc:
        raise ConfigError(f"relay: the selector in {lm.name}'s profile is not valid ({exc}); "
                          f"`kvrelay profile --model {lm.name} --selector-only` writes a new one") from exc
