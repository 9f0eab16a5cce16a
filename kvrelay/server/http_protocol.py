"""uvicorn's HTTP/1.1 protocol (h11) answering a request it cannot parse with OpenAI's error JSON.

A malformed request line or header block never reaches the app: uvicorn answers it itself, in plain text
("Invalid HTTP request received."). Clients of an OpenAI-compatible server parse every 4xx body as
``{"error": {...}}``, so this subclass sends that shape instead (same status, 400, and the connection closes as
before). uvicorn takes the class as its ``http`` setting (``kvrelay serve`` passes it); docs/serving-errors.md
lists what still answers outside the app.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MALFORMED_MESSAGE = "malformed HTTP request: its request line or headers could not be parsed"


def malformed_request_body() -> bytes:
    return json.dumps({"error": {"message": MALFORMED_MESSAGE, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_http_request"}}).encode()


class JsonErrorH11Protocol(H11Protocol):
    """``H11Protocol`` whose own 400 (a request h11 cannot parse) is OpenAI's error JSON, not plain text."""

    def send_400_response(self, msg: str) -> None:  # uvicorn's hook for h11.RemoteProtocolError
        body = malformed_request_body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
