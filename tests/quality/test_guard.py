"""The guard's sampling cadence, its record checks and its aggregates."""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.errors import ConfigError
from kvrelay.quality import QualityConfig, QualityGuard, Rung
from kvrelay.quality.guard import requested_setting
from kvrelay.server.quality_serving import ServedGuard


def shadows(g: QualityGuard, num_calls: int, namespace: str = "ns", role: str = "r") -> list[int]:
    out = []
    for i in range(num_calls):
        g.rung_for(namespace, role)
        if g.should_shadow(namespace, role):
            out.append(i)
    return out


def test_every_early_call_then_one_in_k():
    g = QualityGuard(dataclasses.replace(QualityConfig(), first_calls_per_role=5, min_samples=4,
                                         early_break_samples=2, sample_rate=0.1))
    assert shadows(g, 45) == [0, 1, 2, 3, 4, 10, 20, 30, 40]  # nothing recorded: no move, the cadence alone
    other = shadows(g, 12, role="other")  # each role has its own count
    assert other == [0, 1, 2, 3, 4, 10]


def test_sample_rate_zero_shadows_only_the_first_calls():
    g = QualityGuard(dataclasses.replace(QualityConfig(), sample_rate=0.0))
    assert shadows(g, 100) == list(range(g.config.first_calls_per_role))


def test_a_rung_reached_without_samples_is_shadowed_on_every_call_again():
    cfg = dataclasses.replace(QualityConfig(), start="naive", sample_rate=0.0)
    g = QualityGuard(cfg)
    for _ in range(cfg.early_break_samples):
        rung = g.rung_for("ns", "r")
        assert g.should_shadow("ns", "r")
        g.record("ns", "r", rung.name, 5.0, False, None, 1.0)
    assert g.rung_for("ns", "r").name == "relay"
    assert all(g.should_shadow("ns", "r") for _ in range(cfg.first_calls_per_role))
    assert not g.should_shadow("ns", "r")


@pytest.mark.parametrize("kwargs", [{"first_token_kl": -0.1}, {"first_token_kl": "0.1"}, {"shadow_cost_ms": -1.0},
                                    {"shadow_cost_ms": float("nan")}, {"continuation_kl": -2.0}])
def test_bad_records_are_refused_by_name(kwargs):
    g = QualityGuard()
    args = {"first_token_kl": 0.0, "top1_agree": True, "continuation_kl": None, "shadow_cost_ms": 0.0, **kwargs}
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        g.record("ns", "r", "relay", **args)
    assert g.aggregates()["num_samples"] == 0


@pytest.mark.parametrize("broken", [float("nan"), float("inf")])
def test_a_non_finite_kl_counts_as_the_cap_and_never_raises(broken):
    """nan logits give a nan KL: recorded on the server's worker thread, a raise there fails every running request,
    so the guard counts it as the worst value instead, and the role steps up as on any clearly bad rung."""
    cfg = QualityConfig()
    g = QualityGuard(cfg)
    for _ in range(cfg.early_break_samples):
        rung = g.rung_for("ns", "r")
        g.record("ns", "r", rung.name, broken, float("nan"), broken, 1.0)
    assert g.aggregates()["num_samples"] == cfg.early_break_samples
    assert g.rung_for("ns", "r").name == "prefix"  # three calls at the cap: the KL lower bound is over the target
    relay = g.snapshot("ns")["roles"]["r"]["estimates"]["relay"]
    assert relay["first_token_kl"]["mean"] == pytest.approx(cfg.kl_cap)
    assert relay["top1_agreement"]["mean"] == 0.0  # a broken agreement is a disagreement


