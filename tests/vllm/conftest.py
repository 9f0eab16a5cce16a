"""vLLM's own OpenAI server on SmolLM2 (exported to a Hugging Face folder, nothing downloaded), started through
``kvrelay.vllm.launch`` on a free 127.0.0.1 port and always stopped.

Every test under tests/vllm/ is skipped where vLLM is not installed (the main venv: `make test`), except in
modules that set ``NEEDS_VLLM = False``; `make vllm-test` runs them all in .venv-vllm. Test modules here import
vllm (and the connector) inside tests or fixtures, not at the top, so that collection works without vLLM.

Fixtures:
- ``smollm2_hf_dir``: the exported SmolLM2 folder (session).
- ``vllm_server_factory``: ``start(kv_transfer_config=None, **VllmServerConfig fields) -> VllmServer``; every
  server it started is stopped when the module's tests are done.
- ``vllm_server``: one plain server (vLLM's prefix cache, no connector) for the module.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.vllm.server_process import VllmServer, VllmServerConfig

HERE = Path(__file__).resolve().parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed here: `make vllm-venv` then `make vllm-test` (docs/vllm.md)"
# 1 GiB of KV cache (~23k SmolLM2 tokens); set here so a test never sizes it from the machine's memory
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "1"}
# a start takes ~30 s on an idle 2-core machine; on a loaded one, raise the bound with KVRELAY_VLLM_STARTUP_S
STARTUP_TIMEOUT_S = float(os.environ.get("KVRELAY_VLLM_STARTUP_S") or 900)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        in_here = HERE in Path(str(item.fspath)).resolve().parents
        if in_here and getattr(getattr(item, "module", None), "NEEDS_VLLM", True):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.weights.hf_export import export_hf

    return export_hf("smollm2-135m", tmp_path_factory.mktemp("vllm-model") / "smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def vllm_server_factory(smollm2_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[Callable[..., VllmServer]]:
    started: list[VllmServer] = []
    logs = tmp_path_factory.mktemp("vllm-logs")
    numbers = itertools.count()  # servers may start from several threads at once: each its own log

    def start(kv_transfer_config: dict[str, Any] | None = None, **fields: Any) -> VllmServer:
        fields.setdefault("model_dir", str(smollm2_hf_dir))
        fields.setdefault("served_model_name", "smollm2-135m")
        fields["env"] = {**SERVER_ENV, **fields.get("env", {})}
        fields.setdefault("log_path", str(logs / f"server-{next(numbers)}.log"))
        fields.setdefault("startup_timeout_s", STARTUP_TIMEOUT_S)
        server = VllmServer(VllmServerConfig(kv_transfer_config=kv_transfer_config, **fields))
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def vllm_server(vllm_server_factory: Callable[..., VllmServer]) -> VllmServer:
    return vllm_server_factory()
