"""RelayCaching's layer profile as data: save/load, where it is found, and no pipeline run at planning."""

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError, KvRelayError
from kvrelay.reuse import get_method, profile
from kvrelay.reuse.base import CallInput
from kvrelay.reuse.profile import SHIPPED_PROFILES, LayerProfile, layer_profile, profile_path
from kvrelay.reuse.relay_policy import BandPolicy
from tests.helpers import tiny_lm


def _make(fingerprint: str, *layers: int) -> LayerProfile:
    return LayerProfile(fingerprint, "toy", 4, *layers, 0.9, [1.0] * 4, [1.0] * 4, [0.0] * 4)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache dir and an empty in-process memo of read profiles."""
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "_PROFILES", {})
    return tmp_path


def test_save_load_round_trip_keeps_every_field(tmp_path):
    p = _make("f00d", 1, 2, 3)
    p.det_scores = {2: 0.5, 3: 0.25}
    p.band_scores = {"1,2,3": {"kl": 0.01, "reuse": 0.6}}
    p.save(tmp_path / "p.json")
    back = LayerProfile.load(tmp_path / "p.json")
    assert back == p and back.det_scores == {2: 0.5, 3: 0.25}  # JSON's string keys become ints again
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KvRelayError, match="not a readable RelayCaching profile"):
        LayerProfile.load(tmp_path / "bad.json")


def test_a_profile_with_an_older_kvrelay_s_workload_selectors_loads_and_serves_every_call_alike(tmp_path):
    """Selectors keyed by one workload's agents are not read (a default tuned on that workload's own calls): the
    model's selector and band serve every call."""
    p = _make("f00d", 1, 2, 3)
    p.selector = {"top_r": 0.3}
    d = dataclasses.asdict(p) | {"workload_selectors": {
        "w": {"roles": {"a": "r1"}, "layers": [1, 1, 2], "selector": {"top_r": 0.4}}}}
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert LayerProfile.load(tmp_path / "old.json") == p


TOY = SimpleNamespace(num_layers=4)


def test_a_model_decoding_on_other_weights_finds_the_profile_of_its_fp32_path(cache):
    lm = SimpleNamespace(fingerprint="int4", profile_fingerprint="f00d", name="toy", config=TOY)  # int4_decode=True
    _make("f00d", 2, 3, 3).save(profile_path("f00d"))
    assert layer_profile(lm, shipped_dir=cache / "shipped").layers == (2, 3, 3)


def test_a_profile_of_the_model_itself_wins_over_the_one_it_borrows(cache):
    """An exported folder borrows its source model's profile (``prefill_fingerprint``) until it has one of its own
    (``kvrelay profile`` on the folder writes under the folder's own fingerprint, never over the source's)."""
    lm = SimpleNamespace(fingerprint="fold", profile_fingerprint="f00d", name="toy", config=TOY)
    shipped_dir = cache / "shipped"
    _make("f00d", 2, 3, 3).save(shipped_dir / profile_path("f00d").name)
    assert layer_profile(lm, shipped_dir=shipped_dir).layers == (2, 3, 3)
    profile._PROFILES.clear()
    _make("fold", 1, 2, 3).save(profile_path("fold"))
    assert layer_profile(lm, shipped_dir=shipped_dir).layers == (1, 2, 3)


def test_a_profile_for_a_model_of_another_depth_is_a_config_error(cache):
    lm = SimpleNamespace(fingerprint="fold", profile_fingerprint="f00d", name="toy",
                         config=SimpleNamespace(num_layers=30))
    _make("f00d", 2, 3, 3).save(profile_path("f00d"))
    with pytest.raises(ConfigError, match="for a model of 4 layers; 'toy' has 30"):
        layer_profile(lm, shipped_dir=cache / "shipped")


def test_your_profile_wins_over_the_shipped_one_and_says_so(cache, monkeypatch, capsys):
    lm = SimpleNamespace(fingerprint="f00d", profile_fingerprint="f00d", name="toy", config=TOY)
    shipped_dir = cache / "shipped"
    _make("f00d", 1, 2, 3).save(shipped_dir / profile_path("f00d").name)
    assert layer_profile(lm, shipped_dir=shipped_dir).layers == (1, 2, 3)  # only the shipped one
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(profile, "_PROFILES", {})
    _make("f00d", 2, 3, 3).save(profile_path("f00d"))
    assert layer_profile(lm, shipped_dir=shipped_dir).layers == (2, 3, 3)
    err = capsys.readouterr().err
    assert "L_start 2 / L_det 3 / L_end 3" in err and "shipped with kvrelay has L_start 1 / L_det 2" in err
    monkeypatch.setattr(profile, "_PROFILES", {})
    _make("f00d", 1, 2, 3).save(profile_path("f00d"))  # the same layers: nothing to say
    assert layer_profile(lm, shipped_dir=shipped_dir).layers == (1, 2, 3)
    assert capsys.readouterr().err == ""