def test_a_custom_ladder_and_aggregates():
    ladder = (Rung("cheap", "naive"), Rung("safe", "full"))
    g = QualityGuard(QualityConfig(), ladder=ladder)
    assert g.rung_for("ns", "r") == Rung("safe", "full")
    g.record("ns", "r", "safe", 0.0, True, None, 12.5)
    agg = g.aggregates()
    assert agg == {"rung_moves": {"up": 0, "down": 0}, "roles_per_rung": {"cheap": 0, "safe": 1},
                   "num_samples": 1, "num_shadowed": 0, "num_unaffordable": 0, "num_roles": 1,
                   "shadow_cost_ms": 12.5}
    snap = g.snapshot("ns")
    assert snap["ladder"] == [{"name": "cheap", "method": "naive"}, {"name": "safe", "method": "full"}]
    assert snap["roles"]["r"]["estimates"]["safe"]["num_samples"] == 1


def test_the_pacers_draw_is_asked_only_for_a_call_the_rule_wants():
    """A callable ``affordable`` (the server's pacer, which learns its rate over the calls it is asked for) is asked
    for the role's warm-up and its cadence's calls only, not for the calls between."""
    cfg = QualityConfig()
    g = QualityGuard(cfg)
    asked = []
    every = cfg.sample_every
    num_calls = cfg.first_calls_per_role + 2 * every
    taken = [g.should_shadow("ns", "r", lambda: asked.append(1) or True) for _ in range(num_calls)]
    assert len(asked) == sum(taken) == cfg.first_calls_per_role + 2
    assert not g.should_shadow("ns", "r", lambda: False)  # a callable answering False: not counted, as False is
    assert g.aggregates()["num_unaffordable"] == 0  # the call between the cadence's is not wanted, not unaffordable


def test_a_call_the_share_cannot_pay_for_is_not_shadowed_and_the_role_waits_for_one_it_can():
    """``affordable`` False (the server's shadow share is spent): a call the rule wants is neither shadowed nor
    counted, so a role still gets its first calls' samples and its cadence, from the calls that can be."""
    cfg = QualityConfig()
    g = QualityGuard(cfg)
    assert not g.should_shadow("ns", "r", affordable=False)
    assert not g.should_shadow("ns", "r", affordable=False)
    assert (g.aggregates()["num_unaffordable"], g.aggregates()["num_shadowed"]) == (2, 0)
    assert all(g.should_shadow("ns", "r") for _ in range(cfg.first_calls_per_role))  # the whole window, still
    every = cfg.sample_every
    # the calls the cadence does not want count the same, affordable or not: the next wanted call is the every-th
    assert not any(g.should_shadow("ns", "r", affordable=False) for _ in range(every - cfg.first_calls_per_role))
    assert not g.should_shadow("ns", "r", affordable=False)  # wanted, unaffordable: not counted
    assert g.should_shadow("ns", "r")  # so the next affordable call is the one shadowed
    assert (g.aggregates()["num_unaffordable"], g.aggregates()["num_shadowed"]) == (3, cfg.first_calls_per_role + 1)


def test_the_guard_keeps_at_most_max_roles_the_least_recently_called_out_first(monkeypatch):
    from kvrelay.quality import guard as guard_module

    monkeypatch.setattr(guard_module, "MAX_ROLES", 3)
    g = QualityGuard()
    for namespace in ("s1", "s2", "s3"):
        g.rung_for(namespace, "r")
        g.should_shadow(namespace, "r")
    g.rung_for("s1", "r")  # s1 is the most recently called now
    g.rung_for("s4", "r")  # a fourth role: s2's goes
    assert g.num_roles == 3 and g.aggregates()["num_roles"] == 3
    assert g.snapshot("s2")["roles"] == {} and set(g.snapshot("s1")["roles"]) == {"r"}
    assert ("s2", "r") not in g._num_offers and ("s2", "r") not in g._offers_at_rung
    assert g.snapshot("s1")["roles"]["r"]["num_calls"] == 2
    g.record("s2", "r", "relay", 0.0, True)  # its shadow ended after it left: counted, the role not brought back
    assert g.num_roles == 3 and g.snapshot("s2")["roles"] == {} and set(g.snapshot("s3")["roles"]) == {"r"}
    assert g.aggregates()["num_samples"] == 1
    assert g.should_shadow("s2", "r")  # a role that comes back starts over: its first calls shadowed


