"""``relay_policy.knobs_as_spec``: a profile's policy in the settings a user writes (docs/methods.md)."""

import pytest

from kvrelay.errors import ConfigError
from kvrelay.reuse.relay_policy import knobs_as_spec


def test_a_budget_policy_reads_as_relay_s_settings_and_what_none_of_them_names():
    knobs = {"top_r": 0.3, "l_pre": 6, "l_suf": 0, "prune": 0.1, "pre_dense": True, "away": 3.0, "drift": 0.35}
    assert knobs_as_spec(knobs, (2, 2, 29)) == (
        "relay[selector=budget,keep_share=0.3,span_openings=6,prune_share=0.1,drift=0.35,band=2:2:29]"
        " + openings computed at every layer + lost-context attention prior 3")


def test_the_paper_s_thresholds_need_no_extra_words_and_other_thresholds_do():
    assert knobs_as_spec({}, (1, 2, 3)) == "relay[selector=threshold,band=1:2:3]"
    assert knobs_as_spec({"tau_dev": 1.5, "tau_inf": 1.45, "l_suf": 10}, (1, 2, 3)) == (
        "relay[selector=threshold,band=1:2:3]")
    assert knobs_as_spec({"l_pre": 4, "l_suf": 4, "tau_dev": 3.0, "tau_inf": 3.0}, (1, 2, 3)) == (
        "relay[selector=threshold,span_openings=4,band=1:2:3] + thresholds 3x deviation, 3x attention"
        " + each span's last 4 tokens kept")


def test_span_ends_are_named_where_the_selector_s_own_default_differs():
    # a budget spec keeps no span ends, the thresholds keep each span's last 10
    assert knobs_as_spec({"top_r": 0.2, "l_suf": 0}, (0, 1, 2)) == "relay[selector=budget,keep_share=0.2,band=0:1:2]"
    assert knobs_as_spec({"top_r": 0.2, "l_suf": 4}, (0, 1, 2)).endswith(" + each span's last 4 tokens kept")
    assert knobs_as_spec({"l_suf": 0}, (0, 1, 2)).endswith(" + each span's last 0 tokens kept")


def test_an_unknown_knob_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown knobs"):
        knobs_as_spec({"top_k": 3}, (0, 1, 2))
