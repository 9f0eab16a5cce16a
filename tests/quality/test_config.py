"""The guard's config: parsing the target flag, and every bad value named."""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.errors import ConfigError
from kvrelay.quality import DEFAULT_LADDER, QualityConfig, QualityTarget, Rung


def test_parse_target():
    assert QualityConfig.parse_target("kl=0.1,agreement=0.8") == QualityTarget(0.1, 0.8)
    assert QualityConfig.parse_target(" KL = 0.02 ") == QualityTarget(kl_max=0.02)
    assert QualityConfig.parse_target("off") is None and QualityConfig.parse_target("OFF") is None
    assert str(QualityConfig.parse_target(str(QualityTarget(0.03, 0.95)))) == "kl=0.03,agreement=0.95"


@pytest.mark.parametrize("text, word", [("", "empty"), ("kl", "expected"), ("kl=abc", "not a number"),
                                        ("kl=-1", "> 0"), ("agreement=1.5", "[0, 1]"), ("kl=nan", "finite"),
                                        ("kl=0.1,kl=0.2", "twice"), ("tokens=3", "expected")])
def test_bad_targets_are_named(text, word):
    with pytest.raises(ConfigError, match="quality target") as err:
        QualityConfig.parse_target(text)
    assert word in str(err.value)


@pytest.mark.parametrize("field, value", [("sample_rate", 1.5), ("sample_rate", -0.1), ("sample_rate", True),
                                          ("first_calls_per_role", 0), ("window", 2.5), ("min_samples", 64),
                                          ("confidence", 0.4), ("margin", 0.0), ("kl_cap_factor", 0.5),
                                          ("start", "epic"), ("trust_start", "yes"), ("ladder", ()),
                                          ("ladder", (Rung("a", "naive"), Rung("a", "relay"))),
                                          ("ladder", (Rung("safe", "prefix"), Rung("cheap", "naive"))),
                                          ("ladder", (Rung("kvcomm", "kvcomm"),))])
def test_bad_config_values_are_named(field, value):
    with pytest.raises(ConfigError, match="quality"):
        dataclasses.replace(QualityConfig(), **{field: value})


def test_defaults():
    cfg = QualityConfig()
    assert cfg.ladder == DEFAULT_LADDER and cfg.ladder[cfg.start_index].name == "relay"
    assert dataclasses.replace(cfg, start=None).start_index == len(DEFAULT_LADDER) - 1
    assert cfg.sample_every == 20 and cfg.kl_cap == pytest.approx(0.25)
    assert dataclasses.replace(cfg, sample_rate=0.0).sample_every == 0
    with pytest.raises(ConfigError, match="rung name"):
        Rung("", "naive")


def test_default_ladder_specs_are_shipped_methods():
    from kvrelay.reuse import get_method

    for rung in DEFAULT_LADDER:
        get_method(rung.method_spec)  # raises on an unknown method or setting
