"""The quality guard over HTTP (random:tiny, a real in-process server): each tenant sees only its own roles at
``GET /v1/kvrelay/quality``, ``/metrics`` holds aggregates that name no tenant or role, each response carries its
role's rung, and one tenant's traffic never changes another tenant's rung or estimates."""

from __future__ import annotations

import httpx
import pytest

from kvrelay.quality import QualityConfig, QualityTarget
from kvrelay.server.context import MAX_AGENT_CHARS, digest
from kvrelay.server.protocol import MAX_SALT_CHARS
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

KEYS = frozenset({"key-a", "key-b"})
METRICS_KEY = "metrics-secret"
ROLE = "planner"  # the same agent name in both tenants
# every call shadowed, judged after 2 samples, a cheaper rung tried after 3 calls, and (KL clipped at the target, a
# margin of 1) a rung at zero KL certified at once: the ladder moves within a few calls of a test
CONFIG = QualityConfig(target=QualityTarget(), sample_rate=1.0, first_calls_per_role=2, window=4, min_samples=2,
                       early_break_samples=2, hold_calls=3, margin=1.0, kl_cap_factor=1.0)


def _live(**settings) -> LiveServer:
    return LiveServer(api_keys=KEYS, metrics_key=METRICS_KEY, quality=CONFIG, **settings)


def _ask(srv: LiveServer, key: str, text: str, role: str = ROLE, method: str | None = None) -> dict:
    """One chat call as agent ``role``; its ``kvrelay`` object, once its shadow (if any) is recorded."""
    r = srv.client(key).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You plan the work of the team, step by step."},
                               {"role": "user", "content": text}],
        max_tokens=6, temperature=0, extra_headers={"x-kvrelay-agent": role},
        extra_body={"kvrelay": {"method": method}} if method else None)
    srv.wait_until(lambda: srv.worker.shadows.num_pending == 0, "the shadow reference recorded")
    return r.model_extra["kvrelay"]


def _quality(srv: LiveServer, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{srv.url}/v1/kvrelay/quality", headers=headers, timeout=10)


def test_each_tenant_sees_only_its_own_roles_and_metrics_name_none():
    srv = _live()
    try:
        ext = _ask(srv, "key-a", "Plan a trip to the coast.")
        assert ext["quality"] == {"role": ROLE, "rung": ext["method"]}  # the default ladder's rungs are named so
        _ask(srv, "key-a", "Plan a birthday party.", role="reviewer")
        _ask(srv, "key-b", "Plan a product launch.")
        a, b = _quality(srv, "key-a").json(), _quality(srv, "key-b").json()
        assert a["enabled"] and sorted(a["roles"]) == [ROLE, "reviewer"]
        assert sorted(b["roles"]) == [ROLE]
        assert a["roles"][ROLE]["num_calls"] == 1 and b["roles"][ROLE]["num_calls"] == 1
        assert sum(e["num_samples"] for e in b["roles"][ROLE]["estimates"].values()) == 1
        assert _quality(srv, None).status_code == 401
        assert _quality(srv, "key-c").json()["error"]["code"] == "invalid_api_key"
        salted = httpx.get(f"{srv.url}/v1/kvrelay/quality", params={"cache_salt": "s1"},
                           headers={"Authorization": "Bearer key-a"}, timeout=10).json()
        assert salted["roles"] == {}  # a cache_salt is a namespace of its own

        text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=10).text
        samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                   if line.startswith("kvrelay_quality_")}
        assert samples["kvrelay_quality_shadow_runs_total"] == 3
        assert samples["kvrelay_quality_shadow_compute_seconds_total"] > 0
        assert sum(v for k, v in samples.items() if k.startswith("kvrelay_quality_roles{")) == 3
        assert not any(k.startswith("kvrelay_quality_shadow_lessons") for k in samples)  # no learning rung
        for secret in (ROLE, "reviewer", digest("key-a"), digest("key-b"), "key-a"):
            assert secret not in text  # no role, tenant or key named in the operator's page
    finally:
        srv.stop()


def test_the_route_says_when_the_guard_is_off():
    srv = LiveServer()  # create_app's default: no guard
    try:
        assert _quality(srv, None).json() == {"object": "kvrelay.quality", "enabled": False}
        r = srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
        assert "quality" not in r.model_extra["kvrelay"] and r.model_extra["kvrelay"]["method"] == "epic"
    finally:
        srv.stop()


NUM_B_CALLS = 6  # CONFIG moves B's role after its 4th call: two calls on the new rung follow


def _tenant_b_run(with_tenant_a: bool) -> dict:
    """Tenant B's calls as one role, each after its shadow is recorded; tenant A (same role name) calls between
    them in one run only. B's snapshot at the end."""
    srv = _live()
    try:
        for i in range(NUM_B_CALLS):
            if with_tenant_a:  # A's own traffic: other prompts, more calls, a method named for some
                _ask(srv, "key-a", f"Plan the next {i + 3} weeks of a garden, in detail.")
                _ask(srv, "key-a", "Plan a meal.", method="naive")
            _ask(srv, "key-b", f"Plan step {i} of moving house.")
        if with_tenant_a:
            a_calls = _quality(srv, "key-a").json()["roles"][ROLE]["num_calls"]
            assert a_calls == 2 * NUM_B_CALLS  # A's calls reached the guard
        return _quality(srv, "key-b").json()
    finally:
        srv.stop()


def test_tenant_b_rung_and_estimates_are_the_same_whether_or_not_tenant_a_sent_traffic():
    alone = _tenant_b_run(with_tenant_a=False)
    beside_a = _tenant_b_run(with_tenant_a=True)
    role = alone["roles"][ROLE]
    assert role["num_calls"] == NUM_B_CALLS and role["moves"]  # the ladder moved: the comparison covers a move
    assert beside_a == alone


@pytest.mark.parametrize("salt", ["", "   ", "s" * (MAX_SALT_CHARS + 1)])  # the last: no request's salt
def test_a_bad_cache_salt_is_a_clear_400(salt):
    srv = _live()
    try:
        r = httpx.get(f"{srv.url}/v1/kvrelay/quality", params={"cache_salt": salt},
                      headers={"Authorization": "Bearer key-a"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    finally:
        srv.stop()


def test_an_agent_name_over_its_bound_is_a_clear_400_on_every_route():
    # the guard keeps the name per role and echoes it in every response: a long one is refused, not kept
    srv = _live()
    try:
        for route, body in (("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("completions", {"prompt": "hi"})):
            for agent, status in (("a" * MAX_AGENT_CHARS, 200), ("a" * (MAX_AGENT_CHARS + 1), 400)):
                r = httpx.post(f"{srv.url}/v1/{route}", json={"model": MODEL, "max_tokens": 1, **body},
                               headers={"Authorization": "Bearer key-a", "x-kvrelay-agent": agent}, timeout=30)
                assert r.status_code == status, (route, r.text)
                if status == 400:
                    assert r.json()["error"]["param"] == "x-kvrelay-agent"
                else:
                    assert r.json()["kvrelay"]["quality"]["role"] == agent
            srv.wait_until(lambda: srv.worker.shadows.num_pending == 0, "the shadow references recorded")
        assert sorted(_quality(srv, "key-a").json()["roles"]) == ["a" * MAX_AGENT_CHARS]
    finally:
        srv.stop()
