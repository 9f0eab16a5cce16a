"""SIGTERM on ``kvrelay serve`` (kvrelay.server.graceful): queued requests are answered 503 ``shutting_down`` at once,
running ones get the grace to finish, and those still running at its end get the 503 as an error chunk then
``[DONE]``; every one has its access line, ``/health`` is 503 while the drain lasts.

The in-process server's shutdown is begun as uvicorn's signal handler begins it (``should_exit``). The running
request is made to stay running for sure: the worker pauses itself on the request's first event (a paused worker
admits and decodes nothing), so no test waits for time to pass."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvrelay.errors import ConfigError
from kvrelay.server.graceful import drain_worker
from kvrelay.server.protocol import SHUTTING_DOWN_RETRY_AFTER_S
from kvrelay.server.request_ids import CUT_MARKER, REQUEST_ID_HEADER, RequestIds
from kvrelay.server.serve_config import DEFAULT_SHUTDOWN_GRACE_S, ShutdownConfig
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

CHAT = "/v1/chat/completions"
# ignore_eos: random:tiny's answer runs to max_tokens, so the running request cannot end on its own before the drain
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": 40,
        "ignore_eos": True, "temperature": 0}
NEVER_IN_A_TEST_S = 3600.0  # a grace no test lasts: the running request is never cut by it


class Stream:
    """A streamed chat request read on a thread of its own: its status, headers and ``data:`` payloads."""

    def __init__(self, url: str, body: dict) -> None:
        self.first_data, self.status, self.headers, self.data = threading.Event(), None, None, []
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
            self.status, self.headers = r.status_code, r.headers
            if r.status_code != 200:
                self.data.append(r.read().decode())
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.data.append(line[len("data: "):])
                    self.first_data.set()
        self.first_data.set()

    def result(self) -> Stream:
        self._thread.join(120)
        assert not self._thread.is_alive(), "the stream never ended"
        return self


def _pause_on_first_event(srv: LiveServer) -> None:
    """The worker pauses itself once a request it started has sent its first event (after that turn): the request
    stays in the decode batch until the test resumes the worker, or the drain cuts it."""
    worker, begin = srv.worker, srv.worker._begin

    def begin_then_pause_on_its_first_event(job) -> None:
        emit = job.emit

        def emit_then_pause(event) -> None:
            emit(event)
            worker.pause()
            job.emit = emit  # the first event only: resumed, the worker runs the request to its end

        job.emit = emit_then_pause
        begin(job)

    worker._begin = begin_then_pause_on_its_first_event


def _access_lines(caplog) -> dict[str, str]:
    """Each request id's access line, as text."""
    return {r.request_id: r.getMessage() for r in caplog.records if r.name == "kvrelay.server.access"}


def _one_running_two_queued(srv: LiveServer, pool: ThreadPoolExecutor):
    """A running stream that has sent its first chunk, then a plain and a streamed request queued behind it
    (``--max-running 1``)."""
    url = srv.url + CHAT
    _pause_on_first_event(srv)
    running = Stream(url, LONG)
    assert running.first_data.wait(120) and running.status == 200
    srv.wait_until(lambda: srv.worker._paused and srv.worker.num_running == 1, "the stream running, worker paused")
    queued_plain = pool.submit(httpx.post, url, json=LONG, timeout=120)
    queued_stream = Stream(url, LONG)
    srv.wait_until(lambda: srv.num_waiting() == 2, "two requests queued")
    return running, queued_plain, queued_stream


def _assert_shutting_down_body(status: int, body: dict) -> None:
    assert status == 503, body
    assert body["error"]["code"] == "shutting_down" and body["error"]["type"] == "server_error", body


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="kvrelay.server.access")


