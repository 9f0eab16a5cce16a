"""``kvrelay serve``'s flags: a bad value is one line on stderr and exit status 2, before any model loads."""

from __future__ import annotations

import pytest

from kvrelay.cli import build_parser
from kvrelay.server.cli import cmd_serve


@pytest.mark.parametrize("flags, words", [
    (("--port", "99999"), "--port must be a TCP port in [0, 65535], got 99999"),
    (("--port", "-1"), "--port must be a TCP port in [0, 65535], got -1"),
    (("--kv-budget-gb", "0"), "--kv-budget-gb must be positive"),
])
def test_a_bad_serve_flag_is_refused_before_the_model_loads(capsys, flags, words):
    # the port was a traceback from uvicorn's bind, after the model had loaded
    args = build_parser().parse_args(["serve", "--model", "no-such-model-anywhere", *flags])
    assert cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "no-such-model" not in err


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_kv_budget_that_is_no_finite_number_names_the_flag(capsys, value):
    # inf was an OverflowError traceback after the model loaded, nan an error naming no flag
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--kv-budget-gb", value])
    assert exit_.value.code == 2 and "--kv-budget-gb" in capsys.readouterr().err
