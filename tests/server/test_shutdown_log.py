"""Ctrl-C on ``kvrelay serve`` with a request running: uvicorn cancels the request after its graceful wait and logs
it on ``uvicorn.error``; the user reads one line, not a CancelledError traceback (other errors keep theirs)."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest

from kvrelay.server.shutdown_log import CUT_OFF_MESSAGE, UVICORN_ERROR_LOGGER, install_cut_off_filter


@pytest.fixture
def uvicorn_error_log():
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    saved_filters, saved_propagate = list(logger.filters), logger.propagate
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.propagate = False
    install_cut_off_filter()
    install_cut_off_filter()  # idempotent: one filter, one line
    yield logger, out
    logger.removeHandler(handler)
    logger.filters[:], logger.propagate = saved_filters, saved_propagate


def _log_exception(logger: logging.Logger, exc: BaseException) -> None:
    try:
        raise exc
    except BaseException:
        logger.error("Exception in ASGI application\n", exc_info=True)  # as uvicorn's run_asgi logs it


def _shutdown_cancels(logger: logging.Logger) -> None:
    logger.error("Cancel %s running task(s), timeout graceful shutdown exceeded", 1)  # as uvicorn's shutdown logs it


def test_a_request_cancelled_at_shutdown_is_one_line(uvicorn_error_log):
    logger, out = uvicorn_error_log
    _shutdown_cancels(logger)
    _log_exception(logger, asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded"))
    assert out.getvalue().splitlines()[-1] == CUT_OFF_MESSAGE and "Traceback" not in out.getvalue()


def test_a_request_cancelled_while_serving_keeps_its_traceback(uvicorn_error_log):
    """No shutdown asked for: a cancelled request is a bug to see, not a stop to report."""
    logger, out = uvicorn_error_log
    _log_exception(logger, asyncio.CancelledError())
    assert "Traceback" in out.getvalue() and CUT_OFF_MESSAGE not in out.getvalue()


def test_other_errors_keep_their_traceback(uvicorn_error_log):
    logger, out = uvicorn_error_log
    _log_exception(logger, RuntimeError("a real bug"))
    assert "Traceback" in out.getvalue() and "RuntimeError: a real bug" in out.getvalue()


def test_serve_installs_the_filter_before_uvicorn_runs(monkeypatch):
    """cmd_serve puts it on uvicorn's logger (uvicorn's own log config keeps a logger's filters)."""
    import gc

    from kvrelay.cli import build_parser
    from kvrelay.server import cli as serve_cli
    from kvrelay.server import graceful
    from kvrelay.server.shutdown_log import CutOffRequestFilter

    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    monkeypatch.setattr(logger, "filters", [])
    seen = []

    class _RecordingServer:  # kvrelay serve's uvicorn server (kvrelay.server.graceful), run without serving
        started = True

        def run(self) -> None:
            seen.append(list(logger.filters))

    monkeypatch.setattr(graceful, "graceful_server", lambda *a, **k: _RecordingServer())
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the serving process's, not this test session's
    monkeypatch.setattr(serve_cli, "build_app", lambda args: _FakeApp())
    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--port", "0"])
    assert serve_cli.cmd_serve(args) == 0
    assert len(seen) == 1 and any(isinstance(f, CutOffRequestFilter) for f in seen[0])


class _FakeLm:
    decode_weights, matmuls = "fp32", "F.linear"


class _FakeApp:
    class state:  # noqa: N801  (the app.state.worker.engine.lm path cmd_serve reads)
        class worker:  # noqa: N801
            class engine:  # noqa: N801
                lm = _FakeLm

        class context:  # noqa: N801  (the settings whose keys SIGHUP reloads)
            settings = None
