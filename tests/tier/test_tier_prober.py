"""A shared tier that is down costs its callers nothing: the first failed call marks it down, every later call skips
the backend (a flag read), and a prober thread alone probes it, at doubling intervals, until it answers; then it is
up again. A fake backend that fails like a hung server (its client's timeout) counts every call it gets; the
prober's sleeps are the test's steps, so no assertion depends on how long anything took."""

from __future__ import annotations

import queue
import threading
from collections import Counter

import pytest
import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.tier.backends.base import span_key
from kvrelay.tier.prober import TierProber
from kvrelay.tier.records import TierRecords
from kvrelay.tier.tiered import TieredStore

STEP_TIMEOUT_S = 30.0  # only a deadlock's bound: each step waits for an event, never for time to pass


def span(n: int = 20) -> StoredSpan:
    k = torch.randn(2, 2, n, 4, generator=torch.Generator().manual_seed(n))
    return StoredSpan(tuple(range(100, 100 + n)), 0, k, -k, "fp")


class HangingBackend:
    """Bytes in a dict; while ``hung`` is set every call raises as a hung server's client does after its timeout."""

    url = "fake://hanging"
    num_bad_records = 0

    def __init__(self) -> None:
        self.hung = threading.Event()
        self.calls: Counter[str] = Counter()  # every call made, hung or not, by method
        self.probes: queue.Queue[bool] = queue.Queue()  # each ping's outcome, for the test to wait on
        self._data: dict[str, tuple[bytes, bytes]] = {}

    def _enter(self, method: str) -> None:
        self.calls[method] += 1
        if self.hung.is_set():
            raise TimeoutError("Timeout reading from socket")

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        self._enter("put")
        self._data[key] = (value, meta)

    def get_meta(self, key: str) -> bytes | None:
        self._enter("get_meta")
        return self._data[key][1] if key in self._data else None

    def get_value(self, key: str) -> bytes | None:
        self._enter("get_value")
        return self._data[key][0] if key in self._data else None

    def delete(self, key: str) -> None:
        self._enter("delete")
        self._data.pop(key, None)

    def touch(self, key: str) -> bool:
        self._enter("touch")
        return key in self._data

    def announce(self, channel: str, message: bytes) -> None:
        self._enter("announce")

    def poll(self, channel: str, cursor: str | None) -> tuple[list[bytes], str | None]:
        self._enter("poll")
        return [], cursor

    def ping(self) -> None:
        try:
            self._enter("ping")
        except TimeoutError:
            self.probes.put(False)
            raise
        self.probes.put(True)

    def close(self) -> None:
        pass


class Steps:
    """The prober's ``wait``: records each interval it was asked to sleep, then blocks until the test's ``step``."""

    def __init__(self) -> None:
        self.intervals_s: list[float] = []
        self._go = threading.Semaphore(0)

    def wait(self, interval_s: float) -> bool:
        self.intervals_s.append(interval_s)
        return not self._go.acquire(timeout=STEP_TIMEOUT_S)  # not released in time: stop, as if stopped

    def step(self) -> None:
        self._go.release()


def hanging_store(min_s: float = 0.5, max_s: float = 5.0) -> tuple[TieredStore, HangingBackend, Steps]:
    backend, steps = HangingBackend(), Steps()
    store = TieredStore(1 << 22, backend, "fp", min_backoff_s=min_s, max_backoff_s=max_s)
    store.health.prober.wait = steps.wait
    return store, backend, steps


def test_a_down_tier_is_never_called_by_the_engine_and_the_prober_brings_it_back():
    store, backend, steps = hanging_store()
    store.put("a", span(20))
    store.remove("a")  # only the tier has it
    before = sum(backend.calls.values())
    backend.hung.set()
    assert "a" not in store  # the one call an outage costs: it times out and marks the tier down
    assert not store.health.up and sum(backend.calls.values()) == before + 1
    records = TierRecords(backend, store.health, "resp", 1 << 20)
    for i in range(20):  # every kind of engine- and request-side call, while down
        assert "a" not in store and f"new-{i}" not in store
        store.put(f"p{i}", span(21 + i))
        assert store.poll_published() == [] and not store.delete_from_tier("a")
        assert records.get("", "r") is None and not records.exists("", "r") and not records.put("", "r", {})
    assert sum(backend.calls.values()) - backend.calls["ping"] == before + 1  # none of them reached it
    assert store.health.num_failures == 1 and store.health.num_skipped == 20 * 8
    assert [d.reason for d in store.take_decisions()] == ["tier unavailable"] * 41
    assert "p0" in store  # published while down: served from memory

    for _ in range(2):  # the prober, on its own thread: two probes while it hangs...
        steps.step()
        assert backend.probes.get(timeout=STEP_TIMEOUT_S) is False
    assert not store.health.up
    backend.hung.clear()
    steps.step()  # ...then one that answers
    assert backend.probes.get(timeout=STEP_TIMEOUT_S) is True
    store.health.probe_thread.join(STEP_TIMEOUT_S)
    assert store.health.up and not store.health.probe_thread.is_alive()
    assert steps.intervals_s == [0.5, 1.0, 2.0]  # doubling from min_backoff_s
    assert backend.calls["ping"] == 3
    assert "a" in store  # the next lookup reaches the tier again
    store.put("after", span(50))  # and the first write flushes what was published while it was down
    assert _written(backend) == [f"p{i}" for i in range(20)] + ["after"]


