"""A scheduled repair method (``cacheblend``, ``relay``) run by the connector as ``kvrelay serve`` runs it.

The method plans the request as kvrelay's engine plans a call (``ReuseMethod.plan`` on the prompt and its spans), and
its schedule runs in kvrelay's scheduled prefill on vLLM's own modules (``binding.bind_transformer``: no second copy
of the weights). What differs is only where the reused K/V come from:

- the exact prefix: the engine finds it in its store (``KVStore.match_prefix``); here it is what vLLM computed or
  found in its own prefix cache (``num_computed``), extended by the pieces the scheduler found exact. The method sees
  it as a stored prefix match (``PlacedStore``), so it plans it exactly as the engine plans a stored prefix;
- the moved runs: the engine's server finds them with the same matcher and hands them to the method as span
  references (``SpanRef``); here they are the plan's other pieces.

The forward runs over the whole prompt (the band's selection reads the last tokens' attention; the method requires
the last token active) and stops after its last layer: no logits are read. The caller writes positions
``[num_computed, end)`` into vLLM's paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.cache.prefix_index import PrefixMatch
from kvrelay.errors import ConfigError, KvRelayError
from kvrelay.model.config import ModelConfig
from kvrelay.model.transformer import Transformer
from kvrelay.reuse import CallInput, ReuseMethod, SpanRef, get_method
from kvrelay.reuse.profile import SHIPPED_PROFILES, LayerProfile
from kvrelay.reuse.relay import RelayMethod
from kvrelay.vllm.plan import SCHEDULED_METHODS, LoadPlan, method_name

PREFIX_SPAN = "\x00vllm-prefix"  # the placed exact prefix, as the method's store shows it (no stored span has it)


@dataclass
class BoundModel:
    """What a method reads of ``LoadedModel``: the config, fingerprints, name and the (bound) transformer."""

    name: str
    model: Transformer
    config: ModelConfig
    fingerprint: str
    # relay's profile is another model's: the one a folder kvrelay exported came from (``weights.export_record``)
    prefill_fingerprint: str | None = None

    @property
    def profile_fingerprint(self) -> str:
        return self.prefill_fingerprint or self.fingerprint


class PlacedStore:
    """The store a method plans against: the request's exact prefix as a prefix match, and the spans of its pieces."""

    def __init__(self, prefix_len: int, spans: dict[str, StoredSpan]) -> None:
        self.prefix_len, self.spans = prefix_len, spans

    def match_prefix(self, fingerprint: str, token_ids: list[int] | tuple[int, ...]) -> PrefixMatch | None:
        return PrefixMatch(PREFIX_SPAN, self.prefix_len) if self.prefix_len else None

    def __contains__(self, span_id: str) -> bool:
        return span_id in self.spans

    def get(self, span_id: str) -> StoredSpan:
        return self.spans[span_id]


def connector_method(spec: str, profile_path: str | None = None) -> ReuseMethod | None:
    """The scheduled method a connector's ``method`` spec names (None for a static one: ``naive``, ``epic``), its
    settings checked now; ``relay`` with ``profile_path`` runs that profile's band and selector (the settings given
    replace their parts), else the profile found for the model at the first load."""
    if method_name(spec) not in SCHEDULED_METHODS:
        if "[" in spec:
            raise ConfigError(f"kvrelay connector: method {spec!r}: naive and epic take no parameters here "
                              "(epic's k is the connector's epic_k)")
        if profile_path is not None:
            raise ConfigError("kvrelay connector: profile is relay's layer profile; the method is "
                              f"{method_name(spec)!r}")
        return None
    method = get_method(spec)
    if profile_path is None:
        return method
    if not isinstance(method, RelayMethod):
        raise ConfigError(f"kvrelay connector: profile is relay's layer profile; the method is {method.name!r}")
    try:
        method.pin(LayerProfile.load(profile_path))
    except (KvRelayError, OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"kvrelay connector: cannot read relay profile {profile_path!r}: {e}") from None
    return method


def check_bound(method: ReuseMethod, lm: BoundModel, profile_path: str | None = None) -> None:
    """``method``'s settings resolved on the model vLLM loaded, at start (a load never meets a bad setting): a given
    profile must be for a model with as many layers, and ``relay`` with no profile given needs one for the model;
    a ConfigError saying which and how to fix it."""
    if profile_path is not None:
        try:
            num_layers = LayerProfile.load(profile_path).num_layers
        except (KvRelayError, OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"kvrelay connector: cannot read relay profile {profile_path!r}: {e}") from None
        if num_layers != lm.config.num_layers:
            raise ConfigError(f"kvrelay connector: relay profile {profile_path!r} is for a model of {num_layers} "
                              f"layers; {lm.name!r} has {lm.config.num_layers}: give this model's profile")
    try:
        method.settings(lm)
    except ConfigError as e:
        raise ConfigError(
            f"kvrelay connector: {e}. Or give a profile's path as kv_connector_extra_config \"profile\"; the profiles "
            f"shipped with kvrelay are in {SHIPPED_PROFILES} (relay-<fingerprint>.json, this model's fingerprint is "
            f"{lm.profile_fingerprint})") from None


def prefix_length(plan: LoadPlan, spans: dict[str, StoredSpan]) -> int:
    """Prompt tokens [0, P) whose K/V are exact: vLLM's own, then the exact pieces (of ``spans``, the ones still
    stored) that follow on without a gap."""
    end = plan.num_computed
    for piece in plan.pieces:
        if piece.exact and piece.dst_start == end and piece.span_id in spans:
            end = piece.dst_end
    return end


def run_scheduled(method: ReuseMethod, lm: BoundModel, prompt_ids: list[int], plan: LoadPlan, cache: SequenceKV,
                  spans: dict[str, StoredSpan]) -> tuple[int, str | None]:
    """Plan ``prompt_ids`` (the whole prompt) with ``method`` and run its schedule into ``cache``, which holds the
    exact prefix [0, ``prefix_length(plan)``) already; the moved pieces are loaded here, from ``spans`` (those gone from
    the store are left out: their tokens are new to the method). The token-layers computed, and the plan's note (e.g.
    relay's span tokens with no carried state, recomputed from layer 0)."""
    prefix_len = min(prefix_length(plan, spans), len(prompt_ids) - 1)
    refs = [SpanRef(p.dst_start, p.dst_end, p.span_id, p.src_start) for p in plan.pieces
            if p.dst_start >= prefix_len and p.span_id in spans]
    call = CallInput(list(prompt_ids), refs)
    reuse = method.plan(call, PlacedStore(prefix_len, spans), lm)
    if reuse.patches or reuse.make_cache is not None:
        raise KvRelayError(f"kvrelay connector: method {method.name!r} planned K/V patches, which the connector "
                           "does not run")
    model = lm.model
    for load in reuse.loads:
        if load.span_id != PREFIX_SPAN:  # the prefix is in the cache already
            cache.load_span(spans[load.span_id], load.dst_start, model.rope, load.src_start, load.src_end)
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    forward = model.begin_prefill(ids, cache, reuse.schedule)
    model.prefill_layers(forward)  # to the last layer; no logits (no load reads them)
    cache.length = max(cache.length, len(prompt_ids))
    cache.check_filled(len(prompt_ids))
    return forward.num_computed, reuse.note
