"""``kvrelay serve --log-format json``: every line the server writes is one JSON object (uvicorn's own lines and the
address line included), a request's lines carry its ``request_id`` as a field, and the access line's facts are
fields (``http``) a collector can index, not text to parse."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrelay.server.json_logs import JsonLogFormatter, RequestIdFilter
from kvrelay.server.request_ids import _current_id

REPO = Path(__file__).resolve().parents[2]


def _record(msg: str, **extra) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "kvrelay.test", "levelno": logging.ERROR, "levelname": "ERROR",
                                    "msg": msg, "args": (), "created": 1767225600.25, **extra})
    return record


def test_a_record_is_one_json_object_with_its_fields():
    line = JsonLogFormatter().format(_record("a\nforged line", request_id="req_1", http={"status": 200}))
    assert "\n" not in line
    assert json.loads(line) == {"time": "2026-01-01T00:00:00.250Z", "level": "ERROR", "logger": "kvrelay.test",
                                "message": "a\nforged line", "request_id": "req_1", "http": {"status": 200}}


def test_a_traceback_is_a_field_of_its_line():
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed", exc_info=sys.exc_info())
    line = JsonLogFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "failed"
    assert parsed["exception"].startswith("Traceback") and "ValueError: boom" in parsed["exception"]


def test_a_line_logged_while_a_request_runs_names_that_request():
    record = _record("inside")
    token = _current_id.set("req_abc")
    try:
        RequestIdFilter().filter(record)
    finally:
        _current_id.reset(token)
    outside = _record("outside")
    RequestIdFilter().filter(outside)
    named = _record("named", request_id="req_own")
    RequestIdFilter().filter(named)
    assert record.request_id == "req_abc" and outside.request_id is None and named.request_id == "req_own"
    assert "request_id" not in json.loads(JsonLogFormatter().format(outside))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvrelay serve exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"kvrelay serve did not answer /health within {limit_s} s")


def test_serve_writes_only_json_lines_with_request_ids():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay", "serve", "--model", "random:tiny", "--method", "full",
                             "--quality-target", "off", "--port", str(port), "--log-level", "info",
                             "--log-format", "json"], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        ok = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"x-request-id": "trace-7"},
                        json={"model": "random:tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        missing = httpx.get(url + "/v1/no%0Asuch", timeout=10)
        assert ok.status_code == 200 and missing.status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]  # a line that is no JSON fails here
    assert any(line["logger"] == "kvrelay.server" and f"127.0.0.1:{port}" in line["message"] for line in lines)
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own lines, as JSON too
    access = {line["request_id"]: line for line in lines if line["logger"] == "kvrelay.server.access"}
    chat = access[ok.headers["x-request-id"]]
    assert chat["http"]["method"] == "POST" and chat["http"]["path"] == "/v1/chat/completions"
    assert chat["http"]["status"] == 200 and chat["http"]["cut"] is False and chat["http"]["duration_ms"] > 0
    assert chat["http"]["client_request_id"] == "trace-7"
    lost = access[missing.headers["x-request-id"]]["http"]
    assert lost["status"] == 404 and lost["path"] == "/v1/no%0Asuch"


def test_why_serve_cannot_start_is_a_json_line_too():
    # the one line an operator needs when the server does not come up was plain text in the JSON stream
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "kvrelay", "serve", "--model", "no-such-model", "--log-format",
                           "json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]  # a line that is no JSON fails
    assert [line["level"] for line in lines] == ["ERROR"]
    assert lines[0]["logger"] == "kvrelay.server" and "unknown model 'no-such-model'" in lines[0]["message"]