def _written(backend: HangingBackend) -> list[str]:
    """Which of the test's span ids the backend holds."""
    ids = [f"p{i}" for i in range(20)] + ["after"]
    return [sid for sid in ids if span_key("", "fp", sid) in backend._data]


def test_a_second_outage_starts_a_new_prober_and_close_stops_it():
    store, backend, steps = hanging_store()
    for outage in range(2):
        backend.hung.set()
        assert "x" not in store and not store.health.up
        backend.hung.clear()
        steps.step()
        assert backend.probes.get(timeout=STEP_TIMEOUT_S) is True
        store.health.probe_thread.join(STEP_TIMEOUT_S)
        assert store.health.up, outage
    backend.hung.set()
    assert "x" not in store
    thread = store.health.probe_thread
    store.close()  # stops the prober: its thread ends, the tier stays down
    steps.step()
    thread.join(STEP_TIMEOUT_S)
    assert not thread.is_alive() and not store.health.up
    assert backend.calls["ping"] == 2  # one probe per outage that answered; none after close


def test_probe_intervals_double_up_to_the_cap():
    waits: list[float] = []
    failures = iter(range(6))

    def probe() -> None:
        if next(failures, None) is not None:
            raise ConnectionError("refused")

    prober = TierProber(probe, 0.5, 5.0, wait=lambda s: waits.append(s) or False)
    assert prober.wait_until_up()
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0] and prober.num_probes == 7
    assert isinstance(prober.last_error, ConnectionError)
    with pytest.raises(ValueError):
        TierProber(probe, 0.0, 5.0)


def test_down_for_s_reads_the_injected_clock():
    now = [100.0]
    store, backend, _steps = hanging_store()
    store.health.clock = lambda: now[0]
    assert store.health.down_for_s() is None
    backend.hung.set()
    assert "x" not in store
    now[0] += 12.5
    assert store.health.down_for_s() == 12.5
    store.close()


def test_a_tier_nobody_calls_is_pinged_while_up_and_found_down_by_a_ping(caplog):
    """A replica with no traffic makes no call that could fail: the watcher's ping alone finds the tier dead, marks
    it down (one warning, no failed call counted) and leaves it to the prober; while down the watcher pings nothing."""
    store, backend, steps = hanging_store()
    watch_steps = Steps()
    store.health.watch(interval_s=5.0, wait=watch_steps.wait)
    watch_steps.step()  # the tier answers: still up
    assert backend.probes.get(timeout=STEP_TIMEOUT_S) is True
    assert store.health.up and backend.calls["ping"] == 1
    backend.hung.set()
    with caplog.at_level("WARNING", logger="kvrelay.tier"):
        watch_steps.step()  # no request at all: the ping finds it dead
        assert backend.probes.get(timeout=STEP_TIMEOUT_S) is False
        _wait_for(lambda: not store.health.up)  # the ping's failure is handled on the watcher's thread
    assert not store.health.up and store.health.num_failures == 0
    assert [r.getMessage() for r in caplog.records if "unavailable (ping: TimeoutError" in r.getMessage()] != []
    assert sum(backend.calls.values()) == backend.calls["ping"] == 2  # no other call reached it
    watch_steps.step()  # down: the watcher leaves the probing to the prober
    backend.hung.clear()
    steps.step()  # the prober's probe answers: up again
    assert backend.probes.get(timeout=STEP_TIMEOUT_S) is True
    store.health.probe_thread.join(STEP_TIMEOUT_S)
    assert store.health.up and backend.calls["ping"] == 3 and watch_steps.intervals_s[:3] == [5.0, 5.0, 5.0]
    store.close()
    watch_steps.step()
    store.health.watch_thread.join(STEP_TIMEOUT_S)
    assert not store.health.watch_thread.is_alive() and backend.calls["ping"] == 3  # closed: no more pings


def _wait_for(condition) -> None:
    """Wait for a state another thread was made to reach (not for time to pass): the bound only stops a deadlock."""
    done = threading.Event()
    for _ in range(int(STEP_TIMEOUT_S / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("the state was never reached")


def test_open_store_watches_its_tier_and_close_ends_the_watcher(tmp_path):
    from kvrelay.tier.prober import UP_PROBE_INTERVAL_S
    from kvrelay.tier.tiered import open_store

    assert 1 <= UP_PROBE_INTERVAL_S <= 10  # a dead tier shows within seconds, at one cheap ping per interval
    store = open_store(f"disk:{tmp_path}", 1 << 20)
    watcher = store.health.watch_thread
    assert watcher is not None and watcher.is_alive()
    store.close()
    watcher.join(STEP_TIMEOUT_S)
    assert not watcher.is_alive()
