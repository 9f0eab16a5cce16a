"""The ladder of reuse settings a role climbs, and the controller that moves each role along it.

A rung is a method spec as ``kvrelay.reuse.get_method`` takes it. The ladder runs from the cheapest rung (most
reuse, least repair) to the safest; the default one is built from shipped methods only:

- ``naive``: every known span re-rotated, nothing repaired (the most reuse);
- ``relay``: the model's shipped profile repairs a band of layers (the least KL of every shipped method on every
  table of BENCHMARKS.md, at 0.64-0.74 reuse);
- ``prefix``: exact prefix reuse, which equals ``full`` up to float rounding.

``epic`` is left out: on every shipped table it reuses no more than ``relay`` and its KL is higher, so a role that
``relay`` fails would gain nothing from it. ``full`` is left out because ``prefix`` already is exact.

A learning rung (``kvcomm``) can be put on a ladder (``parse_ladder``, ``--quality-ladder``): the shadow references
teach it (``kvrelay.server.shadow_teacher``). It is not a default rung: taught so on unseen MMLU subjects it reused
about half what ``relay`` does, and over the target on the calls it reused (docs/quality.md).

The controller is deterministic: its decisions are a function of the sequence of calls and observations it was
given (counters only, no clock, no random numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.errors import ConfigError
from kvrelay.quality.estimate import RungEstimate

if TYPE_CHECKING:
    from kvrelay.quality.config import QualityConfig


@dataclass(frozen=True)
class Rung:
    """One setting of the ladder: a short name (what the metrics and the endpoint show) and its method spec."""

    name: str
    method_spec: str

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"rung name {self.name!r} must be a non-empty word (letters, digits, _ or -)")
        if not self.method_spec.strip():
            raise ConfigError(f"rung {self.name!r} needs a method spec (e.g. 'relay' or 'epic[k=8]')")


#: methods equal to ``full`` up to float rounding: a ladder's safest rung is one of them
EXACT_METHODS = ("prefix", "full")

#: cheapest -> safest
DEFAULT_LADDER: tuple[Rung, ...] = (Rung("naive", "naive"), Rung("relay", "relay"), Rung("prefix", "prefix"))


def check_ladder(ladder: tuple[Rung, ...]) -> tuple[Rung, ...]:
    """The ladder as a tuple, or a ConfigError: at least one rung, names unique, the last (safest) rung exact
    (``prefix`` or ``full``): a role whose measured quality breaks the target on every other rung lands there, and
    the guard's promise holds only if that rung cannot break it."""
    ladder = tuple(ladder)
    if not ladder:
        raise ConfigError("a quality ladder needs at least one rung")
    names = [r.name for r in ladder]
    if len(set(names)) != len(names):
        raise ConfigError(f"quality ladder rung names must be unique, got {names}")
    safest = ladder[-1].method_spec.split("[", 1)[0].strip()
    if safest not in EXACT_METHODS:
        raise ConfigError(f"the quality ladder's last rung is its safest and must be exact "
                          f"({' or '.join(EXACT_METHODS)}), got {ladder[-1].method_spec!r}; list rungs cheapest "
                          f"first, e.g. naive,relay,prefix")
    return ladder


def parse_ladder(text: str) -> tuple[Rung, ...]:
    """A ladder from its flag, cheapest rung first: comma-separated rungs, each a method spec (its rung name: the
    method's, e.g. ``kvcomm``) or ``NAME=SPEC`` (e.g. ``wide=relay[selector=budget,keep_share=0.5]``); commas inside
    a spec's brackets belong to the spec. A ConfigError names what is wrong."""
    items, depth, current = [], 0, ""
    for char in text or "":
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ConfigError(f"quality ladder {text!r}: a ']' closes no '['")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ConfigError(f"quality ladder {text!r}: a '[' is never closed")
    items.append(current)
    rungs = []
    for item in items:
        item = item.strip()
        if not item:
            raise ConfigError(f"quality ladder {text!r}: an empty rung (give rungs like 'naive,relay,prefix')")
        head = item.split("[", 1)[0]
        name, spec = (p.strip() for p in item.split("=", 1)) if "=" in head else (head.strip(), item)
        rungs.append(Rung(name, spec))
    return check_ladder(tuple(rungs))


def ladder_text(ladder: tuple[Rung, ...]) -> str:
    """The flag's text of ``ladder`` (``parse_ladder``'s inverse)."""
    return ",".join(r.method_spec if r.method_spec.split("[", 1)[0] == r.name else f"{r.name}={r.method_spec}"
                    for r in ladder)


