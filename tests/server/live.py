"""A real uvicorn server on 127.0.0.1 in this process (random:tiny), always stopped: tests reach its worker
(``pause``/``resume``: overlap made certain, not hoped for) and its store's clock (time moved, not waited)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import openai

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.graceful import graceful_server
from kvrelay.weights.loader import load_model
from tests.server.conftest import MODEL, free_port

_LM = {}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class LiveServer:
    def __init__(self, budget_bytes: int = 1 << 28, clock: Callable[[], float] | None = None,
                 namespace_idle_s: float | None = None, **settings) -> None:
        lm = _LM.get(MODEL) or _LM.setdefault(MODEL, load_model(MODEL))
        store = KVStore(budget_bytes, **({"clock": clock} if clock is not None else {}))
        store.set_namespace_idle_s(namespace_idle_s)
        self.app = create_app(Engine(lm, store, methods=("epic", "full")),
                              SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode),
                              ServerSettings(**settings))
        self.worker = self.app.state.worker
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # kvrelay serve's server: its shutdown drains the worker (a test's stop with a request in flight too)
        self._server = graceful_server(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        started = threading.Event()
        for _ in range(600):  # the server's own startup flag, checked every 0.05 s
            if self._server.started:
                started.set()
                break
            threading.Event().wait(0.05)
        if not started.is_set():
            self.stop()
            raise RuntimeError("the in-process server did not start")

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def num_queued(self) -> int:
        """Requests submitted and not yet admitted (still being prepared, or waiting)."""
        with self.worker._cond:
            return len(self.worker._waiting) + self.worker._num_preparing

    def num_waiting(self) -> int:
        """Requests prepared and waiting for admission."""
        with self.worker._cond:
            return len(self.worker._waiting)

    def wait_until(self, condition: Callable[[], bool], what: str, limit_s: float = 60) -> None:
        """Wait for a state the test caused (not for time to pass): ``limit_s`` only bounds a broken server."""
        for _ in range(int(limit_s / 0.02)):
            if condition():
                return
            threading.Event().wait(0.02)
        raise AssertionError(f"never reached: {what}")

    def begin_shutdown(self) -> None:
        """What SIGTERM does to ``kvrelay serve`` (uvicorn's handler sets this flag): the drain begins."""
        self._server.should_exit = True

    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        self.worker.resume()
        self._server.should_exit = True
        self._thread.join(timeout=30)
