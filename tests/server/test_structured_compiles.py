"""Where a ``structured_outputs`` schema is validated and compiled: on the grammar threads
(kvrelay.server.grammar_compiles), never on the event loop that answers every request; and a namespace's second
request with the same constraint takes the compiled grammar from its cache."""

from __future__ import annotations

import threading
import uuid

import pytest

from kvrelay.server import grammar, schemas, structured_outputs
from tests.server.conftest import MODEL
from tests.server.live import LiveServer

pytestmark = pytest.mark.skipif(grammar.xgr is None, reason="needs xgrammar")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_a_schema_is_validated_and_compiled_on_the_grammar_threads_once_per_namespace(monkeypatch):
    threads: list[tuple[str, str]] = []
    real_check, real_compile = schemas.check_schema, structured_outputs.compile_structured

    def check(*args, **kw):
        threads.append(("check", threading.current_thread().name))
        return real_check(*args, **kw)

    def compile_(*args):
        threads.append(("compile", threading.current_thread().name))
        return real_compile(*args)

    monkeypatch.setattr(schemas, "check_schema", check)
    monkeypatch.setattr(structured_outputs, "compile_structured", compile_)
    srv = LiveServer()
    try:
        salt = uuid.uuid4().hex
        for _ in range(2):
            srv.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                extra_body={"cache_salt": salt, "structured_outputs": {"json": SCHEMA}})
    finally:
        srv.stop()
    assert [what for what, _ in threads] == ["compile", "check"], threads  # the second request: the cache
    assert all(name.startswith("kvrelay-grammar") for _, name in threads), threads
