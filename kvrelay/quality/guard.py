"""The quality guard: per (namespace, role), which rung a call runs at, which calls are shadowed, what was measured.

Everything is keyed by namespace first: a role's state lives under its namespace, so one tenant's observations
never move another tenant's rung, and ``snapshot(namespace)`` shows that namespace's roles only. The aggregates
for ``/metrics`` are counts over every namespace and name no namespace or role.

It holds at most ``MAX_ROLES`` roles per tenant (the API key's part of a namespace), the least recently called out
first: a client that salts each conversation makes new roles without end, and evicts only its own tenant's. A role
evicted starts over (at the start rung, its first calls shadowed) if it comes back.

The guard is plain bookkeeping, deterministic and not thread-safe (the server wraps it in one lock).
Call protocol per live request of a role: ``rung_for`` once when the request picks its method, ``should_shadow``
once when its first token is out; for a shadowed request, ``record`` once its comparison with ``full`` is done.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, OrderedDict
from collections.abc import Callable

from kvrelay.cache.tenancy import tenant_of
from kvrelay.errors import ConfigError
from kvrelay.quality.config import QualityConfig
from kvrelay.quality.ladder import LadderController, Move, RoleState, Rung, check_ladder
from kvrelay.quality.turnover import RoleTurnover

MAX_ROLES = 10_000  # (namespace, role) states kept per tenant, least recently called out first
#: the setting a request's own method is measured under: ``requested:SPEC``. A rung name is a word (no ``:``), so a
#: request that names ``relay`` is never counted as the rung ``relay``: its samples cannot move the role, nor stand
#: in the estimate a rung is judged on (a ladder's ``relay=relay[...]`` is not the plain ``relay`` it named)
REQUESTED_PREFIX = "requested:"
# method specs a role's requests named that are estimated at once (least recently named out first): a client
# naming a new spec with every call grew the role's state without end
MAX_REQUESTED_SETTINGS = 16


def requested_setting(method_spec: str) -> str:
    """The setting under which the calls of a request that named ``method_spec`` itself are estimated."""
    return REQUESTED_PREFIX + method_spec


def _check_measure(name: str, value: object, must_be_finite: bool) -> None:
    """A ConfigError naming ``name`` unless ``value`` is a number >= 0 (or, unless ``must_be_finite``, non-finite)."""
    if isinstance(value, (int, float)):
        if not math.isfinite(value) and not must_be_finite:
            return
        if math.isfinite(value) and value >= 0:
            return
    raise ConfigError(f"quality record: {name} must be a number >= 0, got {value!r}")


class QualityGuard:
    """Rungs per (namespace, role) from a synthetic or live stream of shadow comparisons."""

    def __init__(self, config: QualityConfig | None = None, ladder: tuple[Rung, ...] | None = None) -> None:
        config = config or QualityConfig()
        if ladder is not None:
            config = dataclasses.replace(config, ladder=check_ladder(ladder))
        self.config = config
        self.ladder = config.ladder
        self.controller = LadderController(config)
        self._roles: dict[str, dict[str, RoleState]] = {}  # namespace -> role -> state
        self._num_offers: dict[tuple[str, str], int] = {}  # should_shadow calls per role (the cadence's clock)
        self._offers_at_rung: dict[tuple[str, str], int] = {}
        # per role, should_shadow calls per requested setting: a request's own method has its own warm-up and
        # cadence, so such calls never use up the first calls the role's rung is shadowed on
        self._requested_offers: dict[tuple[str, str], dict[str, int]] = {}
        # per tenant, its roles by last use: the eviction order (one tenant's churn never evicts another's roles)
        self._recent: dict[str, OrderedDict[tuple[str, str], None]] = {}
        self.turnover = RoleTurnover(config.first_calls_per_role)
        self.num_samples = 0
        self.num_shadowed = 0
        self.num_unaffordable = 0  # calls the rule wanted shadowed that the server's shadow share did not draw
        self.shadow_cost_ms = 0.0
        self.moves = Counter()  # "up" / "down" -> count

    @property
    def enabled(self) -> bool:
        return self.config.target is not None

    def _state(self, namespace: str, role: str) -> RoleState:
        roles = self._roles.setdefault(namespace, {})
        state = roles.get(role)
        key = (namespace, role)
        if state is None:
            state = roles[role] = self.controller.new_role()
            recent = self._recent.setdefault(tenant_of(namespace), OrderedDict())
            recent[key] = None
            if len(recent) > MAX_ROLES:
                self._evict(*recent.popitem(last=False)[0])
        else:
            self._recent[tenant_of(namespace)].move_to_end(key)
        return state

    def _evict(self, namespace: str, role: str) -> None:
        roles = self._roles[namespace]
        del roles[role]
        if not roles:
            del self._roles[namespace]
        self._num_offers.pop((namespace, role), None)
        self._offers_at_rung.pop((namespace, role), None)
        self._requested_offers.pop((namespace, role), None)

    @property
    def num_roles(self) -> int:
        return sum(len(recent) for recent in self._recent.values())

    def paced(self, namespace: str) -> bool:
        """Whether this namespace's shadows are taken only on the server's shadow share: its tenant's roles do not
        live through their warm-up (``RoleTurnover``)."""
        return self.enabled and self.turnover.short_lived(namespace)

    def _moved(self, namespace: str, role: str, move: Move | None) -> None:
        """Count a move; a rung the role arrives at is shadowed on every call (``first_calls_per_role``) unless it
        already has its samples (a safer rung the role came down from: its estimate still stands)."""
        if move is None:
            return
        self.moves[move.direction] += 1
        state = self._state(namespace, role)
        known = self.controller.estimate(state, move.to_rung).num_samples >= self.config.min_samples
        self._offers_at_rung[(namespace, role)] = self.config.first_calls_per_role if known else 0

    def rung_for(self, namespace: str, role: str, requested: bool = False) -> Rung:
        """The rung a new call of (namespace, role) runs at; counts the call (a role may step down here).
        ``requested``: the call runs a method it named itself; it counts among the role's calls but not as a call
        at its rung (``hold_calls``), and never moves the role."""
        if not self.enabled:
            return self.ladder[self.config.start_index]
        self.turnover.observe(namespace, role not in self._roles.get(namespace, {}))
        state = self._state(namespace, role)
        if not requested:
            self._moved(namespace, role, self.controller.before_call(state))
            state.calls_at_rung += 1
        state.num_calls += 1
        return self.ladder[state.rung_index]

    def should_shadow(self, namespace: str, role: str, affordable: bool | Callable[[], bool] = True,
                      setting: str | None = None) -> bool:
        """Whether this call of (namespace, role) also runs ``full`` as a reference: every one of the first
        ``first_calls_per_role`` calls of the role and at each rung it arrives at without samples, then one in
        ``1 / sample_rate`` (by the role's own count of calls, no random numbers), and every call at a rung whose
        certificate is open (``LadderController.wants_samples``). Never with the guard off.

        ``affordable`` False (a ``paced`` namespace's call the server's shadow share did not draw,
        kvrelay.server.shadow_pacer): a call the rule wants is not shadowed and not counted, so the role's first
        calls and its cadence wait for a call that is drawn (counted in ``num_unaffordable``). A callable is asked
        only for a call the rule wants: the pacer's draw, whose rate is learned over the calls it is asked for.

        ``setting``: what the call runs (``requested_setting`` for a method the request named; None or a rung name:
        the role's rung). A requested setting has its own count, by the same rule (its first calls, then the
        cadence), so calls that name a method never use up the shadows of the role's rung."""
        if not self.enabled:
            return False
        key = (namespace, role)
        state = self._state(namespace, role)
        every = self.config.sample_every
        if setting is not None and setting.startswith(REQUESTED_PREFIX):
            counts = self._requested_counts(key, state, setting)
            num = counts.get(setting, 0)
            shadow = num < self.config.first_calls_per_role or (every > 0 and num % every == 0)
        else:
            at_rung = self._offers_at_rung.get(key, 0)
            num = self._num_offers.get(key, 0)
            shadow = (at_rung < self.config.first_calls_per_role or (every > 0 and num % every == 0)
                      or self.controller.wants_samples(state))
        if shadow and not (affordable() if callable(affordable) else affordable):
            self.num_unaffordable += 1
            return False
        if setting is not None and setting.startswith(REQUESTED_PREFIX):
            counts[setting] = num + 1
        else:
            self._offers_at_rung[key] = at_rung + 1
            self._num_offers[key] = num + 1
        self.num_shadowed += shadow
        return shadow

    def _requested_counts(self, key: tuple[str, str], state: RoleState, setting: str) -> dict[str, int]:
        """The role's requested settings' call counts, ``setting`` the most recent; past MAX_REQUESTED_SETTINGS
        the least recently named one is forgotten with its estimate."""
        counts = self._requested_offers.setdefault(key, {})
        if setting in counts:
            counts[setting] = counts.pop(setting)  # most recent last
        elif len(counts) >= MAX_REQUESTED_SETTINGS:
            oldest = next(iter(counts))
            del counts[oldest]
            state.estimates.pop(oldest, None)
        return counts

    def record(self, namespace: str, role: str, rung_name: str, first_token_kl: float, top1_agree: bool,
               continuation_kl: float | None = None, shadow_cost_ms: float = 0.0) -> None:
        """One shadow comparison of a call of (namespace, role) run under ``rung_name`` (a rung, or the method
        spec a request named itself: estimated, never moving the role). The role may step up here."""
        if not self.enabled:
            return
        # a non-finite KL (nan logits, say) is a comparison that broke: the estimate counts it as the worst value,
        # the cap; refusing it here would raise on the server's worker thread, which fails every running request
        for name, value, must_be_finite in (("first_token_kl", first_token_kl, False),
                                            ("continuation_kl", continuation_kl, False),
                                            ("shadow_cost_ms", shadow_cost_ms, True)):
            if value is not None or name != "continuation_kl":
                _check_measure(name, value, must_be_finite)
        self.num_samples += 1
        self.shadow_cost_ms += float(shadow_cost_ms)
        if role not in self._roles.get(namespace, {}):  # evicted while its shadow ran: it starts over if it comes back
            return
        if rung_name.startswith(REQUESTED_PREFIX) and rung_name not in self._requested_offers.get((namespace, role),
                                                                                                  {}):
            return  # a requested setting forgotten while its shadow ran
        state = self._state(namespace, role)
        self.controller.estimate(state, rung_name).add(float(first_token_kl), top1_agree, continuation_kl)
        self._moved(namespace, role, self.controller.after_sample(state, rung_name))

    def snapshot(self, namespace: str) -> dict:
        """One namespace's roles: rung, calls, per setting its estimates with bounds, and the moves so far."""
        roles = {}
        for role, state in sorted(self._roles.get(namespace, {}).items()):
            roles[role] = {
                "rung": self.ladder[state.rung_index].name,
                "method": self.ladder[state.rung_index].method_spec,
                "num_calls": state.num_calls,
                "estimates": {name: est.to_dict() for name, est in sorted(state.estimates.items())},
                "moves": [{"at_call": m.at_call, "from": m.from_rung, "to": m.to_rung, "reason": m.reason}
                          for m in state.moves],
            }
        return {"target": None if self.config.target is None else {
                    "kl_max": self.config.target.kl_max, "agreement_min": self.config.target.agreement_min},
                "ladder": [{"name": r.name, "method": r.method_spec} for r in self.ladder],
                "sample_rate": self.config.sample_rate, "roles": roles}

    def aggregates(self) -> dict:
        """Counts over every namespace for ``/metrics``: no namespace, no role named."""
        per_rung = Counter({r.name: 0 for r in self.ladder})
        for roles in self._roles.values():
            for state in roles.values():
                per_rung[self.ladder[state.rung_index].name] += 1
        return {"rung_moves": {"up": self.moves["up"], "down": self.moves["down"]},
                "roles_per_rung": dict(per_rung), "num_samples": self.num_samples,
                "num_shadowed": self.num_shadowed, "num_unaffordable": self.num_unaffordable,
                "num_roles": self.num_roles,
                "shadow_cost_ms": round(self.shadow_cost_ms, 3)}
