"""The connector's scheduled methods (cacheblend, relay) without vLLM: on the stand-in of vLLM's model and paged KV
(``test_connector_worker``), a load writes what kvrelay's own engine computes with the same method on the same prompt
ids and spans (its plan, load and scheduled prefill: ``engine.call``)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine.call import load_plan, plan_call
from kvrelay.errors import ConfigError
from kvrelay.reuse import CallInput, SpanRef, get_method
from kvrelay.vllm.binding import bind_transformer
from kvrelay.vllm.hub import ConnectorConfig, Hub
from kvrelay.vllm.methods import BoundModel, check_bound, connector_method
from kvrelay.vllm.plan import Run, plan_load
from kvrelay.vllm.worker import LoadJob, WorkerSide
from kvrelay.weights.loader import load_model
from tests.vllm.test_connector_worker import full_prefill, paged_kv, vllm_like

NEEDS_VLLM = False  # runs in the main venv: a stand-in of vLLM's model and paged KV
METHODS = ("cacheblend", "relay[band=1:1:3]", "relay[band=1:2:3,selector=threshold]")


@pytest.fixture(scope="module")
def lm():
    return load_model("random:tiny")


@pytest.fixture(scope="module")
def bound(lm):
    return bind_transformer(lm.config, vllm_like(lm.model))


def stored_hub(lm, upstream: list[int]) -> Hub:
    hub = Hub(ConnectorConfig(), lm.fingerprint)
    hub.catalog.put("", "up", full_prefill(lm, upstream).export(0, len(upstream), upstream, lm.fingerprint))
    return hub


def engine_kv(lm, spec: str, hub: Hub, prompt: list[int], runs: list[Run]) -> tuple[SequenceKV, int]:
    """kvrelay's engine on the call: the method's plan (the exact prefix from the store, the runs as span refs), its
    load and its scheduled prefill; the cache and the token-layers the prefill computed."""
    call = CallInput(prompt, [SpanRef(r.start, r.end, r.span_id, r.src_start) for r in runs])
    plan, cache = plan_call(lm, get_method(spec), call, hub.store, len(prompt))
    load_plan(lm, plan, cache, hub.store)
    result = lm.model.prefill(torch.tensor(prompt), cache, plan.schedule)
    return cache, result.num_computed_token_layers


def connector_kv(lm, bound, spec: str, hub: Hub, prompt: list[int], num_computed: int, prefix_kv=None):
    """The connector's load of ``prompt`` (vLLM computed its first ``num_computed`` tokens: ``prefix_kv``): its plan,
    the load's result, and the K/V of [0, plan.end) in the paged cache."""
    found = hub.catalog.index.find(prompt, "", 16)
    runs = [Run(m.start, m.end, m.span_id, m.src_start) for m in found]
    plan = plan_load(prompt, num_computed, runs, hub.catalog.index.token_ids, spec)
    paged, _ = paged_kv(lm.config)
    block_ids = [9, 4, 7, 12, 3, 0, 1, 2]
    if num_computed:
        paged.write(paged.slots(block_ids, 0, num_computed), *prefix_kv)
    method = connector_method(spec)
    worker = WorkerSide(hub, paged, lm.config, bound, method, BoundModel("tiny", bound, lm.config, lm.fingerprint))
    result = worker.load(LoadJob("r", "", prompt[: plan.run_end], plan, block_ids))
    return runs, plan, result, paged.read(paged.slots(block_ids, 0, plan.end))