def test_queued_requests_get_503_at_once_and_the_running_one_finishes_within_the_grace(caplog):
    srv = LiveServer(max_running=1, shutdown=ShutdownConfig(NEVER_IN_A_TEST_S))
    try:
        with ThreadPoolExecutor(2) as pool:
            running, queued_plain, queued_stream = _one_running_two_queued(srv, pool)
            srv.begin_shutdown()
            plain = queued_plain.result(120)  # answered while the running request still runs (the worker is paused)
            _assert_shutting_down_body(plain.status_code, plain.json())
            queued_stream.result()  # its first event is the error: a JSON body, no stream
            _assert_shutting_down_body(queued_stream.status, json.loads(queued_stream.data[0]))
            assert srv.worker.num_running == 1 and not srv.stopped()
            # the drain lasts: the listener is open, /health says so and a new request is refused with the 503
            health = httpx.get(srv.url + "/health", timeout=30)
            assert (health.status_code, health.json()["status"]) == (503, "stopping")
            late = httpx.post(srv.url + CHAT, json=LONG, timeout=30)
            _assert_shutting_down_body(late.status_code, late.json())
            srv.worker.resume()
            running.result()
        srv.wait_until(srv.stopped, "the server stopped once nothing was running")
    finally:
        srv.stop()
    assert running.data[-1] == "[DONE]" and not any('"error"' in d for d in running.data), running.data[-3:]
    finish = [json.loads(d)["choices"][0]["finish_reason"] for d in running.data[:-1] if json.loads(d)["choices"]]
    assert finish[-1] == "length"
    lines = _access_lines(caplog)
    for response, status in ((plain, "503"), (late, "503")):
        assert f" {CHAT} {status} " in lines[response.headers[REQUEST_ID_HEADER]]
    assert f" {CHAT} 503 " in lines[queued_stream.headers[REQUEST_ID_HEADER]]
    assert f" {CHAT} 200 " in lines[running.headers[REQUEST_ID_HEADER]]  # served whole: no cut
    # retry soon, on another replica (as the 429's Retry-After and the tier's 503's say when to retry)
    assert [r.get("retry-after") for r in (plain.headers, queued_stream.headers, late.headers)] == [
        str(SHUTTING_DOWN_RETRY_AFTER_S)] * 3 == ["1"] * 3


def test_a_stream_still_running_when_the_grace_ends_gets_an_error_chunk_then_done(caplog):
    srv = LiveServer(max_running=1, shutdown=ShutdownConfig(0))
    try:
        with ThreadPoolExecutor(2) as pool:
            running, queued_plain, queued_stream = _one_running_two_queued(srv, pool)
            srv.begin_shutdown()  # grace 0: the paused worker cuts the running stream at once
            running.result()
            plain = queued_plain.result(120)
            queued_stream.result()
        srv.wait_until(srv.stopped, "the server stopped")
    finally:
        srv.stop()
    assert running.data[-1] == "[DONE]", running.data[-3:]
    _assert_shutting_down_body(503, json.loads(running.data[-2]))
    assert any(json.loads(d).get("choices") for d in running.data[:-2])  # the text sent before the cut stays
    _assert_shutting_down_body(plain.status_code, plain.json())
    _assert_shutting_down_body(queued_stream.status, json.loads(queued_stream.data[0]))
    lines = _access_lines(caplog)
    assert f" {CHAT} 200 {CUT_MARKER} " in lines[running.headers[REQUEST_ID_HEADER]]
    assert f" {CHAT} 503 " in lines[plain.headers[REQUEST_ID_HEADER]]
    assert f" {CHAT} 503 " in lines[queued_stream.headers[REQUEST_ID_HEADER]]


class _FakeWorker:
    """What ``drain_worker`` reads and calls of the engine worker."""

    def __init__(self, num_in_flight: int) -> None:
        self.num_in_flight, self.calls = num_in_flight, []

    def drain(self) -> None:
        self.calls.append("drain")

    def cut_running(self) -> None:
        self.calls.append("cut")
        self.num_in_flight = 0  # the worker failed them


class _SteppingClock:
    """Each reading is ``step_s`` later than the one before; ``on_tick`` runs at each reading."""

    def __init__(self, step_s: float, on_tick=lambda now_s: None) -> None:
        self.now_s, self.step_s, self.on_tick = 0.0, step_s, on_tick

    def __call__(self) -> float:
        self.now_s += self.step_s
        self.on_tick(self.now_s)
        return self.now_s


def test_the_drain_cuts_only_what_still_runs_when_the_grace_ends():
    worker, clock = _FakeWorker(2), _SteppingClock(1.0)
    cut_at_s = []
    worker.cut_running = lambda: (cut_at_s.append(clock.now_s), _FakeWorker.cut_running(worker))
    assert asyncio.run(drain_worker(worker, 5.0, clock=clock, poll_s=0)) == 2
    assert worker.calls == ["drain", "cut"]
    assert cut_at_s[0] >= 1.0 + 5.0  # the deadline, read at 1.0, passed: the grace is over, no sooner


