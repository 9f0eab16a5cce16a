"""Hostile-but-ordinary input: every case is a one-line ``kvrelay: error: ...`` (exit 2) or success.

Regression cases from issue 26 first, then hypothesis fuzzing of pipeline files, CLI argument
vectors, data lines and sampling parameters (bounded examples, so the file runs in well under a
minute). Commands run in-process through ``kvrelay.cli.main``: an exception other than the ones
``main`` turns into a message would escape and fail the test.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.cli import build_parser, main
from kvrelay.data.datasets import load_gsm8k, load_humaneval, load_mmlu
from kvrelay.errors import KvRelayError
from kvrelay.model.sampling import Sampler, SamplingConfig
from kvrelay.pipeline.prompt import chat_prompt_ids, splice_marker
from kvrelay.pipeline.runner import render_messages
from kvrelay.pipeline.spec import PipelineSpec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "solve-and-check.yaml"
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                derandomize=True)  # the same examples on every CI run: a failure reproduces
YAML_BASE = "inputs: [question]\nagents:\n  - name: a\n    user: \"{question}\"\n"
YAML_OK = YAML_BASE + "    max_new_tokens: 2\n"


class ModelReached(Exception):
    """Raised by the stand-in loader: every check before the model load passed."""


def _stub_loader(mp: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise ModelReached

    from kvrelay.eval import branch_bench, harness
    from kvrelay.weights import loader

    for module in (loader, harness, branch_bench):
        mp.setattr(module, "load_model", refuse)


def _cli(argv: list[str]) -> tuple[int | str, str]:
    """(exit status or 'model', stderr) of ``kvrelay argv``; 'model' when it got as far as loading one."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except ModelReached:
            rc = "model"
    return rc, err.getvalue()


