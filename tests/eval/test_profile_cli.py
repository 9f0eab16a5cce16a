"""``kvrelay profile``'s report names bands and selectors as the relay specs a user writes, never the profile's
internal knob names."""

import re

import pytest

from kvrelay.eval.profile_cli import _print_profile
from kvrelay.eval.selector_calibration import (
    BAND_KNOBS,
    SELECTOR_CANDIDATES,
    candidate_band,
    candidate_specs,
    selector_spec,
)
from kvrelay.reuse import get_method
from kvrelay.reuse.profile import SHIPPED_PROFILES, LayerProfile
from kvrelay.reuse.relay_policy import BandPolicy

# the profile's knob vocabulary and the selector calibration's band knobs, as its labels spell them
INTERNAL_NAMES = re.compile(r"\b(top_r|l_pre|l_suf|prune|tau_dev|tau_inf|pre_dense|pos_prior|away)\b|l_det=l_start|"
                            r"l_end=top-")
SPEC = re.compile(r"relay\[[^\]]*\]")


def _pinned(spec: str, profile: LayerProfile):
    """(layers, policy) that ``spec`` runs with ``profile`` as the model's profile."""
    method = get_method(spec)  # every name in it is one of relay's settings, or this raises
    method.pin(profile)
    return method.fixed


@pytest.mark.parametrize("path", sorted(SHIPPED_PROFILES.glob("relay-*.json")), ids=lambda p: p.stem)
def test_the_report_names_what_a_user_can_give_relay(path, capsys):
    profile = LayerProfile.load(path)
    _print_profile(profile.model, profile, 32)
    out = capsys.readouterr().out
    assert not INTERNAL_NAMES.search(out), INTERNAL_NAMES.search(out).group(0)
    specs = SPEC.findall(out)
    assert len(specs) >= len(profile.band_scores) + 1
    for spec in specs:
        get_method(spec)
    # what plain relay runs, printed as a spec, runs exactly the profile's band and policy
    runs = next(line for line in out.splitlines() if line.startswith("relay runs"))
    layers, policy = _pinned(SPEC.search(runs).group(0), profile)
    assert layers == profile.layers and policy == BandPolicy.from_knobs(profile.selector)


def test_each_candidate_s_settings_run_its_policy_on_its_band():
    """A candidate's printed settings, given with a profile holding that candidate's policy, run that policy on the
    candidate's band: the spec says what the candidate is, not an approximation of it. (``selector=threshold`` is
    the paper's thresholds whatever the profile holds: a thresholds candidate with words after its spec names
    what no setting gives, so only its band is checked.)"""
    profile = LayerProfile.load(next(SHIPPED_PROFILES.glob("relay-*.json")))
    specs = candidate_specs(profile)
    searched = tuple(profile.searched_band or profile.layers)
    num_checked = 0
    for knobs in SELECTOR_CANDIDATES:
        band = candidate_band(knobs, searched, profile.num_layers)
        if band is None:
            continue
        relay_knobs = {k: v for k, v in knobs.items() if k not in BAND_KNOBS}
        profile.selector = relay_knobs
        text = specs[selector_spec(knobs)]
        layers, policy = _pinned(SPEC.search(text).group(0), profile)
        assert layers == band, text
        if "selector=threshold" in text and " + " in text:
            continue
        assert policy == BandPolicy.from_knobs(relay_knobs), text
        num_checked += 1
    assert num_checked > 20

