"""Pipeline specs: validation errors name the agent and the problem; DAG order, cycles, consumers."""

import pytest

from kvrelay.pipeline.dag import PipelineError, consumers, topological_order
from kvrelay.pipeline.spec import PipelineSpec


def _spec(*agents, inputs=("q",)):
    return PipelineSpec.from_dict({"inputs": list(inputs), "agents": list(agents)})


def test_edges_follow_placeholders_and_order_is_topological():
    s = _spec({"name": "c", "user": "{q} {a} {b}"}, {"name": "a", "user": "{q}"}, {"name": "b", "user": "{a}"})
    assert s.order == ("a", "b", "c")
    assert s.deps == {"c": ("a", "b"), "a": (), "b": ("a",)}
    assert s.output == "c"


def test_unknown_reference_names_agent_and_placeholder():
    with pytest.raises(PipelineError, match=r"agent 'b': unknown reference \{nope\}"):
        _spec({"name": "a", "user": "{q}"}, {"name": "b", "user": "{a} {nope}"})


def test_cycle_is_named():
    with pytest.raises(PipelineError, match=r"cycle: (a -> b -> a|b -> a -> b)"):
        _spec({"name": "a", "user": "{b}"}, {"name": "b", "user": "{a}"})


def test_self_reference_duplicate_and_bad_names():
    with pytest.raises(PipelineError, match="refers to its own output"):
        _spec({"name": "a", "user": "{a}"})
    with pytest.raises(PipelineError, match="duplicate agent name 'a'"):
        _spec({"name": "a", "user": "x"}, {"name": "a", "user": "y"})
    with pytest.raises(PipelineError, match="plain identifier"):
        _spec({"name": "a b", "user": "x"})
    with pytest.raises(PipelineError, match="has the name of an input"):
        _spec({"name": "q", "user": "x"})


def test_missing_and_unknown_inputs_at_run_time():
    s = _spec({"name": "a", "user": "{q}"})
    with pytest.raises(PipelineError, match=r"missing input\(s\) \['q'\]"):
        s.check_inputs({})
    with pytest.raises(PipelineError, match=r"unknown input\(s\) \['z'\]"):
        s.check_inputs({"q": "x", "z": "y"})


def test_malformed_yaml_and_fields(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("agents: [ {name: a, user: 'x'\n")
    with pytest.raises(PipelineError, match="malformed YAML"):
        PipelineSpec.from_yaml(bad)
    bad.write_text("agents:\n  - {name: a, user: x, colour: red}\n")
    with pytest.raises(PipelineError, match=r"unknown key\(s\) \['colour'\]"):
        PipelineSpec.from_yaml(bad)
    bad.write_text("agents:\n  - {name: a}\n")
    with pytest.raises(PipelineError, match="needs a string 'user'"):
        PipelineSpec.from_yaml(bad)
    with pytest.raises(PipelineError, match="not found"):
        PipelineSpec.from_yaml(tmp_path / "none.yaml")
    with pytest.raises(PipelineError, match="bad template"):
        _spec({"name": "a", "user": "{q"})
    with pytest.raises(PipelineError, match="max_new_tokens must be >= 1"):
        _spec({"name": "a", "user": "{q}", "max_new_tokens": 0})


def test_literal_braces_are_not_placeholders():
    s = _spec({"name": "a", "user": "json {{\"k\": 1}} for {q}"})
    assert s.agent("a").refs() == ["q"]


def test_dag_helpers():
    deps = {"a": [], "b": ["a"], "c": ["a", "b"]}
    assert topological_order(["c", "b", "a"], deps) == ["a", "b", "c"]
    assert consumers(["a", "b", "c"], deps) == {"a": ["b", "c"], "b": ["c"], "c": []}
