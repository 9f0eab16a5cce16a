"""``BandPolicy``: everything relay's band does on a call besides its layers, as one validated value.

A user names at most a few of these (``RelayMethod``'s settings); the rest come from the model's profile, which
``kvrelay profile`` writes in the knob vocabulary below (``from_knobs``), or from the paper. Two selection rules:
the paper's thresholds (``keep_share`` None) and the budget (a fixed share of span tokens by score). Around either:
span openings and ends always kept, the openings optionally computed at every layer (EPIC's finding), gradual
pruning inside the band, and the drift correction of the tokens it leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from kvrelay.errors import ConfigError

#: the knob names profiles and the selector calibration use, each mapped to its ``BandPolicy`` field
KNOBS = {"tau_dev": "tau_dev", "tau_inf": "tau_inf", "l_suf": "end_tokens", "l_pre": "open_tokens",
         "pre_dense": "dense_openings", "top_r": "keep_share", "prune": "prune_share", "drift": "drift",
         "pos_prior": "pos_prior", "away": "away"}
#: the knobs a relay setting names (docs/methods.md), each as that setting, in the order the docs list them
KNOB_SETTINGS = {"top_r": "keep_share", "l_pre": "span_openings", "prune": "prune_share", "drift": "drift"}
#: the paper's selector as knobs (second-hand figures): the thresholds and each span's last 10 tokens
PAPER_SELECTOR = {"tau_dev": 1.5, "tau_inf": 1.45, "l_suf": 10}
#: the budget's share when a spec asks for the budget and nothing gives one: the share both shipped profiles chose
DEFAULT_KEEP_SHARE = 0.3


@dataclass(frozen=True)
class BandPolicy:
    """How relay's band picks and repairs span tokens (the defaults are the paper's selector)."""

    keep_share: float | None = None  # budget: this share of span tokens by score; None: the tau_* thresholds
    tau_dev: float = 1.5  # thresholds: keep deviation >= tau_dev x its mean
    tau_inf: float = 1.45  # thresholds: keep influence (the new tokens' attention) >= tau_inf x its mean
    end_tokens: int = 10  # each span's last tokens, always kept through the band
    open_tokens: int = 0  # each span's first tokens, always kept through the band (or dense, below)
    dense_openings: bool = False  # the openings computed at every layer from the embedding, as EPIC computes them
    prune_share: float | None = None  # above detection, each band layer drops this share of kept tokens (None: off)
    drift: float | None = None  # the tokens a pruning layer leaves get this share of the computed ones' mean move
    pos_prior: float | None = None  # budget: weight of a prior ranking a span's early tokens first
    away: float | None = None  # budget: weight of the attention a span token paid, stored, to context it lost

    def __post_init__(self) -> None:
        _check_share("keep_share (top_r)", self.keep_share)
        _check_share("prune_share (prune)", self.prune_share)
        _check_share("drift", self.drift)
        if min(self.end_tokens, self.open_tokens, self.tau_dev, self.tau_inf) < 0:
            raise ConfigError("relay: span opening/end token counts and the tau_* thresholds must be >= 0")
        if not isinstance(self.dense_openings, bool):
            raise ConfigError(f"relay: pre_dense must be true or false, got {self.dense_openings!r}")
        if self.dense_openings and not self.open_tokens:
            raise ConfigError("relay: dense openings need span openings > 0 (the tokens computed at every layer)")
        if self.drift is not None and self.prune_share is None:
            raise ConfigError("relay: drift needs pruning (it corrects at the band's pruning layers)")
        for name, weight in (("pos_prior", self.pos_prior), ("away", self.away)):
            if weight is not None and weight < 0:
                raise ConfigError(f"relay: {name} must be >= 0, got {weight}")
            if weight and self.keep_share is None:
                raise ConfigError(f"relay: {name} needs the budget (top_r): it adds to the budget's score")

    @classmethod
    def from_knobs(cls, knobs: dict) -> BandPolicy:
        """A policy from the profile's knob vocabulary (``KNOBS``); a knob not named keeps the paper's value."""
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise ConfigError(f"unknown knobs {unknown}")
        values = {KNOBS[k]: v for k, v in knobs.items()}
        if values.get("dense_openings") is None:
            values["dense_openings"] = False
        return cls(**values)

    def overridden(self, keep_share: float | None = None, span_openings: int | None = None,
                   prune_share: float | None = None, drift: float | None = None, budget: bool = False) -> BandPolicy:
        """This policy with the settings a spec gave (None: keep this policy's). ``budget``: use the budget rule
        (this policy's share, else ``DEFAULT_KEEP_SHARE``); a budget replacing the thresholds keeps no span ends
        (the paper's last 10 are the thresholds'; every calibrated budget chose none). A zero share or drift turns
        that part off; pruning turned off takes this policy's drift with it (drift corrects at pruning layers), and
        a drift given without pruning prunes nothing, so that its layers exist."""
        values = {}
        if keep_share is not None or (budget and self.keep_share is None):
            values["keep_share"] = DEFAULT_KEEP_SHARE if keep_share is None else keep_share
            if self.keep_share is None:  # the budget in place of the thresholds: without their span ends, as chosen
                values["end_tokens"] = 0
        if span_openings is not None:
            values["open_tokens"] = span_openings
            values["dense_openings"] = self.dense_openings and span_openings > 0
        if prune_share is not None:
            values["prune_share"] = prune_share or None
            if not prune_share and drift is None:
                values["drift"] = None
        if drift is not None:
            values["drift"] = drift or None
            if drift and values.get("prune_share", self.prune_share) is None:
                values["prune_share"] = 0.0
        return replace(self, **values) if values else self

    def to_dict(self) -> dict:
        return asdict(self)


def knobs_as_spec(knobs: dict, band: Sequence[int]) -> str:
    """A policy in the knob vocabulary, on ``band`` (L_start, L_det, L_end), as a user names it: the relay spec of
    the settings docs/methods.md documents (``relay[selector=budget,keep_share=0.3,...,band=2:2:29]``), then, after
    `` + ``, the parts no setting names (a profile's policy may hold them; a plain ``relay`` runs them from it)."""
    policy = BandPolicy.from_knobs(knobs)  # unknown knobs and bad values fail here
    budget = policy.keep_share is not None
    settings = {"selector": "budget" if budget else "threshold"}
    settings |= {name: knobs[knob] for knob, name in KNOB_SETTINGS.items() if knobs.get(knob) is not None}
    settings["band"] = ":".join(str(layer) for layer in band)
    spec = "relay[" + ",".join(f"{name}={value}" for name, value in settings.items()) + "]"
    paper, extras = BandPolicy(), []
    if not budget and (policy.tau_dev, policy.tau_inf) != (paper.tau_dev, paper.tau_inf):
        extras.append(f"thresholds {policy.tau_dev:g}x deviation, {policy.tau_inf:g}x attention")
    if policy.end_tokens != (0 if budget else paper.end_tokens):  # a budget spec keeps no span ends
        extras.append(f"each span's last {policy.end_tokens} tokens kept")
    if policy.dense_openings:
        extras.append("openings computed at every layer")
    if policy.pos_prior:
        extras.append(f"early-token prior {policy.pos_prior:g}")
    if policy.away:
        extras.append(f"lost-context attention prior {policy.away:g}")
    return spec + "".join(f" + {extra}" for extra in extras)


def _check_share(name: str, value: float | None) -> None:
    if value is not None and not 0 <= value <= 1:
        raise ConfigError(f"relay: {name} must be in [0, 1], got {value}")


PAPER_POLICY = BandPolicy.from_knobs(PAPER_SELECTOR)