@dataclass
class Move:
    """One rung change of a role: at its ``at_call``-th call, from one rung index to another, and why."""

    at_call: int
    from_rung: str
    to_rung: str
    reason: str  # "break" (the live rung broke the target) or "inside" (it held well inside for a while)

    @property
    def direction(self) -> str:
        return "up" if self.reason == "break" else "down"


@dataclass
class RoleState:
    """Where one (namespace, role) stands: its rung, its calls, per rung its estimate and back-off."""

    rung_index: int
    num_calls: int = 0
    calls_at_rung: int = 0  # calls since the role arrived at its current rung
    estimates: dict[str, RungEstimate] = field(default_factory=dict)  # by setting name (rungs and named methods)
    retry_after_call: dict[int, int] = field(default_factory=dict)  # rung index -> first call it may be tried again
    num_breaks: dict[int, int] = field(default_factory=dict)  # rung index -> times it broke the target
    moves: list[Move] = field(default_factory=list)


class LadderController:
    """Moves one role along the ladder from what the shadow references measured.

    - **Up** (safer) as soon as the live rung *breaks* the target: once it has ``min_samples`` samples, its
      window's mean first-token KL is above ``kl_max``, or its top-1 agreement is *confidently* below
      ``agreement_min`` (the agreement's upper bound under it), or the upper confidence bound of its mean KL is
      above ``kl_max`` and a full window could not bring it under; earlier, from ``early_break_samples`` samples
      on, when even the KL's lower bound is above ``kl_max`` (a clearly bad rung costs few live calls).
      The certificate waits for the window because of the floor of every valid bound (``kvrelay.quality.betting``):
      at 16 samples none certifies a mean above ~0.019 nats under 0.05, at 32 one up to ~0.035, so judging a rung
      on its bound at ``min_samples`` would refuse every rung between those whatever its samples show. While a
      rung's certificate is open (its bound over the target, its window not full, and a full window at its present
      mean KL and agreement rate certifiable by the guard's bounds: ``certificate_open``) the guard shadows every
      call at it (``wants_samples``), so meanwhile the rung is held to the unclipped mean KL of the very calls it
      ran (each call counted whole, as the target counts it), not to an estimate.
      The start rung (with ``trust_start``) is held to its window's mean KL (unclipped) instead of the upper
      bound: the shipped tables put it inside the target, and 16-32 samples cannot certify a mean KL much above
      0.02 nats under 0.05 with any bound valid for every law of the clipped KL (``kvrelay.quality.betting``); the
      mean still sends a role whose own traffic puts the start rung over the target up at ``min_samples``. Once
      the start rung broke for a role, it is trusted no more: the guard moving the role back to it holds it to
      its upper bound, as any rung.
      A rung that broke may not be tried again for ``hold_calls`` x 2^(times it broke) calls: a role whose cheap
      rung is bad stays up, trying it ever more rarely.
    - **Down** (cheaper) when the live rung has held for ``hold_calls`` calls, its KL upper bound is within
      ``margin`` x ``kl_max``, its agreement estimate at least ``agreement_min``, and the cheaper rung is not backed
      off. The cheaper rung then starts from fresh samples (its older ones are what made it break) and is
      shadowed on every call until it has ``first_calls_per_role`` of them.

    The agreement acts only when confidently bad because top-1 agreement is a coin flip on calls whose top two
    tokens are near-tied; KL is the graded signal and the one whose bound certifies a rung.
    """

    def __init__(self, config: QualityConfig) -> None:
        self.config = config
        self.ladder = config.ladder
        self.start_index = config.start_index

    def new_role(self) -> RoleState:
        return RoleState(rung_index=self.start_index)

    def estimate(self, state: RoleState, setting: str) -> RungEstimate:
        est = state.estimates.get(setting)
        if est is None:
            est = state.estimates[setting] = RungEstimate(self.config.window, self.config.kl_cap,
                                                          self.config.confidence)
        return est

    def breaks(self, est: RungEstimate, refuted_only: bool = False) -> bool:
        """The estimate breaks the target: from ``early_break_samples`` samples on when even its KL lower bound is
        over the target; from ``min_samples`` on when its agreement is confidently under the target or its window's
        mean KL, unclipped, is over it (``refuted_only``: only then), or when its KL upper bound is over the target
        and a full window could no longer certify it (``certificate_open``). While one still can, the guard measures
        every call at the rung (``wants_samples``), so the window's mean is the mean KL of the very calls the rung
        ran: each counted whole, as the target counts it (the clip is the bound's, not the target's)."""
        target = self.config.target
        if target is None or est.num_samples < self.config.early_break_samples:
            return False
        kl_lower, kl_upper = est.kl_bounds()
        if kl_lower > target.kl_max:
            return True  # confidently over the target already: no need to wait for min_samples
        if est.num_samples < self.config.min_samples:
            return False
        if est.agreement_upper() < target.agreement_min or est.kl_mean() > target.kl_max:
            return True
        if refuted_only or kl_upper <= target.kl_max:
            return False
        return not self.certificate_open(est)

    def certificate_open(self, est: RungEstimate) -> bool:
        """More samples can still certify the rung within its window, on both parts of the target: the window is not
        full, and a full window at its present mean KL and agreement rate could be certified by the guard's bounds
        (the KL bound of a full window with no spread at that clipped mean, ``RungEstimate.kl_upper_steady``,
        within the target, and the agreement's lower bound at that rate at or over it). At 16 samples the bound
        certifies no mean KL above ~0.016 nats under the default 0.05 target, at 32 none above ~0.033 (cap 0.25
        nats, confidence 0.9; no valid bound does better than ~0.019 and ~0.035): a rung asked for its certificate
        at 16 samples is refused whatever its samples show, one that a full window can still certify is not."""
        target, window = self.config.target, self.config.window
        return (0 < est.num_samples < window and est.kl_upper_steady(window) <= target.kl_max
                and est.agreement_lower_at(window) >= target.agreement_min)

    def well_inside(self, est: RungEstimate) -> bool:
        target = self.config.target
        if target is None or est.num_samples < self.config.min_samples:
            return False
        return (est.kl_upper() <= self.config.margin * target.kl_max
                and est.agreement_mean() >= target.agreement_min)

    def trusted(self, state: RoleState) -> bool:
        """The live rung is the start rung, trusted on the shipped tables' word until this role's own traffic broke
        it there; once it did, a return to it is a move like any other and must keep its KL upper bound under the
        target."""
        return (self.config.trust_start and state.rung_index == self.start_index
                and not state.num_breaks.get(self.start_index))

    def wants_samples(self, state: RoleState) -> bool:
        """The next call should be shadowed whatever the sample rate: the live rung is held to its KL upper bound
        (it is not the trusted start rung, nor the safest rung, which has nowhere to go), that bound is over the
        target, and a full window could still certify the rung (``certificate_open``)."""
        target = self.config.target
        if target is None or self.trusted(state) or state.rung_index == len(self.ladder) - 1:
            return False
        est = self.estimate(state, self.ladder[state.rung_index].name)
        return est.kl_upper() > target.kl_max and self.certificate_open(est)

    def after_sample(self, state: RoleState, setting: str) -> Move | None:
        """A sample of ``setting`` was recorded: move the role up when its live rung now breaks the target."""
        live = self.ladder[state.rung_index]
        if setting != live.name or not self.breaks(self.estimate(state, live.name), self.trusted(state)):
            return None
        if state.rung_index == len(self.ladder) - 1:
            return None  # the safest rung has nowhere to go; the snapshot shows it breaking
        broke = state.rung_index
        state.num_breaks[broke] = state.num_breaks.get(broke, 0) + 1
        state.retry_after_call[broke] = state.num_calls + self.config.hold_calls * 2 ** state.num_breaks[broke]
        return self._move(state, broke + 1, "break")

    def before_call(self, state: RoleState) -> Move | None:
        """A new call of the role: move it down when its live rung has held well inside the target for a while."""
        index = state.rung_index
        if index == 0 or state.calls_at_rung < self.config.hold_calls:
            return None
        if state.num_calls < state.retry_after_call.get(index - 1, 0):
            return None
        if not self.well_inside(self.estimate(state, self.ladder[index].name)):
            return None
        state.estimates.pop(self.ladder[index - 1].name, None)  # fresh evidence for the rung it tries again
        return self._move(state, index - 1, "inside")

    def _move(self, state: RoleState, to_index: int, reason: str) -> Move:
        move = Move(state.num_calls, self.ladder[state.rung_index].name, self.ladder[to_index].name, reason)
        state.rung_index, state.calls_at_rung = to_index, 0
        state.moves.append(move)
        return move