def _assert_one_line_error(rc, err: str, pattern: str | None = None) -> None:
    assert rc == 2, (rc, err)
    assert err.startswith("kvrelay: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    if pattern is not None:
        assert re.search(pattern, err), err


@pytest.fixture
def stub_loader(monkeypatch, tmp_path):
    _stub_loader(monkeypatch)
    monkeypatch.chdir(tmp_path)  # default output folders (kvrelay-demo) land here


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


# ---------------------------------------------------------------- issue 26, case by case


@pytest.mark.parametrize("line,rule", [
    ("max_new_tokens: \"ten\"", r"max_new_tokens: must be a valid integer, got 'ten'"),
    ("max_new_tokens: null", r"max_new_tokens: must be a valid integer, got None"),
    ("max_new_tokens: 1.5", r"max_new_tokens: must be a valid integer, got 1.5"),
    ("max_new_tokens: true", r"max_new_tokens: must be a valid integer, got True"),
    ("temperature: hot", r"temperature: must be a valid number, got 'hot'"),
    ("temperature: .nan", r"temperature: must be a finite number, got nan"),
    ("system: 123", r"system: must be a valid string, got 123"),
    ("forced_output: 123", r"forced_output: must be a valid string, got 123"),
])
def test_pipeline_field_errors_name_file_line_field_and_rule(tmp_path, stub_loader, line, rule):
    path = tmp_path / "p.yaml"
    path.write_text(YAML_BASE + f"    {line}\n")
    rc, err = _cli(["run", str(path), "--input", "question=x"])
    _assert_one_line_error(rc, err, rf"p\.yaml:5: agents\[0\] \('a'\)\.{rule}")


def test_unknown_top_level_key_is_rejected(tmp_path, stub_loader):
    path = tmp_path / "p.yaml"
    path.write_text(YAML_OK + "max_tokens: 3\n")
    _assert_one_line_error(*_cli(["run", str(path), "--input", "question=x"]),
                           r"p\.yaml:6: top level has unknown key\(s\) \['max_tokens'\]")


@pytest.mark.parametrize("template", ["{question!r}", "{question:>40}"])
def test_format_specs_in_templates_are_errors(tmp_path, stub_loader, template):
    path = tmp_path / "p.yaml"
    path.write_text(YAML_OK.replace('"{question}"', f'"{template}"'))
    _assert_one_line_error(*_cli(["run", str(path), "--input", "question=x"]), "has a format spec or conversion")


def test_input_file_errors(tmp_path, stub_loader):
    path = tmp_path / "p.yaml"
    path.write_text(YAML_OK)
    _assert_one_line_error(*_cli(["run", str(path), "--input", f"question=@{tmp_path}/missing.txt"]),
                           r"--input question=@.*missing\.txt: file not found")
    (tmp_path / "bin.txt").write_bytes(b"\xc3\x28\xff")
    _assert_one_line_error(*_cli(["run", str(path), "--input", f"question=@{tmp_path}/bin.txt"]),
                           r"bin\.txt: not a UTF-8 text file")
    _assert_one_line_error(*_cli(["run", str(path), "--input", "other=x"]), r"missing input\(s\) \['question'\]")
    (tmp_path / "q.txt").write_text("What is 2+2?")
    assert _cli(["run", str(path), "--input", f"question=@{tmp_path}/q.txt"])[0] == "model"


@pytest.mark.parametrize("content,rule", [
    (b"[1, 2]\n", r"data\.jsonl:1: expected a GSM8K JSON object, got a list"),
    (b'{"question": "q", "answer": 4}\n', r"data\.jsonl:1: GSM8K row: answer: must be a valid string, got 4"),
    (b'{"question": 7, "answer": "x #### 4"}\n', r"data\.jsonl:1: GSM8K row: question: must be a valid string, got 7"),
    (b'{"question": "q", "answer": "x #### 1"}\n{"question": "q", "answer": "4"}\n',
     r"data\.jsonl:2: GSM8K row: answer: must hold the final answer after '####'"),
    (b"", r"data\.jsonl: no GSM8K problems in the file"),
    (b'{"question": "q", "answer": "\xc3\x28 #### 1"}\n', r"data\.jsonl: not a UTF-8 text file"),
    (b"{not json\n", r"data\.jsonl:1: not a JSON line"),
])
def test_data_file_errors_name_file_line_and_rule(tmp_path, stub_loader, content, rule):
    (tmp_path / "data.jsonl").write_bytes(content)
    for workload in ("gsm8k-chain3", "gsm8k-branches"):
        rc, err = _cli(["bench", "--workload", workload, "--model", "random:tiny", "--data",
                        str(tmp_path / "data.jsonl")])
        _assert_one_line_error(rc, err, rule)


def test_data_errors_come_before_the_model_loads(tmp_path, stub_loader):
    (tmp_path / "data.jsonl").write_text('{"question": "q", "answer": "x #### 1"}\n')
    assert _cli(["bench", "--model", "random:tiny", "--data", str(tmp_path / "data.jsonl")])[0] == "model"


def test_output_paths_are_checked_before_any_work(tmp_path, stub_loader):
    (tmp_path / "file").write_text("x")
    bad_model = ["--model", "no-such-model"]  # loading it would fail; the path check comes first
    _assert_one_line_error(*_cli(["bench", *bad_model, "--json", f"{tmp_path}/file/out.json"]),
                           r"--json .*file/out\.json: .*file is a file, not a folder")
    _assert_one_line_error(*_cli(["bench", *bad_model, "--json", str(tmp_path)]), r"--json .*: is a folder")
    _assert_one_line_error(*_cli(["bench", *bad_model, "--plot", f"{tmp_path}/file"]), r"--plot .*: .*is a file")
    _assert_one_line_error(*_cli(["bench", *bad_model, "--json", "/sys/kvrelay-out.json"]),
                           r"--json /sys/kvrelay-out\.json: cannot write into /sys")
    _assert_one_line_error(*_cli(["profile", *bad_model, "--out", f"{tmp_path}/file/p.json"]), r"--out .*is a file")
    _assert_one_line_error(*_cli(["demo", *bad_model, "--out", f"{tmp_path}/file"]), r"--out .*is a file")
    rc, _ = _cli(["bench", "--model", "random:tiny", "--json", f"{tmp_path}/new/deeper/out.json",
                  "--plot", f"{tmp_path}/plots"])
    assert rc == "model" and (tmp_path / "new" / "deeper").is_dir() and (tmp_path / "plots").is_dir()


@pytest.mark.parametrize("argv,rule", [
    (["generate", "hi", "--temperature", "nan"], r"--temperature: 'nan': must be a finite number"),
    (["generate", "hi", "--top-p", "inf"], r"--top-p: 'inf': must be a finite number"),
    (["generate", "hi", "--max-new-tokens", "0"], r"max_new_tokens must be an integer >= 1, got 0"),
    (["generate", "hi", "--device", "cuda"], r"--device: device 'cuda': CUDA is not available"),
    (["generate", "hi", "--device", "mps"], r"--device: device 'mps': MPS .* is not available"),
    (["generate", "hi", "--device", "bogus"], r"--device: device 'bogus': unknown device"),
    (["run", str(EXAMPLE), "--method", "rksc", "--input", "question=x"],
     r"--method rksc: runs on the gsm8k-branches workload only"),
    (["bench", "--methods", ""], r"--methods: empty list"),
    (["bench", "--methods", ","], r"--methods: empty list or empty item in ','"),
    (["bench", "--methods", "full,,relay"], r"--methods: empty list or empty item"),
    (["bench", "--workload", "nope"], r"--workload: unknown workload 'nope'"),
    (["bench", "--limit", "ten"], r"--limit: 'ten' is not an integer"),
    (["bench", "--workload", "gsm8k-branches", "--compare-budgets-mb", "8,nan"], r"--compare-budgets-mb: 'nan'"),
])
def test_flag_errors(stub_loader, no_gpu, argv, rule):
    _assert_one_line_error(*_cli([*argv, "--model", "random:tiny"]), rule)


def test_command_errors():
    _assert_one_line_error(*_cli(["nope"]), r"^kvrelay: error: argument command: invalid choice: 'nope'")
    _assert_one_line_error(*_cli([]), r"^kvrelay: error: the following arguments are required: command")


def test_text_that_looks_like_a_splice_marker_is_generated_from(capsys):
    assert main(["generate", "What does \u27e6x\u27e7 mean?", "--model", "random:tiny", "--max-new-tokens", "2"]) == 0
    assert "2 tokens" in capsys.readouterr().err


def test_marker_in_a_template_is_not_spliced():
    from kvrelay.cache.store import KVStore
    from kvrelay.engine import Engine
    from kvrelay.pipeline.runner import PipelineRunner
    from kvrelay.weights.loader import load_model

    spec = PipelineSpec.from_dict({"inputs": ["question"], "agents": [
        {"name": "a", "user": "literal \u27e6question\u27e7 then {question}"}]})
    lm = load_model("random:tiny")
    runner = PipelineRunner(Engine(lm, KVStore(1 << 20)), spec)
    call, prompt = runner.prepare(spec.agent("a"), {"question": [5, 6]}, {})
    assert [s.ref for s in prompt.segments if s.ref] == ["question"]  # only the placeholder is spliced
    assert "\u27e6question\u27e7" in lm.tokenizer.decode(prompt.ids)


def test_every_flag_has_help_with_choices():
    import dataclasses

    from kvrelay.eval.branch_bench import BranchBenchConfig
    from kvrelay.eval.harness import BenchConfig

    sub = build_parser()._subparsers._group_actions[0].choices
    for name, parser in sub.items():
        for action in parser._actions:
            assert action.help and not action.help.startswith("(default"), (name, action.dest)
    bench = {a.dest: a.help for a in sub["bench"]._actions}
    fields = {f.name for cls in (BenchConfig, BranchBenchConfig) for f in dataclasses.fields(cls)}
    assert set(bench) == fields | {"help", "json", "plot"}  # flags come from the config classes
    assert "gsm8k-fc3" in bench["workload"] and "gsm8k-branches" in bench["workload"]
    assert "agent, e2e" in bench["mode"] and "cuda" in bench["device"] and "kvcomm" in bench["methods"]


# ---------------------------------------------------------------- fuzzing

_TEMPLATES = ["", "{question}", "{a}", "{b}", "{question!r}", "{a:>9}", "{", "}}", "{0}", "{question.x}",
              "x {{literal}} {question}", "\u27e6question\u27e7 {question}", "\u27e6a\u27e7", "{a} then {question}",
              "{c}", "ten", "hot"]
_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
                  st.sampled_from([float("nan"), float("inf"), -1, 1.5, "ten", "hot", "", *_TEMPLATES]),
                  st.text(max_size=12), st.lists(st.integers(0, 3), max_size=2))
