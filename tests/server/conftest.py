"""A real ``python -m kvrelay.server`` process on 127.0.0.1 (free port, random:tiny), always stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "random:tiny"
SMOL = "smollm2-135m"
START_TIMEOUT_S = 180  # bounds a broken server; a loaded 2-core machine took ~50 s to start random:tiny


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str, wait: bool = True) -> None:
        """Start the process; with ``wait`` (the default) return once it answers /health (``wait_started``)."""
        if "--quality-target" not in flags:  # these tests check what --method does; the guard's own run it on
            flags = ("--quality-target", "off", *flags)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"kvrelay-serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.server", "--model", MODEL, "--port", str(self.port), *flags],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        self._deadline = time.monotonic() + START_TIMEOUT_S
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Return once the server answers /health; stop it and raise with its output when it exits or is late."""
        while time.monotonic() < self._deadline:
            if self.proc.poll() is not None:
                output = self.output()  # read before stop() closes the log
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{output}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        output = self.output()
        self.stop()
        raise RuntimeError(f"server did not start in {START_TIMEOUT_S} s:\n{output}")

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def metric(self, name: str) -> float:
        """The value of one unlabelled sample from /metrics."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()


def start_servers(*flag_sets: tuple[str, ...]) -> list[Server]:
    """One server per flag set, their starts overlapping (each start is one busy core for several seconds), all
    answering /health on return; all stopped if one fails to start."""
    servers = [Server(*flags, wait=False) for flags in flag_sets]
    try:
        for srv in servers:
            srv.wait_started()
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return servers


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    # no idle reclaim: tests read the store's gauges before and after their own requests, and a namespace an earlier
    # test left idle for the default 300 s would drop out between the two (reclaim is tested with a clock: test_tenancy)
    srv = Server("--kv-budget-gb", "0.25", "--kv-namespace-idle-s", "0")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smol() -> Iterator[Server]:
    """One SmolLM2-135M server for every test that needs a real model's answers (each test its own cache_salt)."""
    srv = Server("--model", SMOL, "--kv-budget-gb", "0.5")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory) -> Iterator[Server]:
    """API keys configured, one request decoded at a time and a queue of one: 401 and 429 paths."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("key-a\nkey-b\n")
    srv = Server("--api-keys", str(keys), "--max-queue", "1", "--max-running", "1")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def compiled(monkeypatch) -> list:
    """The grammars the server compiled in this test (the real compile, recorded)."""
    import kvrelay.server.grammar as grammar

    calls, real = [], grammar.constraint_for
    monkeypatch.setattr(grammar, "constraint_for", lambda *a: calls.append(a) or real(*a))
    return calls
