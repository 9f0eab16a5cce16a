"""Pipeline specs: validation errors name the agent and the problem; DAG order, cycles, consumers."""

import re

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
    with pytest.raises(PipelineError, match=r"p.yaml:2: agents\[0\] \('a'\).user: required field is missing"):
        PipelineSpec.from_yaml(bad)
    with pytest.raises(PipelineError, match="not found"):
        PipelineSpec.from_yaml(tmp_path / "none.yaml")
    with pytest.raises(PipelineError, match="is a folder; give the pipeline's YAML file"):
        PipelineSpec.from_yaml(tmp_path)
    with pytest.raises(PipelineError, match="bad template"):
        _spec({"name": "a", "user": "{q"})
    with pytest.raises(PipelineError, match=r"max_new_tokens: must be greater than or equal to 1, got 0"):
        _spec({"name": "a", "user": "{q}", "max_new_tokens": 0})


def test_literal_braces_are_not_placeholders():
    s = _spec({"name": "a", "user": "json {{\"k\": 1}} for {q}"})
    assert s.agent("a").refs() == ["q"]


def test_dag_helpers():
    deps = {"a": [], "b": ["a"], "c": ["a", "b"]}
    assert topological_order(["c", "b", "a"], deps) == ["a", "b", "c"]
    assert consumers(["a", "b", "c"], deps) == {"a": ["b", "c"], "b": ["c"], "c": []}


@pytest.mark.parametrize("field,value,rule", [
    ("max_new_tokens", "ten", "must be a valid integer, got 'ten'"),
    ("max_new_tokens", None, "must be a valid integer, got None"),
    ("max_new_tokens", 1.5, "must be a valid integer, got 1.5"),
    ("max_new_tokens", True, "must be a valid integer, got True"),
    ("temperature", "hot", "must be a valid number, got 'hot'"),
    ("temperature", float("nan"), "must be a finite number, got nan"),
    ("temperature", float("inf"), "must be a finite number, got inf"),
    ("temperature", -1, "must be greater than or equal to 0"),
    ("top_p", 0, "must be greater than 0"),
    ("system", 123, "must be a valid string, got 123"),
    ("forced_output", 123, "must be a valid string, got 123"),
])
def test_agent_field_types_and_ranges(field, value, rule):
    with pytest.raises(PipelineError, match=rf"agents\[0\] \('a'\)\.{field}: {re.escape(rule)}"):
        _spec({"name": "a", "user": "{q}", field: value})


def test_yaml_errors_name_the_line(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("inputs: [q]\nagents:\n  - name: a\n    user: '{q}'\n    temperature: .nan\n")
    with pytest.raises(PipelineError, match=r"p.yaml:5: agents\[0\] \('a'\).temperature: must be a finite number"):
        PipelineSpec.from_yaml(bad)
    bad.write_text("inputs: [q]\nagents:\n  - {name: a, user: '{q}'}\nmodel: x\n")
    with pytest.raises(PipelineError, match=r"p.yaml:4: top level has unknown key\(s\) \['model'\]"):
        PipelineSpec.from_yaml(bad)
    bad.write_bytes(b"agents: \xc3\x28\n")
    with pytest.raises(PipelineError, match="p.yaml: cannot read the pipeline file"):
        PipelineSpec.from_yaml(bad)


@pytest.mark.parametrize("template,shown", [("{q!r}", "{q!r}"), ("{q:>40}", "{q:>40}"), ("{q!s:x}", "{q!s:x}")])
def test_format_specs_and_conversions_are_errors(template, shown):
    with pytest.raises(PipelineError, match=re.escape(f"placeholder {shown} has a format spec or conversion")):
        _spec({"name": "a", "user": template})


@pytest.mark.parametrize("template", ["{0}", "{}", "{q.x}", "{q[0]}"])
def test_only_plain_names_are_placeholders(template):
    with pytest.raises(PipelineError, match="is not a plain name"):
        _spec({"name": "a", "user": template})


_LINE_CHECKS = [  # (file text, where the error points, its rule)
    ("inputs: [q]\nagents:\n  - name: a\n    user: '{q}'\n  - name: b\n    user: '{a} {nope}'\n",
     "p.yaml:6: ", r"agent 'b': unknown reference \{nope\}"),
    ("agents:\n  - {name: a, user: '{b}'}\n  - {name: b, user: '{a}'}\n", "p.yaml: ", "pipeline has a cycle"),
    ("agents:\n  - {name: a, user: x}\n  - {name: a, user: y}\n", "p.yaml:3: ", "duplicate agent name 'a'"),
    ("agents:\n  - {user: x, name: 'a b'}\n", "p.yaml:2: ", "agent name 'a b' must be a plain identifier"),
    ("agents:\n  - {name: a, user: x}\n\noutput: zzz\n", "p.yaml:4: ", "pipeline output 'zzz' is not an agent"),
    ("inputs: [q]\nagents:\n  - name: q\n    user: x\n", "p.yaml:3: ", "agent 'q' has the name of an input"),
    ("agents:\n  - name: a\n    user: x\n    system: '{a:>4}'\n", "p.yaml:4: ",
     r"agent 'a' system: placeholder \{a:>4\} has a format spec"),
]


@pytest.mark.parametrize("text,where,rule", _LINE_CHECKS)
def test_checks_across_fields_name_the_file_and_line(tmp_path, text, where, rule):
    bad = tmp_path / "p.yaml"
    bad.write_text(text)
    with pytest.raises(PipelineError, match=f"^{re.escape(str(tmp_path / where))}{rule}"):
        PipelineSpec.from_yaml(bad)


@pytest.mark.parametrize("text,where,key", [
    ("agents:\n  - name: a\n    user: x\n    max_new_tokens: 4\n    max_new_tokens: 2\n", "p.yaml:5", "max_new_tokens"),
    ("agents:\n  - name: a\n    user: x\n    user: y\n", "p.yaml:4", "user"),
    ("agents:\n  - {name: a, user: x}\nagents:\n  - {name: b, user: y}\n", "p.yaml:3", "agents"),
])
def test_a_yaml_key_given_twice_is_refused(tmp_path, text, where, key):
    bad = tmp_path / "p.yaml"
    bad.write_text(text)
    with pytest.raises(PipelineError, match=re.escape(f"{tmp_path / where}: key {key!r} is given twice")):
        PipelineSpec.from_yaml(bad)


def test_an_input_listed_twice_is_refused(tmp_path):
    with pytest.raises(PipelineError, match="input 'q' is listed twice"):
        _spec({"name": "a", "user": "{q}"}, inputs=("q", "q"))
    bad = tmp_path / "p.yaml"
    bad.write_text("inputs:\n  - q\n  - q\nagents:\n  - {name: a, user: '{q}'}\n")
    with pytest.raises(PipelineError, match=re.escape(f"{tmp_path / 'p.yaml'}:3: input 'q' is listed twice")):
        PipelineSpec.from_yaml(bad)