_VALID = {"user": st.sampled_from(_TEMPLATES), "system": st.sampled_from(_TEMPLATES),
          "max_new_tokens": st.integers(1, 64), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
          "forced_output": st.text(max_size=6)}
# mostly-valid agents (a field is junk one time in four), so many specs pass and reach rendering
_agent = st.fixed_dictionaries({}, optional={k: st.one_of(v, v, v, _junk) for k, v in _VALID.items()}
                               | {"colour": _junk, "name": st.sampled_from(["question", "1x", "", "b c"])})
_agents = st.lists(_agent, min_size=1, max_size=3).map(
    lambda agents: [{"name": name, "user": "{question}", **a} for name, a in zip("abc", agents, strict=False)])
_BAD = [float("nan"), float("inf"), -1, 0, True, None, 1.5, "ten", "{question!r}", "{a:>9}", "\u27e6question\u27e7",
        [], {"k": 1}]
_pipeline = st.one_of(
    st.fixed_dictionaries({"inputs": st.just(["question"]), "agents": _agents},
                          optional={"name": st.text(max_size=8), "output": st.sampled_from(["", "a", "b", "z"])}),
    st.fixed_dictionaries({"agents": st.one_of(_agents, _junk)},
                          optional={"inputs": st.one_of(st.just(["question"]), _junk), "name": _junk,
                                    "output": _junk, "model": _junk}))