def test_one_tenants_new_roles_never_evict_another_tenants(monkeypatch):
    """The cap is per tenant: a salting tenant's churn evicts its own roles only, so another tenant's rung and
    estimates stay where its own traffic put them."""
    from kvrelay.quality import guard as guard_module

    monkeypatch.setattr(guard_module, "MAX_ROLES", 3)
    g = QualityGuard()
    for _ in range(3):
        g.rung_for("kB", "agent")
        g.record("kB", "agent", g.rung_for("kB", "agent").name, 0.5, False)  # clearly bad: B's role steps up
    rung_b = g.snapshot("kB")["roles"]["agent"]["rung"]
    assert rung_b != QualityConfig().start
    for i in range(20):  # tenant A: a new namespace per conversation
        g.rung_for(f"kA/s{i}", "analyst")
    assert g.snapshot("kB")["roles"]["agent"]["rung"] == rung_b
    assert g.num_roles == 3 + 1


def test_a_request_naming_its_rungs_method_is_measured_apart_and_never_moves_the_role():
    # the server's path: the request names "relay", the very name of the rung its role is at
    served = ServedGuard(QualityGuard(QualityConfig()))
    for _ in range(QualityConfig().min_samples):
        method, tag = served.pick("ns", "r", "relay", "epic")
        assert method == "relay" and tag.rung == "relay"
        assert served.should_shadow("ns", "r", True, tag.measured_as)
        served.record("ns", "r", tag.measured_as, 1.0, False, 1.0, 1.0)  # clearly bad: a rung would break
    role = served.snapshot("ns")["roles"]["r"]
    assert role["rung"] == "relay" and role["moves"] == []
    assert set(role["estimates"]) == {requested_setting("relay")}  # the rung's own estimate is untouched


def test_calls_naming_a_method_do_not_use_up_the_warm_up_of_the_roles_rung():
    cfg = QualityConfig()
    g = QualityGuard(cfg)
    for _ in range(cfg.first_calls_per_role):  # a client that names its method: its own warm-up, all shadowed
        g.rung_for("ns", "r", requested=True)
        assert g.should_shadow("ns", "r", True, requested_setting("full"))
    assert g._roles["ns"]["r"].calls_at_rung == 0  # not calls at the rung: they bring no cheaper rung's trial nearer
    for _ in range(cfg.first_calls_per_role):  # the rung's own first calls are all shadowed still
        rung = g.rung_for("ns", "r")
        assert g.should_shadow("ns", "r", True, rung.name)


def test_a_role_keeps_a_bounded_number_of_requested_settings():
    """A client naming a new method spec with every call: the role keeps the most recently named ones' counts and
    estimates only (they grew without end), and a shadow of a forgotten one that lands later adds nothing."""
    from kvrelay.quality.guard import MAX_REQUESTED_SETTINGS

    g = QualityGuard(QualityConfig())
    specs = [requested_setting(f"relay[keep_share={k / 1000}]") for k in range(1, MAX_REQUESTED_SETTINGS + 2)]
    for spec in specs[:-1]:
        g.rung_for("ns", "r", requested=True)
        assert g.should_shadow("ns", "r", True, spec)
        g.record("ns", "r", spec, 0.01, True)
    g.should_shadow("ns", "r", True, specs[0])  # named again: now the most recent
    g.should_shadow("ns", "r", True, specs[-1])  # one more: the least recently named (specs[1]) is forgotten
    g.record("ns", "r", specs[1], 0.01, True)  # its shadow landing late
    estimates = g._roles["ns"]["r"].estimates
    assert len(estimates) == MAX_REQUESTED_SETTINGS - 1 and specs[1] not in estimates and specs[0] in estimates
    assert len(g._requested_offers[("ns", "r")]) == MAX_REQUESTED_SETTINGS
