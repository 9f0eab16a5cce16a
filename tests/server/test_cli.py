"""``kvrelay serve``'s flags: a bad value is one line on stderr and exit status 2, before any model loads."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kvrelay.cli import build_parser
from kvrelay.errors import ConfigError
from kvrelay.server.app import DEFAULT_MAX_TOKENS
from kvrelay.server.cli import build_app, cmd_serve


@pytest.mark.parametrize("flags, words", [
    (("--port", "99999"), "--port must be a TCP port in [0, 65535], got 99999"),
    (("--port", "-1"), "--port must be a TCP port in [0, 65535], got -1"),
    (("--kv-budget-gb", "0"), "--kv-budget-gb must be positive"),
    (("--default-max-tokens", "0"), "--default-max-tokens must be an integer >= 1, got 0"),
    (("--default-max-tokens", "-5"), "--default-max-tokens must be an integer >= 1, got -5"),
    # was checked once the model had loaded (ServerSettings was built after it)
    (("--prefill-chunk-tokens", "0"), "--prefill-chunk-tokens must be an integer >= 1, got 0"),
    (("--shutdown-grace-s", "-1"), "--shutdown-grace-s must be a finite number of seconds >= 0, got -1.0"),
    # it started, then answered every request a 400 blaming the request's kvrelay.method
    (("--method", "rksc", "--quality-target", "off"), "--method rksc: plans branches"),
    (("--methods", "epic,rksc[skip_gap=0.1]"), "--methods rksc[skip_gap=0.1]: plans branches"),
])
def test_a_bad_serve_flag_is_refused_before_the_model_loads(capsys, flags, words):
    # the port was a traceback from uvicorn's bind, after the model had loaded
    args = build_parser().parse_args(["serve", "--model", "no-such-model-anywhere", *flags])
    assert cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "no-such-model" not in err


@pytest.mark.parametrize("store, words", [
    ("redis:/oops", "--store: unknown store 'redis:/oops': expected memory, disk:PATH or redis://host:port/db"),
    ("redis://admin:s3cret@host:notaport/0", "--store: bad Redis URL 'redis://***@host:notaport/0': Port could not "
                                             "be cast to integer value"),
    # redis-py read these as database 0 and 12: replicas meant to keep apart shared keys
    ("redis://127.0.0.1:6379/abc", "the database after the address must be a number (redis://host:port/0), got 'abc'"),
    ("redis://127.0.0.1:6379/1/2", "got '1/2'"),
    ("disk:", "--store: store URL 'disk:' needs a directory: disk:PATH"),
    ("disk:{file}/spans", "is not a directory"),
])
def test_a_bad_store_is_one_line_before_the_model_loads(capsys, tmp_path, store, words):
    # it was refused by open_store once the model had loaded (8.7 s and 1.35 GB RSS for a 135M model)
    (tmp_path / "f").write_text("a file, not a directory")
    args = build_parser().parse_args(["serve", "--model", "no-such-model-anywhere",
                                      "--store", store.format(file=tmp_path / "f")])
    assert cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert "no-such-model" not in err and "s3cret" not in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_kv_budget_that_is_no_finite_number_names_the_flag(capsys, value):
    # inf was an OverflowError traceback after the model loaded, nan an error naming no flag
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--kv-budget-gb", value])
    assert exit_.value.code == 2 and "--kv-budget-gb" in capsys.readouterr().err


def test_default_max_tokens_bounds_requests_without_max_tokens():
    # a request without max_tokens stopped at 256 tokens, with no flag to change it
    assert build_parser().parse_args(["serve"]).default_max_tokens == DEFAULT_MAX_TOKENS == 256
    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--quality-target", "off", "--method", "full",
                                      "--default-max-tokens", "5", "--port", "0"])  # never bound: any port is free
    never_stop = {"logit_bias": {"0": -100, "2": -100}}  # random:tiny's stop ids: every answer runs to the bound
    with TestClient(build_app(args)) as client:
        chat = client.post("/v1/chat/completions", json={"model": "random:tiny", **never_stop,
                                                         "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["usage"]["completion_tokens"] == 5 and chat["choices"][0]["finish_reason"] == "length"
        asked = client.post("/v1/chat/completions", json={"model": "random:tiny", "max_tokens": 7, **never_stop,
                                                          "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert asked["usage"]["completion_tokens"] == 7  # a request's own max_tokens is not bounded by it
        response = client.post("/v1/responses", json={"model": "random:tiny", "input": "Hi"}).json()
        assert response["usage"]["output_tokens"] <= 5


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys):
    # it was the "serving on" banner after the model had loaded, then uvicorn's bind error
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--model", "no-such-model-anywhere", "--port", str(port)])
        assert cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert f"kvrelay serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert len(err.strip().splitlines()) == 1 and "no-such-model" not in err


def test_a_bad_flag_is_named_even_when_the_port_is_in_use(capsys):
    # the bind check ran first: with the default port taken (another server on 8000), every flag error read
    # "cannot listen on 127.0.0.1:8000", and these tests failed on a machine serving there
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--model", "no-such-model-anywhere", "--port", str(port),
                                          "--kv-budget-gb", "0"])
        assert cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert "--kv-budget-gb must be positive" in err and "cannot listen" not in err


@pytest.mark.parametrize("flags, words", [
    (("--method", "cacheblend[check_layer=100]"), "cacheblend: check_layer must be in [0, 3] for 'random:tiny'"),
    (("--methods", "relay"), "relay: no RelayCaching layer profile for model 'random:tiny'"),
])
def test_a_method_this_model_cannot_run_is_refused_at_start(flags, words):
    # it started, then answered every request a 400 naming the setting (cmd_serve prints a ConfigError as one line)
    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--quality-target", "off", *flags])
    with pytest.raises(ConfigError) as err:
        build_app(args)
    assert words in str(err.value)


def test_the_startup_line_lists_only_the_rungs_this_model_can_run():
    from kvrelay.server.cli import serving_methods

    args = build_parser().parse_args(["serve", "--model", "random:tiny"])
    app = build_app(args)  # random:tiny has no relay profile: the rung is left out
    ladder = app.state.quality.guard.config.ladder
    assert [r.name for r in ladder] == ["naive", "prefix"]
    assert "rung (naive,prefix; target" in serving_methods(args, ladder)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no directory can be made")
def test_a_disk_store_that_only_opening_finds_bad_names_the_flag_too(capsys):
    # /proc passes the check before the model loads (it is a directory, writable for root), and mkdir fails in it:
    # the error was the only --store error without the flag's name (it comes once the model has loaded)
    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--quality-target", "off", "--port", "0",
                                      "--store", "disk:/proc/kvrelay-no-such-dir"])
    assert cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert "--store: disk store directory '/proc/kvrelay-no-such-dir' cannot be created" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
