"""``kvrelay serve``'s quality flags: the guard is on by default with QualityConfig's own defaults, ``off`` turns it
off, and a bad value is a clear error before any model loads."""

from __future__ import annotations

import pytest

from kvrelay.cli import build_parser
from kvrelay.quality import DEFAULT_TARGET, QualityConfig, QualityTarget
from kvrelay.server.cli import cmd_serve, quality_config


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_the_guard_is_on_by_default_with_the_config_defaults():
    config = quality_config(_serve_args())
    assert config == QualityConfig(target=DEFAULT_TARGET, sample_rate=QualityConfig().sample_rate)


def test_the_flags_set_target_and_sample_and_off_turns_the_guard_off():
    config = quality_config(_serve_args("--quality-target", "kl=0.1", "--quality-sample", "0.2"))
    assert config.target == QualityTarget(kl_max=0.1) and config.sample_rate == 0.2
    assert quality_config(_serve_args("--quality-target", "off")) is None


@pytest.mark.parametrize("flags, words", [
    (("--quality-target", "kl=abc"), "'abc' is not a number"),
    (("--quality-target", "latency=3"), "expected 'kl=K,agreement=A' or 'off'"),
    (("--quality-sample", "1.5"), "sample rate must be a share in [0, 1]"),
    (("--quality-target", "kl=-1"), "quality target kl must be a finite number > 0"),
    (("--quality-target", "agreement=2"), "quality target agreement must be in [0, 1]"),
    (("--quality-shadow-share", "0"), "quality shadow share must be in (0, 1]"),
    (("--quality-ladder", ""), "quality ladder '': an empty rung"),
    # an unknown rung is named as the ladder's, not as --method's
    (("--quality-ladder", "naive,bogus,prefix"), "quality ladder rung 'bogus': unknown method 'bogus'"),
    (("--quality-target", "off", "--quality-ladder", "naive,bogus,prefix"), "quality ladder rung 'bogus'"),
])
def test_a_bad_quality_flag_is_a_clear_error_before_the_model_loads(capsys, flags, words):
    args = _serve_args("--model", "no-such-model-anywhere", *flags)
    assert cmd_serve(args) == 2  # the model named is never looked for: the flag is refused first
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "no-such-model" not in err


def test_the_startup_line_says_what_runs_a_request_that_names_no_method():
    """With the guard on, such a request runs at its agent's rung, not ``--method``: the line says so (it said
    'with method epic' while agents ran relay)."""
    from kvrelay.server.cli import serving_methods

    guarded = serving_methods(_serve_args("--method", "epic"))
    assert "epic" not in guarded and "quality-guard rung (naive,relay,prefix; target kl=0.05,agreement=0.9)" in guarded
    assert serving_methods(_serve_args("--method", "epic", "--quality-target", "off")) == "with method epic"


@pytest.mark.parametrize("flags, warned, method", [
    (("--method", "epic"), True, "epic"),  # the flag would sit idle: every agent runs at its rung
    ((), False, "epic"),
    (("--method", "naive", "--quality-target", "off"), False, "naive"),
])
def test_a_method_flag_the_guard_overrides_is_said_at_start(monkeypatch, caplog, flags, warned, method):
    from kvrelay.server.cli import build_app

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded  # what comes before the load is what is checked

    monkeypatch.setattr("kvrelay.weights.loader.load_model", load_model)
    args = _serve_args("--port", "0", *flags)
    with pytest.raises(Loaded):
        build_app(args)
    assert args.method == method
    said = [r.getMessage() for r in caplog.records if r.name == "kvrelay.server"]
    assert bool(said) is warned
    if warned:
        assert said[0].startswith("--method epic serves requests that name no method only with --quality-target off")
