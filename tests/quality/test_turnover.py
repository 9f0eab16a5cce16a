"""Role turnover: a tenant whose roles die before their warm-up is paced, one with long-lived roles is not, and one
tenant's conversations never pace another tenant."""

from __future__ import annotations

from kvrelay.cache.tenancy import tenant_of
from kvrelay.quality import QualityConfig, QualityGuard
from kvrelay.quality.turnover import JUDGED_NEW_ROLES, WINDOW_CALLS, RoleTurnover

WARM_UP = QualityConfig().first_calls_per_role


def _chains(guard: QualityGuard, namespaces: list[str], roles: tuple[str, ...], calls_per_role: int = 1) -> None:
    for namespace in namespaces:
        for role in roles:
            for _ in range(calls_per_role):
                guard.rung_for(namespace, role)


def test_the_tenant_is_the_api_keys_part_of_a_namespace():
    assert tenant_of("kabc/sdef") == "kabc"
    assert tenant_of("kabc") == "kabc"
    assert tenant_of("sdef") == "" and tenant_of("") == ""


def test_a_namespace_per_conversation_is_paced_once_it_has_shown_a_window_of_new_roles():
    guard = QualityGuard()
    roles = ("analyst", "answerer", "checker")
    num_before = -(-JUDGED_NEW_ROLES // len(roles)) - 1  # conversations with fewer new roles than judged
    _chains(guard, [f"s{i}" for i in range(num_before)], roles)
    assert not guard.paced("s-next")  # not judged yet: a fresh server's first tenants keep their warm-up
    _chains(guard, ["s-more"], roles)
    assert guard.paced("s-next") and guard.paced("")  # one call per role: every call is warm-up that never pays


def test_roles_called_again_and_again_keep_their_warm_up():
    guard = QualityGuard()
    _chains(guard, [""], ("analyst", "answerer", "checker"), calls_per_role=WINDOW_CALLS)
    assert not guard.paced("")
    many = [f"s{i}" for i in range(WARM_UP)]  # a tenant's many conversations, each long enough to judge its roles
    _chains(guard, many, ("agent",), calls_per_role=WARM_UP)
    assert not guard.paced("s0")
    shorter = [f"t{i}" for i in range(WARM_UP)]  # then conversations whose role lives half its warm-up
    _chains(guard, shorter, ("agent",), calls_per_role=WARM_UP // 2)
    turnover = guard.turnover
    assert turnover.calls_per_role("") < WARM_UP and guard.paced("")


def test_one_tenants_conversations_never_pace_another_tenant():
    guard = QualityGuard()
    _chains(guard, [f"kA/s{i}" for i in range(JUDGED_NEW_ROLES)], ("a", "b"))
    assert guard.paced("kA/s-new")
    assert not guard.paced("kB/s0") and not guard.paced("kB")
    _chains(guard, ["kB"], ("a", "b"), calls_per_role=50)
    assert not guard.paced("kB") and guard.paced("kA")


def test_a_guard_that_is_off_paces_nothing_and_the_estimate_reads_a_window_of_calls():
    guard = QualityGuard(QualityConfig(target=None))
    _chains(guard, [f"s{i}" for i in range(2 * WARM_UP)], ("a",))
    assert not guard.paced("s0")
    turnover = RoleTurnover(WARM_UP)
    for i in range(WINDOW_CALLS):
        turnover.observe("", i % 2 == 0)  # a new role every second call
    assert turnover.calls_per_role("") == 2.0 and turnover.short_lived("")
    for _ in range(WINDOW_CALLS - 2 * JUDGED_NEW_ROLES + 2):
        turnover.observe("", False)  # the old calls leave the window
    assert not turnover.short_lived("")  # fewer new roles in the window than are judged


def test_a_small_warm_up_does_not_make_a_tenants_own_agents_short_lived():
    """A tenant is judged only once it has shown ``JUDGED_NEW_ROLES`` new roles, whatever the warm-up: a team of a
    few agents starting at once is not a namespace per conversation."""
    guard = QualityGuard(QualityConfig(first_calls_per_role=2, min_samples=2, early_break_samples=2))
    _chains(guard, [""], tuple(f"agent{i}" for i in range(JUDGED_NEW_ROLES - 1)))
    assert not guard.paced("")
    _chains(guard, [""], ("one-more",))
    assert guard.paced("")