def test_a_model_without_a_profile_is_a_config_error_saying_how_to_get_one(cache):
    lm = SimpleNamespace(fingerprint="beef", profile_fingerprint="beef", name="toy-model", config=TOY)
    with pytest.raises(ConfigError) as err:
        layer_profile(lm, shipped_dir=cache / "shipped")
    assert "kvrelay profile --model toy-model" in str(err.value)
    assert "relay[band=start:det:end]" in str(err.value)
    assert not profile_path("beef").exists()  # nothing was built or written


def test_relay_plans_from_the_layers_given_and_never_builds_a_profile(cache):
    lm = tiny_lm("llama2")  # a fingerprint no profile exists for
    call = CallInput(list(range(40, 60)))
    with pytest.raises(ConfigError, match="kvrelay profile --model tiny-llama2"):
        get_method("relay").plan(call, KVStore(1 << 20), lm)
    with pytest.raises(ConfigError, match="no RelayCaching layer profile"):
        get_method("relay").capture_layers(lm)
    method = get_method("relay[band=1:2:3]")
    assert method.capture_layers(lm) == (1,)
    assert method.plan(call, KVStore(1 << 20), lm).fallback is None
    # a profile in the cache dir is used for the layers not given
    _make(lm.fingerprint, 2, 2, 3).save(profile_path(lm.fingerprint))
    assert get_method("relay").layers(lm) == (2, 2, 3)
    assert get_method("relay[band=1:1:3]").layers(lm) == (1, 1, 3)  # the band given wins
    with pytest.raises(ConfigError, match="L_start 2 <= L_det 1"):
        get_method("relay[band=2:1:3]").layers(lm)
    with pytest.raises(ConfigError, match="start:det:end"):
        get_method("relay[band=1:2]")


def test_relay_takes_the_profile_s_policy_and_each_setting_given_replaces_its_part(cache):
    lm = tiny_lm("llama2")
    p = _make(lm.fingerprint, 1, 2, 3)
    p.selector = {"top_r": 0.2, "l_pre": 4, "l_suf": 3, "pre_dense": True, "prune": 0.1, "drift": 0.3}
    p.save(profile_path(lm.fingerprint))
    pol = get_method("relay").policy(lm)
    assert (pol.keep_share, pol.open_tokens, pol.end_tokens, pol.dense_openings, pol.prune_share, pol.drift) == \
        (0.2, 4, 3, True, 0.1, 0.3)
    pol = get_method("relay[keep_share=0.5,span_openings=2]").policy(lm)  # only what is given moves
    assert (pol.keep_share, pol.open_tokens, pol.end_tokens, pol.dense_openings, pol.prune_share, pol.drift) == \
        (0.5, 2, 3, True, 0.1, 0.3)
    assert not get_method("relay[span_openings=0]").policy(lm).dense_openings  # no openings: none dense
    pol = get_method("relay[drift=0,prune_share=0.4]").policy(lm)
    assert (pol.drift, pol.prune_share) == (None, 0.4)
    pol = get_method("relay[drift=0,prune_share=0]").policy(lm)  # both off: no pruning layers
    assert (pol.drift, pol.prune_share) == (None, None)
    assert get_method("relay[drift=0.2,prune_share=0]").policy(lm).prune_share == 0.0  # drift keeps its layers
    pol = get_method("relay[prune_share=0]").policy(lm)  # pruning off: the profile's drift, which needs it, too
    assert (pol.drift, pol.prune_share) == (None, None)
    # the paper's thresholds, whatever the profile holds
    pol = get_method("relay[selector=threshold]").policy(lm)
    assert (pol.keep_share, pol.open_tokens, pol.end_tokens, pol.tau_dev, pol.tau_inf) == (None, 0, 10, 1.5, 1.45)
    assert get_method("relay[band=1:2:3]").policy(lm).keep_share == 0.2  # the band is not the policy
    assert get_method("relay").policy(tiny_lm("llama3")).keep_share is None  # no profile: the paper's
    assert get_method("relay[selector=budget]").policy(tiny_lm("llama3")).keep_share == 0.3  # the budget's default


def test_the_shipped_profiles_are_readable_and_in_range():
    paths = sorted(SHIPPED_PROFILES.glob("relay-*.json"))
    assert paths, "kvrelay ships at least the default model's profile"
    for path in paths:
        p = LayerProfile.load(path)
        assert path.name == profile_path(p.fingerprint).name
        assert 0 <= p.l_start <= p.l_det <= p.l_end < p.num_layers
        assert len(p.value_cos) == len(p.key_cos) == len(p.deviation) == p.num_layers
        shipped = json.loads(path.read_text())
        assert shipped["fingerprint"] == p.fingerprint
        # every entry is one relay reads (none it would drop: a selector keyed by one workload's agents)
        assert set(shipped) == {f.name for f in dataclasses.fields(LayerProfile)}
        BandPolicy.from_knobs(p.selector)


def test_planning_relay_imports_nothing_above_reuse():
    """``reuse`` sits below engine, pipeline and eval (the import layers): relay's profile lookup must not reach up."""
    code = ("import sys; import kvrelay.reuse, kvrelay.reuse.relay, kvrelay.reuse.profile; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['kvrelay', 'engine'], ['kvrelay', 'pipeline'], ['kvrelay', 'eval'], ['kvrelay', 'server'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
