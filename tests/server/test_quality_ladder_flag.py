"""``--quality-ladder``: the guard's rungs from the command line, a learning rung among them (no warm-up flag), and a
bad ladder a clear error before any model loads."""

from __future__ import annotations

import pytest

from kvrelay.cli import build_parser
from kvrelay.errors import ConfigError
from kvrelay.quality import DEFAULT_LADDER, Rung
from kvrelay.quality.ladder import ladder_text, parse_ladder
from kvrelay.server.cli import quality_config


def _config(*flags: str):
    return quality_config(build_parser().parse_args(["serve", *flags]))


def test_the_default_flag_is_the_default_ladder():
    assert _config().ladder == DEFAULT_LADDER
    assert parse_ladder(ladder_text(DEFAULT_LADDER)) == DEFAULT_LADDER


def test_a_learning_rung_and_named_specs_with_commas_in_brackets():
    config = _config("--quality-ladder", "naive, kvcomm ,wide=relay[selector=budget,keep_share=0.5],prefix")
    assert config.ladder == (Rung("naive", "naive"), Rung("kvcomm", "kvcomm"),
                             Rung("wide", "relay[selector=budget,keep_share=0.5]"), Rung("prefix", "prefix"))
    assert parse_ladder(ladder_text(config.ladder)) == config.ladder


@pytest.mark.parametrize("text, words", [
    ("", "an empty rung"),
    ("naive,,prefix", "an empty rung"),
    ("naive,relay[top_r=0.3", "a '[' is never closed"),
    ("naive]", "a ']' closes no '['"),
    ("naive,naive", "rung names must be unique"),
    ("naive,kvcom", "kvcom"),
])
def test_a_bad_ladder_is_a_clear_error(text, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _config("--quality-ladder", text)