def _expected_render(template: str) -> str:
    """What a template should render to: each plain {name} a splice marker, {{ and }} single, the rest as written."""
    text = template.replace("{{", "\0").replace("}}", "\1")
    text = re.sub(r"\{([A-Za-z_]\w*)\}", lambda m: splice_marker(m.group(1)), text)
    return text.replace("\0", "{").replace("\1", "}")


@functools.cache
def _toy_tokenizer():
    from kvrelay.model.tokenizer import Tokenizer
    from tests.helpers import toy_tokenizer_metadata

    return Tokenizer.from_gguf_metadata(toy_tokenizer_metadata())


def _check_pipeline(path) -> None:
    """The file is refused with one clear line, or accepted with typed, finite values that render as written."""
    try:
        spec = PipelineSpec.from_yaml(path)
    except KvRelayError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    tok = _toy_tokenizer()
    for name in spec.order:  # every accepted spec renders; each placeholder spliced, nothing else
        agent = spec.agent(name)
        assert isinstance(agent.max_new_tokens, int) and not isinstance(agent.max_new_tokens, bool)
        assert agent.max_new_tokens >= 1 and math.isfinite(agent.temperature) and agent.temperature >= 0
        assert math.isfinite(agent.top_p) and 0 < agent.top_p <= 1
        assert isinstance(agent.system, str) and isinstance(agent.forced_output, (str, type(None)))
        messages = render_messages(agent)
        assert messages[-1]["content"] == _expected_render(agent.user)
        splices = {ref: [1, 2] for ref in agent.refs()}
        prompt = chat_prompt_ids(tok, messages, splices)
        assert sorted({s.ref for s in prompt.segments if s.ref}) == sorted(set(agent.refs()))


