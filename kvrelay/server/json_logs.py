"""``kvrelay serve --log-format json``: one JSON object a line, for log collectors (Loki, Elasticsearch, Cloud
Logging) that index fields instead of parsing text.

Every line has ``time`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger`` and ``message``; a line about one
request has its ``request_id``; the access line adds ``http`` (method, path, status, cut, duration_ms and, when
given, the client's own request id); a line with a traceback has it in ``exception``. uvicorn's own lines go through
the same formatter (``log_config`` is left to the root logger's handler), so the whole stream is JSON. Messages are
written as JSON strings, so a newline a client planted in a path or a body stays inside its line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from kvrelay.server.request_ids import current_request_id

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

#: record attributes a log call passes with ``extra=`` that become fields of the JSON line
FIELDS = ("request_id", "http")


class JsonLogFormatter(logging.Formatter):
    """A ``logging.Formatter`` writing each record as one JSON object (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _rfc3339_ms(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # default=str: a field some library passes that JSON has no type for is written as its text, never an error
        return json.dumps(line, ensure_ascii=False, default=str)


class RequestIdFilter(logging.Filter):
    """Gives a record logged while a request's task runs (a handler's own lines, a library's warning about its body)
    that request's id, where the log call passed none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id() or None
        return True


def _rfc3339_ms(created_s: float) -> str:
    whole_s = int(created_s)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole_s)) + f".{int((created_s - whole_s) * 1e3):03d}Z"


def configure_logging(level: str, log_format: str) -> None:
    """The root logger's one handler (stderr) at ``level``, writing text or JSON; ``logging.basicConfig`` for text,
    so a handler a caller installed first is kept as basicConfig keeps it."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if log_format == "text":
        logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler])


def announce(message: str, log_format: str, level: int = logging.INFO) -> None:
    """A line the server always prints (the address it serves on, or why it cannot start), whatever the log level:
    as is, or in JSON as a record of logger ``kvrelay.server`` so that a collector reading JSON lines parses it
    too."""
    if log_format == "json":
        record = logging.makeLogRecord({"name": "kvrelay.server", "levelno": level,
                                        "levelname": logging.getLevelName(level), "msg": message,
                                        "created": time.time()})
        message = JsonLogFormatter().format(record)
    print(message, file=sys.stderr, flush=True)