@pytest.mark.parametrize("spec", METHODS)
def test_a_scheduled_method_writes_what_kvrelays_engine_computes(lm, bound, spec):
    gen = torch.Generator().manual_seed(5)
    upstream = torch.randint(0, 49152, (50,), generator=gen).tolist()
    hub = stored_hub(lm, upstream)
    prompt = [7, 8, 9] + upstream[:30] + [10, 11] + upstream[30:] + [12, 13, 14, 15]
    runs, plan, result, (k, v) = connector_kv(lm, bound, spec, hub, prompt, 0)
    # every token but the last claimed; the gaps and the new tokens computed at every layer, the spans loaded
    assert (plan.end, plan.run_end) == (len(prompt) - 1, len(prompt))
    assert plan.recompute == [0, 1, 2, 33, 34, 55, 56, 57] and result.num_loaded == 50
    # beyond the gaps and new tokens at every layer, the band repaired span tokens: exactly what the engine computes
    expected, num_token_layers = engine_kv(lm, spec, hub, prompt, runs)
    assert result.num_token_layers == num_token_layers > len(plan.recompute) * lm.config.num_layers
    torch.testing.assert_close(k, expected.kv_all(0, plan.end)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, expected.kv_all(0, plan.end)[1], rtol=1e-4, atol=1e-4)
    # the repair changed the spans' K/V above layer 0 (the test tells a repaired load from a plain one)
    naive, _ = engine_kv(lm, "naive", hub, prompt, runs)
    assert not torch.allclose(k[1:], naive.kv_all(0, plan.end)[0][1:], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("spec", METHODS[:2])
def test_vllms_own_prefix_and_an_exact_run_are_the_engines_stored_prefix(lm, bound, spec):
    """vLLM computed the first 16 tokens, the matcher found the rest of the stored call's prefix: together they are
    what the engine loads as its exact stored prefix, never repaired; the moved run after them is."""
    gen = torch.Generator().manual_seed(6)
    upstream = torch.randint(0, 49152, (90,), generator=gen).tolist()
    hub = stored_hub(lm, upstream)
    prompt = upstream[:40] + [21, 22, 23] + upstream[40:] + [24, 25]
    prefix_kv = full_prefill(lm, upstream).kv_all(0, 16)
    runs, plan, result, (k, v) = connector_kv(lm, bound, spec, hub, prompt, 16, prefix_kv)
    assert plan.num_computed == 16 and [p.exact for p in plan.pieces] == [True, False]
    expected, num_token_layers = engine_kv(lm, spec, hub, prompt, runs)
    assert result.num_token_layers == num_token_layers  # the exact prefix computed nowhere, as in the engine
    torch.testing.assert_close(k, expected.kv_all(0, plan.end)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, expected.kv_all(0, plan.end)[1], rtol=1e-4, atol=1e-4)
    exact = full_prefill(lm, upstream).kv_all(0, 40)[0]
    torch.testing.assert_close(k[:, :, :40], exact, rtol=1e-5, atol=1e-5)  # the prefix as stored, every layer


def test_a_method_is_checked_when_the_connector_is_configured(tmp_path):
    with pytest.raises(ConfigError, match="one of naive, epic, cacheblend, relay"):
        ConnectorConfig(method="kvcomm")
    with pytest.raises(ConfigError, match="unknown parameter 'ratoi'"):
        ConnectorConfig(method="cacheblend[ratoi=0.2]")
    with pytest.raises(ConfigError, match="ratio must be in"):
        ConnectorConfig(method="cacheblend[ratio=2]")
    with pytest.raises(ConfigError, match="no parameters here"):
        ConnectorConfig(method="epic[k=4]")
    with pytest.raises(ConfigError, match="cannot read relay profile"):
        ConnectorConfig(method="relay", profile=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="relay's layer profile"):
        ConnectorConfig(method="cacheblend", profile=str(tmp_path / "missing.json"))


def test_relay_with_a_profile_runs_its_band_and_selector_with_the_settings_given(lm):
    from pathlib import Path

    from kvrelay.reuse.profile import LayerProfile
    from kvrelay.reuse.relay_policy import BandPolicy

    path = Path(__file__).resolve().parents[2] / "kvrelay" / "profiles" / "relay-6990f0916126c421.json"
    profile = LayerProfile.load(path)
    method = connector_method("relay", str(path))
    assert method.fixed == (tuple(profile.layers), BandPolicy.from_knobs(profile.selector))
    method = connector_method("relay[keep_share=0.5,band=1:2:3]", str(path))
    assert method.fixed[0] == (1, 2, 3) and method.fixed[1].keep_share == 0.5


def test_relay_is_checked_against_the_model_vllm_loaded(lm, bound):
    """At start: relay with no profile for the model names the connector's ``profile`` key and where the shipped
    profiles are; a profile for a model of another depth (SmolLM2's 30 layers, the tiny model's fewer) is refused."""
    from kvrelay.reuse.profile import SHIPPED_PROFILES

    model = BoundModel("tiny", bound, lm.config, "no-such-fingerprint")
    with pytest.raises(ConfigError, match=r'kvrelay connector: .*kv_connector_extra_config "profile"') as e:
        check_bound(connector_method("relay"), model)
    assert str(SHIPPED_PROFILES) in str(e.value)
    path = str(SHIPPED_PROFILES / "relay-6990f0916126c421.json")
    with pytest.raises(ConfigError, match="kvrelay connector: relay profile .* is for a model of 30 layers"):
        check_bound(connector_method("relay", path), model, path)
    check_bound(connector_method("relay[band=1:1:3]"), model)  # the band given: no profile needed
