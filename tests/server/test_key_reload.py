"""SIGHUP reloads the ``--api-keys`` and ``--metrics-key`` files without a restart: the new keys hold from the next
request; a bad new file keeps the old keys in force, with one warning naming the problem; what changed is logged as
counts, never as keys. (SIGHUP killed the server at once: streams cut, nothing logged.)"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.key_reload import KeyReloader
from kvrelay.weights.loader import load_model
from tests.server.conftest import MODEL, START_TIMEOUT_S, Server


def _status(client, key: str, path: str = "/v1/models") -> int:
    return client.get(path, headers={"Authorization": f"Bearer {key}"}).status_code


def _app(settings: ServerSettings) -> TestClient:
    lm = load_model(MODEL)
    store = KVStore(1 << 24)
    return TestClient(create_app(Engine(lm, store), SpanCatalog(store, lm.fingerprint), settings))


def test_a_reload_swaps_the_keys_every_check_reads_and_a_bad_file_keeps_the_old_ones(tmp_path, caplog):
    keys_file, metrics_file = tmp_path / "keys", tmp_path / "metrics"
    keys_file.write_text("# team a\nold-key\nkept-key\n")
    metrics_file.write_text("old-scrape\n")
    settings = ServerSettings(api_keys=frozenset({"old-key", "kept-key"}), metrics_key="old-scrape")
    reloader = KeyReloader(settings, str(keys_file), str(metrics_file))
    with _app(settings) as client, caplog.at_level(logging.WARNING, logger="kvrelay.server"):
        assert _status(client, "old-key") == 200 and _status(client, "new-key") == 401
        keys_file.write_text("# team a, rotated\nnew-key\nkept-key\nthird-key\n")
        metrics_file.write_text("new-scrape\n")
        assert reloader.reload()
        assert _status(client, "old-key") == 401 and _status(client, "new-key") == 200
        assert _status(client, "kept-key") == 200
        assert _status(client, "old-scrape", "/metrics") == 401 and _status(client, "new-scrape", "/metrics") == 200
        assert _status(client, "new-key", "/openapi.json") == 200 and _status(client, "old-key", "/openapi.json") == 401
        [said] = [r.getMessage() for r in caplog.records]
        assert said == ("SIGHUP: keys reloaded (--api-keys: 3 key(s), 2 added, 1 removed; --metrics-key: changed)")
        caplog.clear()

        keys_file.write_text("new-key\nhalf a line\n")  # a bad line: neither file's keys change
        metrics_file.write_text("newer-scrape\n")
        assert not reloader.reload()
        [warning] = caplog.records
        assert warning.levelno == logging.WARNING
        assert warning.getMessage() == ("SIGHUP: keys not reloaded, the previous ones stay in force: --api-keys "
                                        f"{keys_file}: line 2 is no key (a key is visible ASCII without spaces; a "
                                        "comment line starts with #)")
        assert _status(client, "new-key") == 200 and _status(client, "third-key") == 200
        assert _status(client, "new-scrape", "/metrics") == 200 and _status(client, "newer-scrape", "/metrics") == 401
        keys_file.write_text("")  # emptied (a file being rewritten): refused too
        assert not reloader.reload() and "the file holds no key" in caplog.records[-1].getMessage()
        keys_file.unlink()
        assert not reloader.reload() and "no such file" in caplog.records[-1].getMessage()
        assert _status(client, "new-key") == 200
    assert not any(key in r.getMessage() for r in caplog.records for key in ("new-key", "kept-key", "third-key",
                                                                              "new-scrape", "old-scrape"))


def test_without_key_files_a_reload_changes_nothing_and_says_so(caplog):
    settings = ServerSettings()
    with caplog.at_level(logging.WARNING, logger="kvrelay.server"):
        assert not KeyReloader(settings, None, None).reload()
    assert settings.api_keys == frozenset() and "no key file to reload" in caplog.records[-1].getMessage()


def _wait_for_output(srv: Server, text: str, count: int = 1) -> str:
    """The server's output once ``text`` appears ``count`` times in it: waits for what the signal caused, the
    bound only stops a broken server."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        output = srv.output()
        if output.count(text) >= count:
            return output
        assert srv.alive(), output
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never logged:\n{srv.output()}")


def test_sighup_to_kvrelay_serve_reloads_the_key_file_and_the_server_keeps_serving(tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("old-key\n")
    srv = Server("--api-keys", str(keys_file))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            assert _status(client, "old-key") == 200 and _status(client, "new-key") == 401
            keys_file.write_text("new-key\n")
            srv.proc.send_signal(signal.SIGHUP)
            _wait_for_output(srv, "SIGHUP: keys reloaded (--api-keys: 1 key(s), 1 added, 1 removed)")
            assert srv.alive() and _status(client, "old-key") == 401 and _status(client, "new-key") == 200
            keys_file.write_text("bad key\n")
            srv.proc.send_signal(signal.SIGHUP)
            _wait_for_output(srv, "SIGHUP: keys not reloaded, the previous ones stay in force: --api-keys")
            assert srv.alive() and _status(client, "new-key") == 200 and _status(client, "old-key") == 401
        output = srv.output()
        assert "new-key" not in output and "old-key" not in output and "Traceback" not in output
    finally:
        srv.stop()
