"""kvcomm's learned state is bounded in bytes over all agents, fairly between tenants (``reuse.learned_budget``)."""

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import namespace_for, scoped_key
from kvrelay.errors import ConfigError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.learned_budget import LearnedBudget
from tests.helpers import generate, publish, tiny_lm

A, B = namespace_for("a1", None), namespace_for("b2", None)


def test_room_is_made_from_the_heaviest_tenant_least_recent_agent_first():
    budget = LearnedBudget(100)
    assert budget.set(scoped_key(B, "b-agent"), 30) == []
    assert budget.set(scoped_key(A, "a1"), 30) == []
    assert budget.set(scoped_key(A, "a2"), 30) == []
    budget.touch(scoped_key(A, "a1"))  # a2 is now A's least recent
    assert budget.set(scoped_key(A, "a3"), 30) == [scoped_key(A, "a2")]  # A holds 90: B's agent stays
    assert budget.set(scoped_key(A, "a1"), 60) == [scoped_key(A, "a3")]  # grown: A's other agent goes first
    assert budget.num_bytes == 90 and scoped_key(B, "b-agent") in budget
    assert budget.set(scoped_key(A, "huge"), 500) == [scoped_key(A, "a1"), scoped_key(A, "huge")]
    assert len(budget) == 1 and budget.num_bytes == 30


def test_a_bad_budget_is_refused():
    with pytest.raises(ConfigError, match="positive number of bytes"):
        LearnedBudget(0)


@pytest.fixture(scope="module")
def setup():
    """A tiny model, a store holding an upstream output, a downstream call quoting it, and one agent's bytes."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    up = generate(lm, list(range(20, 40)), "full", store, SamplingConfig(max_new_tokens=8), keep_cache=True)
    publish(store, "up", up, lm)
    call = CallInput([1, 2, 3] + up.output_ids + [9, 8], [SpanRef(3, 11, "up", 20, "output", "up")], name="probe")
    probe = get_method("kvcomm")
    generate(lm, call, probe, store, SamplingConfig(max_new_tokens=1))
    return lm, store, call, probe.budget.num_bytes


def test_kvcomm_keeps_a_bounded_number_of_agents_in_one_long_lived_namespace(setup):
    """One namespace (the default one), a new agent name with every call: templates and pools stay under the bound
    and the most recent agent's anchors are kept."""
    lm, store, call, one_agent_bytes = setup
    method = get_method("kvcomm")
    method.budget = LearnedBudget(3 * one_agent_bytes)
    for i in range(12):
        agent = CallInput(call.prompt_ids, call.refs, name=f"agent-{i}")
        generate(lm, agent, method, store, SamplingConfig(max_new_tokens=1))
        assert method.budget.num_bytes <= 3 * one_agent_bytes
    assert sorted(method.templates) == ["agent-10", "agent-11", "agent-9"]
    assert sorted(method.pools) == ["agent-10/up", "agent-11/up", "agent-9/up"]


def test_an_agent_reusing_its_anchors_is_kept_over_an_idle_one(setup):
    lm, store, call, one_agent_bytes = setup
    method = get_method("kvcomm[warmup=1]")
    method.budget = LearnedBudget(2 * one_agent_bytes)
    for name in ("first", "second", "first", "third"):
        out = generate(lm, CallInput(call.prompt_ids, call.refs, name=name), method, store,
                       SamplingConfig(max_new_tokens=1))
    assert out.stats.fallback is not None  # third: learned
    assert sorted(method.templates) == ["first", "third"]  # first's reuse (no new anchor) made second the idle one
