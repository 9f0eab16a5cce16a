"""vLLM's OpenAI server as a child process (through ``kvrelay.vllm.launch``): started on a free 127.0.0.1 port,
waited on until ``/health`` answers, always stopped with every process it started. Tests and benchmarks use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.errors import ConfigError

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class VllmServerConfig:
    """How to start one vLLM OpenAI server. ``startup_timeout_s`` bounds the start (loading SmolLM2 takes ~30 s
    on an idle 2-core machine, minutes on a loaded one); ``extra_args`` are any further ``vllm serve`` flags."""

    model_dir: str
    served_model_name: str = "model"
    kv_transfer_config: dict[str, Any] | None = None
    max_model_len: int = 4096
    # vLLM's CPU backend casts an fp32 checkpoint to bf16 unless told; fp32 computes what kvrelay computes
    dtype: str = "float32"
    enforce_eager: bool = True  # no torch.compile / graph capture: a start in seconds, not minutes, on CPU
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 900.0
    log_path: str | None = None  # default: vllm-serve-PORT.log in the temp folder

    def __post_init__(self) -> None:
        if not Path(self.model_dir, "config.json").is_file():
            raise ConfigError(f"{self.model_dir}: no config.json (export one with `kvrelay export-hf MODEL DIR`)")
        for name in ("max_model_len", "max_logprobs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.startup_timeout_s > 0:
            raise ConfigError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")

    def serve_args(self, port: int) -> list[str]:
        args = ["serve", self.model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.served_model_name, "--max-model-len", str(self.max_model_len),
                "--max-logprobs", str(self.max_logprobs), "--seed", str(self.seed), "--dtype", self.dtype]
        args.append("--enforce-eager" if self.enforce_eager else "--no-enforce-eager")
        args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)


class VllmServer:
    """A running vLLM OpenAI server; ``stop()`` (or leaving the ``with`` block) ends it and its engine
    processes (they share the process group it was started in)."""

    def __init__(self, config: VllmServerConfig, python: str = sys.executable) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = config.served_model_name
        log = config.log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vllm-serve-{self.port}.log")
        self.log_path = Path(log)
        self._log = open(self.log_path, "w+")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **config.env}
        self.startup_s = float("nan")
        start = time.monotonic()
        self.proc = subprocess.Popen([python, "-m", "kvrelay.vllm.launch", *config.serve_args(self.port)],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(start + config.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - start

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.output_tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"vLLM did not answer /health within {self.config.startup_timeout_s:.0f} s:\n"
                           f"{self.output_tail()}")

    @property
    def base_url(self) -> str:
        """The OpenAI API root, for ``openai.OpenAI(base_url=...)``."""
        return f"{self.url}/v1"

    def client(self, **kwargs: Any):
        """The official ``openai`` client on this server (no retries: a failure shows as it is)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0,
                             **{"timeout": 600.0, **kwargs})

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        """POST JSON to one of vLLM's own routes (``/tokenize``...), the answer as a dict."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def output_tail(self, num_chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after a grace period; idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine processes too, if any outlived the server
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
