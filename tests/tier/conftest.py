"""A real ``redis-server`` on a free loopback port, started and stopped by the tests themselves."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process: no persistence, bounded memory with LRU eviction."""

    def __init__(self, maxmemory: str = "256mb") -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get("KVRELAY_ALLOW_NO_REDIS"):
                pytest.skip("redis-server is not installed (KVRELAY_ALLOW_NO_REDIS set)")
            pytest.fail("redis-server is not installed: run `make install` (it installs the Debian package)")
        self.exe, self.maxmemory = exe, maxmemory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        for _attempt in range(3):  # the free port may be taken between the probe and the bind
            self.proc = subprocess.Popen(
                [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return self
            self.stop()
            self.port = free_port()
        raise RuntimeError("redis-server did not start on a free loopback port in 3 attempts")

    def _wait_ready(self) -> bool:
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The module's server, emptied for each test."""
    c = redis_server.client()
    c.flushall()
    c.close()
    return redis_server.url


@pytest.fixture
def own_redis():
    """A server of this test's own, which it may kill and restart."""
    server = RedisServer().start()
    yield server
    server.stop()