def test_the_drain_ends_without_a_cut_when_the_running_requests_finish_in_the_grace(caplog):
    worker = _FakeWorker(1)

    def finish_at_3_s(now_s: float) -> None:
        if now_s >= 3.0:
            worker.num_in_flight = 0

    with caplog.at_level(logging.WARNING, logger="kvrelay.server"):
        assert asyncio.run(drain_worker(worker, 25.0, clock=_SteppingClock(1.0, finish_at_3_s), poll_s=0)) == 0
    assert worker.calls == ["drain"]
    # at WARNING, the server's default level: a drain was silent unless its grace ran out
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvrelay.server"] == [
        (logging.WARNING, "shutting down: 1 running request(s) get up to 25 s to finish"),
        (logging.WARNING, "shutting down: the 1 running request(s) finished in 2.0 s")]  # read at 2.0, then 4.0


def test_a_drain_with_nothing_running_says_so_in_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="kvrelay.server"):
        assert asyncio.run(drain_worker(_FakeWorker(0), 25.0, clock=_SteppingClock(1.0), poll_s=0)) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "kvrelay.server"] == [
        "shutting down: no request running"]


def test_a_second_ctrl_c_ends_the_grace_at_once():
    worker = _FakeWorker(1)
    assert asyncio.run(drain_worker(worker, 25.0, forced=lambda: True, clock=_SteppingClock(0.0), poll_s=0)) == 1
    assert worker.calls == ["drain", "cut"]


@pytest.mark.parametrize("grace", [-1, -0.5, float("nan"), float("inf"), True, "5"])
def test_a_shutdown_grace_that_is_no_finite_non_negative_number_is_refused(grace):
    with pytest.raises(ConfigError, match="--shutdown-grace-s"):
        ShutdownConfig(grace)


def test_the_default_grace_ends_within_kubernetes_default_termination_grace_period():
    k8s_termination_grace_period_s = 30  # Kubernetes' default terminationGracePeriodSeconds
    from kvrelay.server.graceful import FLUSH_S

    assert ShutdownConfig().shutdown_grace_s == DEFAULT_SHUTDOWN_GRACE_S
    assert DEFAULT_SHUTDOWN_GRACE_S + FLUSH_S < k8s_termination_grace_period_s
    assert ShutdownConfig(0).shutdown_grace_s == 0  # no grace: running requests are cut at once


def test_a_request_uvicorn_cancels_before_its_answer_gets_a_503_with_its_id(caplog):
    """The last resort (a request that never reached the worker, still running after the drain's flush): uvicorn
    cancels its task; it is answered the 503 in JSON, not uvicorn's plain-text 500, and has its access line."""
    sent: list[dict] = []

    async def never_answers(scope, receive, send) -> None:
        await asyncio.Event().wait()

    async def run() -> None:
        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": CHAT, "root_path": "", "headers": []}
        task = asyncio.create_task(RequestIds(never_answers)(scope, receive, send))
        await asyncio.sleep(0)  # the request is in the app
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    start, body = sent
    assert start["status"] == 503
    request_id = dict(start["headers"])[REQUEST_ID_HEADER.encode()].decode()
    assert dict(start["headers"])[b"retry-after"] == b"1"
    _assert_shutting_down_body(503, json.loads(body["body"]))
    assert f" {CHAT} 503 " in _access_lines(caplog)[request_id]


def test_the_shutdown_grace_flag_is_derived_from_its_config():
    from kvrelay.cli import build_parser

    assert build_parser().parse_args(["serve"]).shutdown_grace_s == DEFAULT_SHUTDOWN_GRACE_S
    assert build_parser().parse_args(["serve", "--shutdown-grace-s", "0"]).shutdown_grace_s == 0


def test_a_ctrl_c_during_the_drain_ends_the_grace_and_a_third_forces_the_exit():
    """uvicorn took the second Ctrl-C as its force_exit: the lifespan's shutdown (the worker's stop) was skipped
    and its cancellation logged as an ERROR traceback. Now the second ends only the grace; a third forces."""
    import signal

    import uvicorn

    from kvrelay.server.graceful import GracefulServer

    server = GracefulServer(uvicorn.Config(app=None), _FakeWorker(1), 25.0)
    server.handle_exit(signal.SIGINT, None)  # the first: shut down
    assert server.should_exit and not server.force_exit and not server.grace_ended
    server.draining = True  # shutdown() began its drain
    server.handle_exit(signal.SIGINT, None)
    assert server.grace_ended and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit
