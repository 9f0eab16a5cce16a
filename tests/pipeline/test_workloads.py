"""Workloads from a pipeline file of the user's: its problems are a JSON-lines file of its inputs."""

import json

import pytest

from kvrelay.data.datasets import load_inputs
from kvrelay.errors import ConfigError, DataFileError
from kvrelay.eval.calibration_calls import calibration_data
from kvrelay.pipeline.dag import PipelineError
from kvrelay.pipeline.runner import agent_role
from kvrelay.pipeline.workloads import get_workload

PIPELINE = """name: my-review
inputs: [task]
agents:
  - name: writer
    system: "You write short answers."
    user: "{task}"
  - name: checker
    system: "You check answers."
    user: "{task} / {writer}"
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "pipe.yaml").write_text(PIPELINE)
    rows = [{"task": f"task {i}", "id": i} for i in range(3)]
    (tmp_path / "inputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_a_pipeline_file_is_a_workload_named_after_its_pipeline(files):
    wl = get_workload(str(files / "pipe.yaml"))
    assert wl.name == "my-review" and [a.name for a in wl.spec.agents] == ["writer", "checker"] and wl.score is None
    problems = wl.problems(str(files / "inputs.jsonl"), 2)
    assert [(p.inputs, p.problem_id) for p in problems] == [({"task": "task 0"}, "my-review-0"),
                                                            ({"task": "task 1"}, "my-review-1")]
    assert len(wl.problems(str(files / "inputs.jsonl"), None)) == 3
    assert agent_role(wl.spec.agents[1])  # a fixed system prompt: calibration can key a selector by it
    (files / "anon.yaml").write_text(PIPELINE.replace("name: my-review\n", ""))
    assert get_workload(str(files / "anon.yaml")).name == "anon"  # no name: the file's stem
    assert get_workload(f"{files}//./anon.yaml").name == "anon"  # however the path is written


def test_a_pipeline_workload_s_bad_input_is_named(files):
    wl = get_workload(str(files / "pipe.yaml"))
    with pytest.raises(ConfigError, match=r"give its problems with --data.*\(task\)"):
        wl.problems(None, 2)
    (files / "bad.jsonl").write_text('{"task": "ok"}\n{"other": "x"}\n')
    with pytest.raises(DataFileError, match=r"bad.jsonl:2: pipeline inputs row: task"):
        wl.problems(str(files / "bad.jsonl"), None)
    with pytest.raises(DataFileError, match="not found"):
        wl.problems(str(files / "none.jsonl"), None)
    with pytest.raises(PipelineError, match="pipeline file not found"):
        get_workload(str(files / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"or a pipeline file \(.yaml\)"):
        get_workload("no-such-workload")


def test_inputs_may_be_named_like_anything_a_row_model_holds(tmp_path):
    names = ("_x", "model_config", "json")
    (tmp_path / "in.jsonl").write_text(json.dumps({n: f"v{n}" for n in names}) + "\n" + json.dumps({"_x": 5}) + "\n")
    assert load_inputs(tmp_path / "in.jsonl", names, 1) == [{n: f"v{n}" for n in names}]
    with pytest.raises(DataFileError, match=r"in.jsonl:2: pipeline inputs row: _x: must be a string, got 5"):
        load_inputs(tmp_path / "in.jsonl", names)
    with pytest.raises(DataFileError, match=r"in.jsonl:2: pipeline inputs row: json: missing"):
        load_inputs(tmp_path / "in.jsonl", ("json",))


def test_a_pipeline_file_named_like_gsm8k_gets_no_gsm8k_data():
    assert calibration_data(None, "gsm8k-mine.yaml") is None
    assert calibration_data(None, "gsm8k-chain3").endswith("train.jsonl")


def test_an_offset_past_a_calibration_workload_s_problems_is_named(files):
    from kvrelay.errors import KvRelayError
    from kvrelay.eval.calibration_calls import downstream_calls

    with pytest.raises(KvRelayError, match=r"--offset 3 skips all of its 3 problems"):
        downstream_calls(None, str(files / "pipe.yaml"), str(files / "inputs.jsonl"), 2, (), None, "", False, offset=3)


def _mmlu_folder(path, num_rows_by_subject: dict[str, int]):
    path.mkdir()
    for subject, num_rows in num_rows_by_subject.items():
        rows = [f'"{subject} q{i}?",a{i},b{i},c{i},d{i},{"ABCD"[i % 4]}' for i in range(num_rows)]
        (path / f"{subject}_test.csv").write_text("\n".join(rows) + "\n")
    return path


def test_mmlu_doc3_states_six_facts_of_one_subject_and_asks_one_of_them(tmp_path):
    data = _mmlu_folder(tmp_path / "mmlu", {"zoology": 40, "astronomy": 32, "tiny": 25})
    wl = get_workload("mmlu-doc3")
    assert wl.spec.order == ("analyst", "answerer", "checker") and wl.spec.inputs == ("document", "question")
    problems = wl.problems(str(data), None)
    # "tiny" has no row past the document's: left out; one problem a subject, sorted
    assert [p.problem_id for p in problems] == ["mmlu-doc-astronomy-0", "mmlu-doc-zoology-0"]
    first = problems[0]
    lines = first.inputs["document"].split("\n")
    assert lines[0] == "Notes on astronomy:" and len(lines) == 7
    # rows 20-25, each with its correct answer's text
    assert lines[1] == "1. astronomy q20? Answer: a20" and lines[2] == "2. astronomy q21? Answer: b21"
    assert first.inputs["question"] == "astronomy q20?\nA. a20\nB. b20\nC. c20\nD. d20" and first.reference == "A"
    second_round = wl.problems(str(data), 6)  # a second round: each subject's next six rows, while they last
    assert [p.problem_id for p in second_round] == [*(p.problem_id for p in problems), "mmlu-doc-astronomy-1",
                                                    "mmlu-doc-zoology-1"]  # astronomy has no third six
    assert second_round[2].inputs["document"].split("\n")[1] == "1. astronomy q26? Answer: c26"
    assert second_round[2].inputs["question"].startswith("astronomy q28?")  # problem 2 asks the document's 3rd fact
    assert second_round[2].reference == "A"  # row 28's letter, where the document's first row (26) has "C"
    answerer = wl.spec.agent("answerer").user.format(document="D", analyst="N", question="Q")
    assert answerer == "Document:\nD\n\nNotes:\nN\n\nQuestion: Q"
    checker = wl.spec.agent("checker").user.format(document="D", answerer="A", question="Q")
    assert checker == "Document:\nD\n\nQuestion: Q\n\nAnswer: A"
    assert [wl.spec.agent(n).max_new_tokens for n in wl.spec.order] == [48, 24, 24]
    with pytest.raises(DataFileError, match="needs a subject with at least 26 MMLU rows"):
        wl.problems(str(_mmlu_folder(tmp_path / "short", {"tiny": 25})), None)
    assert len(wl.problems(str(_mmlu_folder(tmp_path / "exact", {"exact": 26})), None)) == 1  # rows 20-25: enough
    assert wl.score("The answer is B.", "B") == 1.0 and wl.score("Answer: C", "B") == 0.0


def test_mmlu_doc3_runs_on_the_shipped_data():
    problems = get_workload("mmlu-doc3").problems(None, 3)
    assert [p.problem_id for p in problems] == ["mmlu-doc-abstract_algebra-0", "mmlu-doc-astronomy-0",
                                                "mmlu-doc-business_ethics-0"]
    assert all(p.inputs["question"].split("\n")[0] in p.inputs["document"] for p in problems)
