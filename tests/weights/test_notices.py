"""The weights layer's one-off notices (a conversion starting, a cache rebuilt) go where the process logs: a JSON
line under ``kvrelay serve --log-format json``, where a plain line on stderr broke every collector that parses the
stream; a plain ``kvrelay: ...`` line from a command line that set up no logging."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvrelay.cli import build_parser
from kvrelay.server.cli import build_app
from kvrelay.server.json_logs import JsonLogFormatter
from kvrelay.weights.notices import notice


def test_without_logging_set_up_a_notice_is_a_plain_stderr_line(monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    notice("converting m.gguf once")
    assert capsys.readouterr().err == "kvrelay: converting m.gguf once\n"


def test_under_json_logging_a_notice_is_a_json_record_of_the_weights_logger(monkeypatch, capsys):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter())
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    notice("converting m.gguf once (cached in /c)")
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert (record["logger"], record["level"], record["message"]) == (
        "kvrelay.weights", "WARNING", "converting m.gguf once (cached in /c)")
    assert capsys.readouterr().err == ""  # nothing besides the record


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("log_format, progress", [("json", False), ("text", True)])
def test_serve_draws_the_conversion_bar_only_in_text_logs(monkeypatch, log_format, progress):
    seen: dict = {}

    def load_model(*args, **kwargs):
        seen.update(kwargs)
        raise _Loaded

    monkeypatch.setattr("kvrelay.weights.loader.load_model", load_model)
    args = build_parser().parse_args(["serve", "--model", "smollm2-135m", "--port", "0", "--log-format", log_format])
    with pytest.raises(_Loaded):
        build_app(args)
    assert seen["progress"] is progress