@FUZZ
@given(doc=_pipeline)
def test_fuzz_pipeline_files(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("fuzz") / "p.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    _check_pipeline(path)


def test_every_field_meets_every_bad_value(tmp_path):
    """A valid one-agent file with one field set to one bad value, for every pair (a grid, not a sample)."""
    path = tmp_path / "p.yaml"
    for key in [*_VALID, "name", "inputs", "output", "colour"]:
        for bad in _BAD:
            agent = {"name": "a", "user": "{question}"} | ({} if key in ("inputs", "output") else {key: bad})
            doc = {"inputs": ["question"], "agents": [agent]} | ({key: bad} if key in ("inputs", "output") else {})
            path.write_text(yaml.safe_dump(doc, allow_unicode=True))
            _check_pipeline(path)


@FUZZ
@given(blob=st.one_of(st.text(max_size=80).map(str.encode), st.binary(max_size=40)))
def test_fuzz_raw_yaml_text(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "p.yaml"
    path.write_bytes(blob)
    with contextlib.suppress(KvRelayError):
        PipelineSpec.from_yaml(path)


_values = st.sampled_from(["", "0", "1", "-1", "2", "1.5", "nan", "-inf", "1e999", "x", "cpu", "cuda", "mps",
                           "cuda:7", "bogus", "random:tiny", "no-such-model", "gsm8k-chain3", "gsm8k-branches",
                           "copy-agents:2", "copy-agents:x", "full", "rksc", "relay[x=1]", ",", "full,,prefix",
                           "agent", "e2e", "/sys/x.json", "@/no/such/file", "question=x", "q", "\u27e6x\u27e7"])
_FLAGS = {
    "bench": ["--workload", "--methods", "--limit", "--offset", "--model", "--device", "--mode", "--data",
              "--repeats", "--seed", "--warm-problems", "--warm-data", "--branches", "--branch-tokens",
              "--compare-budgets-mb", "--compare-concurrency", "--json", "--bogus-flag"],
    "generate": ["--model", "--device", "--system", "--max-new-tokens", "--temperature", "--top-p", "--seed"],
    "run": ["--method", "--input", "--model", "--device", "--store-bytes"],
    "profile": ["--model", "--device", "--problems", "--band-mass", "--select", "--kl-tolerance", "--out"],
    "demo": ["--model", "--problems", "--methods", "--device", "--repeats", "--out"],
}


@FUZZ
@given(command=st.sampled_from(sorted(_FLAGS)), data=st.data())
def test_fuzz_cli_arguments(tmp_path_factory, command, data):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "p.yaml").write_text(YAML_OK)
    positional = {"generate": ["hi"], "run": [str(folder / "p.yaml")]}.get(command, [])
    flags = data.draw(st.lists(st.tuples(st.sampled_from(_FLAGS[command]), _values), max_size=4))
    argv = [command, *positional, *(x for pair in flags for x in pair)]
    with pytest.MonkeyPatch.context() as mp:
        _stub_loader(mp)
        mp.setattr(torch.cuda, "is_available", lambda: False)
        mp.chdir(folder)  # output folders named by the fuzzed values are created here
        rc, err = _cli(argv)
    if rc != "model":
        _assert_one_line_error(rc, err)


_row_value = st.one_of(st.none(), st.integers(), st.text(max_size=10), st.just("steps #### 12"),
                       st.lists(st.integers(), max_size=2))


@FUZZ
@given(lines=st.lists(st.one_of(
    st.fixed_dictionaries({"question": _row_value, "answer": _row_value}).map(json.dumps),
    st.fixed_dictionaries({"task_id": _row_value, "prompt": _row_value, "entry_point": _row_value,
                           "test": _row_value}).map(json.dumps),
    st.lists(st.integers(), max_size=2).map(json.dumps), st.text(max_size=20)), max_size=4),
    raw=st.binary(max_size=8))
def test_fuzz_data_lines(tmp_path_factory, lines, raw):
    folder = tmp_path_factory.mktemp("data")
    for name, blob in (("a.jsonl", "\n".join(lines).encode()), ("b.jsonl", raw + "\n".join(lines).encode())):
        path = folder / name
        path.write_bytes(blob)
        for load in (load_gsm8k, load_humaneval):
            try:
                problems = load(path)
            except KvRelayError as exc:
                assert str(path) in str(exc) and "\n" not in str(exc)
                continue
            assert problems and all(isinstance(v, str) for p in problems for v in vars(p).values())
    (folder / "m_test.csv").write_bytes(raw + "\n".join(lines).encode())
    with contextlib.suppress(KvRelayError):
        assert load_mmlu(folder / "m_test.csv")


@pytest.mark.parametrize("kwargs,rule", [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\], got nan"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got True"),
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer >= 1, got 2.0"),
    ({"seed": "1"}, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\] \(a torch.Generator's seed\), got '1'"),
    ({"seed": 1 << 64}, r"seed must be an integer in .*, got 18446744073709551616"),
    ({"seed": -(1 << 63) - 1}, r"seed must be an integer in .*, got -9223372036854775809"),
])
def test_sampling_parameters_are_typed_and_finite(kwargs, rule):
    with pytest.raises(KvRelayError, match=rule):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("seed", [-(1 << 63), 0, (1 << 64) - 1])
def test_seeds_at_both_ends_of_a_generators_range_are_taken(seed):
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=seed))
    assert 0 <= sampler(torch.zeros(8)) < 8


@FUZZ
@given(kwargs=st.dictionaries(st.sampled_from(["max_new_tokens", "temperature", "top_p", "seed"]),
                              st.one_of(st.booleans(), st.integers(-2, 5), st.integers(-(1 << 65), 1 << 65),
                                        st.floats(), st.text(max_size=3)),
                              max_size=4))
def test_fuzz_sampling_parameters(kwargs):
    try:
        cfg = SamplingConfig(**kwargs)
    except KvRelayError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(cfg.max_new_tokens, int) and not isinstance(cfg.max_new_tokens, bool)
    assert cfg.max_new_tokens >= 1 and math.isfinite(cfg.temperature) and cfg.temperature >= 0
    assert math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1
    Sampler(cfg)  # every accepted seed seeds a generator
