"""The CLI end to end, as a user runs it."""

import subprocess
import sys

import pytest

from kvrelay.cli import main
from kvrelay.model import packed


def _kvrelay(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvrelay", *args], capture_output=True, text=True, timeout=timeout)


def _main_in_process(args, capfd) -> tuple[int, str]:
    """(exit status, stderr) of ``kvrelay.cli.main(args)`` in this process."""
    capfd.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    return code, capfd.readouterr().err


@pytest.mark.slow
def test_demo_prints_its_table(tmp_path):
    out = _kvrelay("demo", "--problems", "1", "--repeats", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    table = lines[header + 2 : lines.index("", header)]  # up to the blank line before the by-agent table
    rows = {line.split()[0]: line.split() for line in table}
    assert {"full", "prefix"} <= set(rows)
    assert rows["full"][2] == "1.00x" and float(rows["full"][5]) == 0.0  # vs full; reuse
    assert float(rows["prefix"][7]) == 0.0  # no fallback
    assert float(rows["prefix"][8]) == 1.0  # exact reuse: the first token agrees
    assert (tmp_path / "demo.json").exists() and "wrote" in out.stdout


def test_unknown_model_is_a_clear_error(capfd):
    code, err = _main_in_process(["generate", "hi", "--model", "nope"], capfd)
    assert code == 2
    assert "kvrelay: error: unknown model 'nope'" in err and "Traceback" not in err


def test_bad_flag_value_is_a_clear_error(capfd):
    code, err = _main_in_process(["generate", "hi", "--model", "random:tiny", "--top-p", "2"], capfd)
    assert code == 2 and "top_p must be in (0, 1]" in err


def test_run_a_pipeline_file():
    out = _kvrelay("run", "examples/solve-and-check.yaml", "--method", "prefix", "--model", "random:tiny",
                   "--input", "question=What is 2+2?")
    assert out.returncode == 0, out.stderr
    assert "=== solver [prefix:" in out.stdout and "=== checker [prefix:" in out.stdout


def test_run_reports_bad_pipelines_clearly(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("inputs: [q]\nagents:\n  - {name: a, user: '{q} {b}'}\n")
    out = _kvrelay("run", str(bad), "--model", "random:tiny", "--input", "q=x")
    assert out.returncode == 2 and "agent 'a': unknown reference {b}" in out.stderr
    out = _kvrelay("run", "examples/solve-and-check.yaml", "--model", "random:tiny")
    assert out.returncode == 2 and "missing input(s) ['question']" in out.stderr
    assert "Traceback" not in out.stderr



def test_run_prints_each_agent_as_it_finishes_and_a_failure_names_its_agent(tmp_path, capfd):
    late = tmp_path / "late.yaml"
    late.write_text("inputs: [q]\nagents:\n  - {name: a, user: '{q}', max_new_tokens: 4}\n"
                    "  - {name: b, user: '{q} {a}', max_new_tokens: 8170}\n")
    capfd.readouterr()
    code = main(["run", str(late), "--input", "q=hi", "--model", "random:tiny"])
    out, err = capfd.readouterr()
    assert code == 2
    assert out.startswith("=== a [full: ") and ", 4 new tokens]\n" in out and "=== b" not in out
    assert "kvrelay: error: agent 'b': prompt of " in err and "exceeds the context length" in err

def test_bench_gsm8k_branches_writes_its_table_and_json(tmp_path):
    out_json = tmp_path / "br.json"
    out = _kvrelay("bench", "--workload", "gsm8k-branches", "--model", "random:tiny", "--limit", "1",
                   "--branches", "2", "--branch-tokens", "3", "--methods", "rksc[skip_top=1.0]",
                   "--json", str(out_json))
    assert out.returncode == 0, out.stderr
    import json

    result = json.loads(out_json.read_text())
    assert set(result["results"]) == {"full", "prefix", "rksc[skip_top=1.0]"}
    rksc = result["results"]["rksc[skip_top=1.0]"]
    assert rksc["verify_calls"] == 2 and rksc["verifier_skipped_share"] == 0.0
    assert rksc["kv_over_root_plus_own"] <= 1.2 < result["results"]["full"]["kv_over_root_plus_own"]
    replays = result["blocks"]["rksc[skip_top=1.0]"]["replay"]  # concurrency x budget x policy
    assert [(r["concurrency"], r["budget_mb"], r["policy"]) for r in replays] == [
        (c, b, p) for c in (1, 4) for b in (8.0, 24.0) for p in ("rsbcm", "lru")]
    assert "RSBCM" not in out.stderr and "rksc[skip_top=1.0]" in out.stdout
    assert "gsm8k-branches, 1 problem, " in out.stdout


def test_bench_names_its_units_and_every_json_field_is_documented(tmp_path, capfd):
    """The printed table says what its numbers count (token-layers, G of greedy@G), and docs/benchmarks.md names
    every field the JSON holds, so a researcher reading a result file need not guess what a number means."""
    import json
    import re
    from pathlib import Path

    from kvrelay.eval.report import NEAR_TIE_MARGIN

    out_json = tmp_path / "b.json"
    capfd.readouterr()
    code = main(["bench", "--workload", "copy-agents:2", "--model", "random:tiny", "--methods", "full,naive",
                 "--limit", "1", "--repeats", "1", "--greedy-tokens", "3", "--json", str(out_json)])
    out = capfd.readouterr().out
    assert code == 0
    assert "1 problem, " in out and "token-layers" in out
    assert "greedy@3" in next(line for line in out.splitlines() if line.startswith("method"))
    result = json.loads(out_json.read_text())
    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    section = doc[doc.index("## What `kvrelay bench --json` writes"):]
    section = section[:section.index("\n## ", 1)]
    named = set(re.findall(r"`([a-z_]+)`", section))
    fields = {*result, *result["env"], *result["results"]["naive"], *result["calls"][0]}
    assert fields - named == set(), "fields the JSON holds that docs/benchmarks.md does not name"
    assert f"under {NEAR_TIE_MARGIN} a near-tie" in section


def test_bench_refuses_rksc_on_a_pipeline_workload(capfd):
    code, err = _main_in_process(["bench", "--workload", "gsm8k-chain3", "--model", "random:tiny", "--methods",
                                  "rksc"], capfd)
    assert code == 2 and "gsm8k-branches" in err
    code, err = _main_in_process(["bench", "--workload", "gsm8k-branches", "--model", "random:tiny", "--methods",
                                  "relay"], capfd)
    assert code == 2 and "full, prefix and rksc" in err


def test_bench_refuses_gsm8k_branches_flags_on_another_workload_before_the_model_loads(capfd):
    """They would be ignored there; refused, one line, before a model (one that does not exist) would load."""
    code, err = _main_in_process(["bench", "--model", "no-such-model", "--limit", "1", "--methods", "full",
                                  "--branches", "4", "--compare-concurrency", "1"], capfd)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("kvrelay: error: --branches, --compare-concurrency: gsm8k-branches only"), err


def test_bench_refuses_a_relay_band_or_profile_it_cannot_run_before_the_run_starts(capfd):
    """A band out of order is refused before a model (one that does not exist) would load; a band past the model's
    layers, relay on a model with no profile, or cacheblend's check layer past its last, once it is loaded: one line
    each, no progress bar before it."""
    for model, spec, text in (("no-such-model", "relay[band=5:3:2]", "L_start 5 <= L_det 3 <= L_end 2"),
                              ("random:tiny", "relay[band=1:1:40]", "L_end 40 < 4"),
                              ("random:tiny", "relay", "no RelayCaching layer profile"),
                              ("random:tiny", "cacheblend[check_layer=100]", "check_layer must be in [0, 3]")):
        code, err = _main_in_process(["bench", "--model", model, "--methods", f"full,{spec}", "--limit", "1"], capfd)
        assert code == 2 and err.count("\n") == 1 and err.startswith("kvrelay: error: ") and text in err, err


def test_bad_input_is_one_line_through_the_real_entry_point(tmp_path, capfd):
    """Exit 2, one stderr line, no traceback: the first case of each command through the console entry point
    (a process of its own: what its imports print counts too), the others through main() in this process (the
    same code; a process each cost ~5 s of imports)."""
    bad = tmp_path / "p.yaml"
    bad.write_text("inputs: [q]\nagents:\n  - {name: a, user: '{q}', max_new_tokens: ten}\n")
    good = tmp_path / "good.yaml"
    good.write_text("inputs: [q]\nagents:\n  - {name: a, user: '{q}', max_new_tokens: 2}\n")
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text('{"q": "x"}\n')
    commands_seen: set[str] = set()
    for args, text in ((["run", str(bad), "--model", "random:tiny", "--input", "q=x"],
                        "p.yaml:3: agents[0] ('a').max_new_tokens: must be a valid integer, got 'ten'"),
                       (["generate", "hi", "--model", "random:tiny", "--temperature", "nan"],
                        "--temperature: 'nan': must be a finite number"),
                       (["generate", "hi", "--model", "random:tiny", "--device", "bogus"], "unknown device"),
                       *((command, "int4 decode runs a GGUF's 4-bit weights on CPU; 'random:tiny' on cpu has none")
                         for command in (["generate", "hi", "--model", "random:tiny", "--int4-decode"],
                                         ["run", str(good), "--model", "random:tiny", "--int4-decode", "--input",
                                          "q=x"])),
                       # a store URL refused before the model (one that does not exist) would load
                       (["run", str(good), "--model", "no-such-model", "--input", "q=x", "--store", "redis://h/abc"],
                        "--store: "),
                       (["profile", "--int4-decode"], "unrecognized arguments: --int4-decode"),
                       (["profile", "--workload", "gsm8k-chain3,nope", "--selector-only"], "unknown workload 'nope'"),
                       (["profile", "--workload", "gsm8k-chain3,humaneval-adr"],
                        "several workloads calibrate the selector only (--selector-only)"),
                       (["profile", "--offset", "-1"], "--offset: '-1': must be an integer >= 0"),
                       (["profile", "--workload", "humaneval-adr", "--selector-only"],
                        "humaneval-adr has no train split"),
                       # a pipeline file of the user's: its data checked before the model (one that does not
                       # exist) would load
                       *(([command, "--workload", str(good), "--model", "no-such-model", *more],
                          "give its problems with --data") for command, more in (("bench", []),
                                                                                  ("profile", ["--offset", "5"]))),
                       (["bench", "--workload", str(good), "--data", str(inputs), "--mode", "e2e", "--model",
                         "no-such-model"], "has no task score: use --mode agent"),
                       (["profile", "--workload", f"{good},gsm8k-chain3", "--selector-only"],
                        "a pipeline file calibrates alone")):
        if args[0] not in commands_seen:
            commands_seen.add(args[0])
            out = _kvrelay(*args)
            code, err = out.returncode, out.stderr
        else:
            code, err = _main_in_process(args, capfd)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("kvrelay: error: ") and text in err
    assert commands_seen == {"run", "generate", "profile", "bench"}


def test_generate_with_int4_decode():
    out = _kvrelay("generate", "What is 2 + 2?", "--int4-decode", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    matmuls = "oneDNN packed (121 weights)" if packed.available() else "F.linear"
    assert f"(decode weights: int4 (120 of 120 weights); matmuls: {matmuls}; threads: " in out.stderr


def test_threads_flag_sets_torch_threads(capfd):
    out = _kvrelay("generate", "Hi", "--threads", "1", "--max-new-tokens", "2")  # a process: it sets torch's threads
    assert out.returncode == 0, out.stderr
    assert "; threads: 1)" in out.stderr
    code, err = _main_in_process(["generate", "Hi", "--threads", "0"], capfd)  # refused before it sets any
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("kvrelay: error: generate: argument --threads: '0': must be an integer >= 1")


def test_demo_runs_on_one_thread_unless_told(capfd, monkeypatch, tmp_path):
    """The demo compares timings: one torch thread by default (as the benchmarks), --threads N as the other commands."""
    import torch

    from kvrelay import cli, demo

    seen = []
    monkeypatch.setattr(cli, "check_workload_data", lambda *args: None)
    monkeypatch.setattr(demo, "run_demo", lambda cfg: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        assert _main_in_process(["demo", "--out", tmp_path], capfd)[0] == 0
        assert _main_in_process(["demo", "--out", tmp_path, "--threads", "2"], capfd)[0] == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]
    code, err = _main_in_process(["demo", "--threads", "0"], capfd)
    assert code == 2 and "demo: argument --threads: '0': must be an integer >= 1" in err


def test_serve_passes_int4_decode_on():
    out = _kvrelay("serve", "--model", "random:tiny", "--int4-decode", "--port", "0")
    assert out.returncode == 2 and "kvrelay serve: error: int4 decode runs a GGUF's 4-bit weights" in out.stderr


def test_a_reader_that_closes_the_pipe_early_is_no_error():
    """``kvrelay methods | head -1``: the listing stops quietly when its reader goes away."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvrelay", "methods"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the listing is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err


def test_ctrl_c_in_a_command_is_one_line_and_status_130(capfd, monkeypatch):
    """Ctrl-C lands wherever the command is (here: listing the methods); the user sees one line, not a traceback,
    and the shell's status for an interrupted command."""
    from kvrelay.reuse import catalog

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog, "method_catalog", interrupted)
    try:
        code, err = _main_in_process(["methods"], capfd)
    except KeyboardInterrupt:  # escaped main: the user saw a traceback (caught here so pytest itself goes on)
        pytest.fail("Ctrl-C escaped kvrelay.cli.main")
    assert code == 130
    assert err.strip() == "kvrelay: interrupted" and "Traceback" not in err


@pytest.mark.parametrize("command", [["demo"], ["bench"], ["bench", "--workload", "mmlu-doc3"]])
def test_missing_default_data_is_said_before_the_model_loads(command, capfd, monkeypatch, tmp_path):
    """A fresh clone without the benchmark data: the data is named, in one line, before the model would load (a
    model that does not exist would be the error otherwise)."""
    monkeypatch.setenv("KVRELAY_DATA", str(tmp_path / "no-data-here"))
    code, err = _main_in_process([*command, "--model", "no-such-model"], capfd)
    assert code == 2 and err.count("\n") == 1, err
    assert str(tmp_path / "no-data-here") in err and "no-such-model" not in err


def test_generate_prints_the_answer_as_it_is_decoded(capsys, monkeypatch):
    """The text is on stdout before the call finishes (a long answer on a CPU takes minutes), and all of it: what
    was streamed and the rest make the output's text."""
    from kvrelay.engine import Engine

    streamed_before_finish, outputs = [], []
    finish = Engine.finish

    def finish_after_reading_stdout(self, seq):
        streamed_before_finish.append(capsys.readouterr().out)
        outputs.append(finish(self, seq))
        return outputs[-1]

    monkeypatch.setattr(Engine, "finish", finish_after_reading_stdout)
    capsys.readouterr()
    assert main(["generate", "hi", "--model", "random:tiny", "--max-new-tokens", "8"]) == 0
    rest = capsys.readouterr().out
    assert len(outputs) == 1 and outputs[0].text  # random weights: newlines, still text
    assert streamed_before_finish[0] and streamed_before_finish[0] + rest == outputs[0].text + "\n"


def test_version(capsys):
    from kvrelay import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"kvrelay {__version__}\n"


# Builds the whole parser and runs every command's --help and a mistyped flag (argparse checks the flags' string
# defaults then too), printing each exit status and which of the heavy modules got imported.
_PARSE_EVERY_COMMAND = """
import contextlib, io, json, sys
from kvrelay.cli import build_parser

commands = [name for action in build_parser()._subparsers._group_actions for name in action.choices]
codes = {}
for argv in (["--help"], *([c, "--help"] for c in commands), *([c, "--no-such-flag"] for c in commands)):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            codes[" ".join(argv)] = exc.code
print(json.dumps({"codes": codes, "heavy": sorted(m for m in ("torch", "fastapi", "uvicorn") if m in sys.modules)}))
"""


def test_help_and_flag_errors_load_no_torch():
    """``kvrelay --help``, every command's ``--help`` and a mistyped flag answer without importing torch (seconds to
    load) or the web stack: the parsers come from torch-free config modules, the commands import the rest."""
    import json

    out = subprocess.run([sys.executable, "-c", _PARSE_EVERY_COMMAND], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    codes = result["codes"]
    assert {"serve --help", "bench --help", "profile --help", "generate --no-such-flag"} <= set(codes)
    assert all(code == (0 if argv.endswith("--help") else 2) for argv, code in codes.items()), codes
    assert result["heavy"] == []
