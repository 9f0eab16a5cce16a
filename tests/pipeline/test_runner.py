"""The runner: spliced ids equal the stored spans' ids, positions right, pins released after the last reader."""

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.errors import ContextLengthError
from kvrelay.pipeline.runner import PipelineRunner, agent_role, render_messages, span_consumers
from kvrelay.pipeline.spec import PipelineSpec
from kvrelay.reuse import role_key
from tests.helpers import tiny_lm

SPEC = PipelineSpec.from_dict({"inputs": ["q"], "agents": [
    {"name": "a", "system": "S", "user": "Q: {q}", "max_new_tokens": 5},
    {"name": "b", "user": "Q: {q} A: {a}", "max_new_tokens": 4},
    {"name": "c", "user": "{a} and {b}", "max_new_tokens": 3},
]})


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama2")


def test_span_consumers_include_input_readers():
    assert span_consumers(SPEC) == {"a": ["b", "c"], "b": ["c"], "c": []}


def test_refs_point_at_the_exact_ids_in_upstream_spans(lm):
    store = KVStore(1 << 30)
    runner = PipelineRunner(Engine(lm, store), SPEC)
    pins = {}

    def before(agent, call, position):
        pins[agent.name] = {n: store.is_pinned(runner.span_id(n)) for n in "abc" if runner.span_id(n) in store}

    done = runner.run({"q": "what is 2+2?"}, "full", before_call=before)
    assert [r.kind for r in done["b"].call.refs] == ["input", "output"]
    assert [r.kind for r in done["c"].call.refs] == ["output", "output"]
    for res in done.values():
        for ref in res.call.refs:
            span = store.get(ref.span_id)
            assert span.token_ids[ref.src_start : ref.src_start + ref.num_tokens] == \
                tuple(res.call.prompt_ids[ref.start : ref.end])
    out_a = done["a"].output.output_ids
    ref_a = done["c"].call.refs[0]
    assert done["c"].call.prompt_ids[ref_a.start : ref_a.end] == out_a  # spliced as generated
    assert ref_a.src_start == len(done["a"].output.prompt_ids)  # right after a's prompt in its span
    assert pins == {"a": {}, "b": {"a": True}, "c": {"a": True, "b": True}}
    # each call carries its agent's role (its system prompt's key; none without one)
    assert [done[n].call.role for n in "abc"] == [role_key("S"), "", ""] and role_key("S") != role_key("T")
    assert not any(store.is_pinned(runner.span_id(n)) for n in "abc")  # all readers done
    runner.drop_spans()
    assert len(store) == 0


def test_an_agent_s_role_is_the_system_message_a_client_sends():
    spec = PipelineSpec.from_dict({"inputs": ["q"], "agents": [
        {"name": "a", "system": 'Answer as {{"x": 1}}.', "user": "{q}"},
        {"name": "b", "system": "Check {a}.", "user": "{q}"}]})
    a, b = spec.agents
    sent = 'Answer as {"x": 1}.'
    assert agent_role(a) == role_key(sent) and render_messages(a)[0]["content"] == sent
    assert agent_role(b) == ""  # its text changes with a's output: no fixed role


def test_a_failing_call_names_its_agent_and_the_calls_before_it_are_reported(lm):
    spec = PipelineSpec.from_dict({"inputs": ["q"], "agents": [
        {"name": "a", "user": "{q}", "max_new_tokens": 2},
        {"name": "b", "user": "{q} {a}", "max_new_tokens": 10**7},  # past any context length
    ]})
    seen = []
    with pytest.raises(ContextLengthError, match=r"^agent 'b': prompt of \d+ tokens \+ 10000000 new tokens"):
        PipelineRunner(Engine(lm, KVStore(1 << 30)), spec).run({"q": "hi"}, "full", progress=seen.append)
    assert [(r.agent, r.output.stats.num_generated_tokens) for r in seen] == [("a", 2)]
