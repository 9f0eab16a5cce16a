"""RelayCaching's offline layer-range profiler (``kvrelay profile``): build, score and plot a profile.

On calibration pipelines (GSM8K *train*), for every upstream output spliced into a downstream
prompt, compare per layer the relayed decode KV (re-rotated to its new position) with the KV a
fresh prefill of the downstream prompt gives the same tokens: value cosine and key cosine.

- ``L_start``/``L_end``: the shortest contiguous band of layers holding ``band_mass`` of the total
  value deviation (1 - cos).
- ``L_det``: the band layer whose per-token deviations best predict (Spearman) the tokens' mean
  deviation over the band layers after it.

That is the paper's rule (``select="deviation"``). On SmolLM2 it gives [18, 29] with L_det 27, and
relay there leaves the first-token KL at naive's level: deviation entering below L_start reaches the
top unrepaired. So the profiler can also run ``relay`` on the same calibration calls with candidate
bands and keep the one with the most reuse among those whose mean first-token KL(full || relay) is
within ``kl_tolerance`` of the lowest (the fidelity-for-cost rule):

- ``select="search"`` (default): all three layers free. A first pass scores bands entering at
  L_start = 1, 2, 4, 8, ... with L_det = L_start + 1 and ending at the top or 2, 4, 8, ... layers
  below it (plus the deviation band); a second pass tries later detection layers inside the best
  band's range (L_start + 2, + 4, ...), held to the first pass's KL bar (a later L_det lowers KL but
  recomputes more, so the bar must not move with it). Both passes score on the same calibration calls.
- ``select="fidelity"``: the first pass only, with every band ending at the top layer.

With ``search``, a last pass over the same calls chooses relay's token selector for the chosen band, or a
selector with a band of its own (``kvrelay.eval.selector_calibration``). The calibration calls themselves
are run and scored by ``kvrelay.eval.calibration_calls``.

The profile itself (data, load/save, lookup) is ``kvrelay.reuse.profile``; this module runs pipelines,
so it sits in ``eval``, above the engine and the pipeline runner.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.errors import KvRelayError
from kvrelay.eval.calibration_calls import MethodScore, calibration_data, downstream_calls, score_methods
from kvrelay.eval.configs import SELECTS
from kvrelay.eval.selector_calibration import calibrate_selector
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput
from kvrelay.reuse.profile import LayerProfile, profile_path
from kvrelay.reuse.relay import PAPER_SELECTOR, RelayMethod

__all__ = ["SELECTS", "LayerProfile", "build_profile", "choose_band", "choose_by_fidelity", "choose_detection_layer",
           "detection_candidates", "fidelity_candidates", "measure_call", "plot_profile", "profile_path", "score_bands",
           "search_candidates"]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine per token over heads x dims. a, b: [L, Hkv, n, hd] -> [L, n]."""
    a = a.float().permute(0, 2, 1, 3).flatten(2)  # [L, n, Hkv*hd]
    b = b.float().permute(0, 2, 1, 3).flatten(2)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def measure_call(lm: LoadedModel, call: CallInput, store: KVStore
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value cos, key cos), each [num_layers, n] over the tokens of the call's upstream outputs, and
    ``full``'s first-token logits."""
    out = Engine(lm, store).generate(call, "full", GenerateOptions(SamplingConfig(max_new_tokens=1), keep_cache=True))
    fresh = out.cache
    v_cos, k_cos = [], []
    for ref in call.refs:
        if ref.kind != "output" or ref.span_id not in store:
            continue
        span: StoredSpan = store.get(ref.span_id)
        src = slice(ref.src_start, ref.src_start + ref.num_tokens)
        k_moved = lm.model.rope.shift_keys(span.k[:, :, src], ref.start - (span.start_pos + ref.src_start))
        v_cos.append(_cos(span.v[:, :, src], fresh.v[:, :, ref.start : ref.end]))
        k_cos.append(_cos(k_moved, fresh.k[:, :, ref.start : ref.end]))
    if not v_cos:
        empty = torch.empty(lm.config.num_layers, 0)
        return empty, empty, out.first_logits
    return torch.cat(v_cos, dim=1), torch.cat(k_cos, dim=1), out.first_logits


def choose_band(deviation: list[float], band_mass: float) -> tuple[int, int]:
    """Shortest contiguous [start, end] holding ``band_mass`` of the total deviation (earliest on ties)."""
    total = sum(deviation)
    if total <= 0:
        return 0, 0
    best = (0, len(deviation) - 1)
    for start in range(len(deviation)):
        acc = 0.0
        for end in range(start, len(deviation)):
            acc += deviation[end]
            if acc >= band_mass * total - 1e-12:
                if end - start < best[1] - best[0]:
                    best = (start, end)
                break
    return best


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().float()


def choose_detection_layer(token_dev: torch.Tensor, start: int, end: int) -> tuple[int, dict[int, float]]:
    """token_dev: [L, n] per-token deviations. The band layer in (start, end) whose deviations rank the
    tokens most like their mean deviation over the later band layers (Spearman).

    Never ``start`` itself when there is a choice: tokens entering there from carried hidden states
    have no deviation yet at that layer; the signal needs one recomputed layer of new-context attention.
    """
    if end - start < 2 or token_dev.shape[1] < 3:
        return min(start + 1, end), {}
    scores = {}
    for layer in range(start + 1, end):
        target = token_dev[layer + 1 : end + 1].mean(0)
        a, b = _ranks(token_dev[layer]), _ranks(target)
        a, b = a - a.mean(), b - b.mean()
        scores[layer] = float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-12))
    best = max(scores, key=lambda layer: (scores[layer], -layer))
    return best, scores


Band = tuple[int, int, int]  # (L_start, L_det, L_end)


def fidelity_candidates(num_layers: int, deviation_band: Band) -> list[Band]:
    """The deviation band, then bands to the top layer entering at 1, 2, 4, 8, ... with L_det one
    layer later (the first layer whose deviations carry the new context's attention)."""
    top, out, start = num_layers - 1, [deviation_band], 1
    while start < top:
        if (start, start + 1, top) not in out:
            out.append((start, start + 1, top))
        start *= 2
    return out


def _powers_of_two_below(limit: int) -> list[int]:
    out, step = [], 1
    while step < limit:
        out.append(step)
        step *= 2
    return out


def search_candidates(num_layers: int, deviation_band: Band) -> list[Band]:
    """First pass of the search: the deviation band, then (L_start, L_start + 1, L_end) for L_start =
    1, 2, 4, ... and L_end = the top layer or 2, 4, 8, ... layers below it (L_end >= L_start + 2, so
    a selected token keeps at least one layer after detection)."""
    top, out = num_layers - 1, [deviation_band]
    ends = [top] + [top - gap for gap in _powers_of_two_below(top) if gap >= 2]
    for start in _powers_of_two_below(top - 1):
        for end in ends:
            if end >= start + 2 and (start, start + 1, end) not in out:
                out.append((start, start + 1, end))
    return out


def detection_candidates(band: Band) -> list[Band]:
    """Second pass: later detection layers inside ``band``'s range (L_start + 2, + 4, ... below L_end)."""
    start, _, end = band
    return [(start, start + gap, end) for gap in _powers_of_two_below(end - start) if gap >= 2]


def choose_by_fidelity(scores: dict[Band, tuple[float, float]], kl_tolerance: float = 0.1,
                       kl_bar: float | None = None) -> Band:
    """scores: band -> (mean first-token KL(full || relay), mean reuse). The most reuse among bands
    whose KL is at most ``kl_bar`` (default: (1 + kl_tolerance) x the lowest); ties: the lower KL,
    then the earlier band."""
    bar = (1 + kl_tolerance) * min(score[0] for score in scores.values()) if kl_bar is None else kl_bar
    ok = [band for band, score in scores.items() if score[0] <= bar + 1e-12] or [min(scores,
                                                                                      key=lambda b: scores[b][0])]
    return max(ok, key=lambda band: (scores[band][1], -scores[band][0]))


def score_bands(lm: LoadedModel, candidates: list[Band], workload: str, data: str | None, num_problems: int,
                progress: bool = True, offset: int = 0) -> dict[Band, MethodScore]:
    """Band -> its ``MethodScore`` (first-token KL(full || relay), reuse) over the calibration calls."""
    # the paper's selector on every band: a band is chosen before the selector, whatever profile the model has now
    methods = {band: RelayMethod.with_knobs(band, PAPER_SELECTOR) for band in candidates}
    return score_methods(lm, methods, workload, data, num_problems, "scoring bands", progress, offset=offset)


def build_profile(lm: LoadedModel, num_problems: int = 20, band_mass: float = 0.5, data: str | None = None,
                  workload: str = "gsm8k-chain3", progress: bool = True, select: str = "search",
                  kl_tolerance: float = 0.1, path_tokens: int = 32, offset: int = 0) -> LayerProfile:
    """Profile every downstream call's upstream outputs on calibration pipelines run with ``full``;
    unless ``select="deviation"``, later passes over the same problems score candidate bands."""
    if select not in SELECTS:
        raise KvRelayError(f"profile: select must be one of {SELECTS}, got {select!r}")
    data = calibration_data(data, workload)
    v_all, k_all = [], []

    def on_call(call: CallInput, store: KVStore) -> None:
        v, k, _ = measure_call(lm, call, store)
        v_all.append(v)
        k_all.append(k)

    downstream_calls(lm, workload, data, num_problems, (), on_call, "profiling", progress, offset)
    if not v_all:
        raise KvRelayError(f"workload {workload!r} has no downstream call with an upstream output to profile")
    v_cos, k_cos = torch.cat(v_all, dim=1), torch.cat(k_all, dim=1)  # [L, tokens]
    token_dev = 1 - v_cos
    deviation = token_dev.mean(1).tolist()
    l_start, l_end = choose_band(deviation, band_mass)
    l_det, scores = choose_detection_layer(token_dev, l_start, l_end)
    chosen, band_scores = (l_start, l_det, l_end), {}
    if select != "deviation":
        num_layers = lm.config.num_layers
        first = search_candidates if select == "search" else fidelity_candidates
        results = score_bands(lm, first(num_layers, chosen), workload, data, num_problems, progress, offset)
        chosen = choose_by_fidelity(results, kl_tolerance)
        later = [b for b in detection_candidates(chosen) if b not in results] if select == "search" else []
        if later:  # the first pass sets the KL bar: a costlier detection layer must buy reuse under it
            kl_bar = (1 + kl_tolerance) * min(score.kl for score in results.values())
            results |= score_bands(lm, later, workload, data, num_problems, progress, offset)
            chosen = choose_by_fidelity(results, kl_tolerance, kl_bar)
        band_scores = {",".join(map(str, b)): {"kl": s.kl, "reuse": s.reuse} for b, s in results.items()}
    profile = LayerProfile(lm.fingerprint, lm.name, lm.config.num_layers, *chosen, band_mass,
                           v_cos.mean(1).tolist(), k_cos.mean(1).tolist(), deviation, scores,
                           {"workload": workload, "data": data, "problems": num_problems, "offset": offset,
                            "tokens": int(v_cos.shape[1]), "kl_tolerance": kl_tolerance},
                           select, [l_start, l_det, l_end], band_scores)
    if select == "search":  # the selector for the chosen band, on the same calibration calls
        profile = calibrate_selector(lm, profile, workload, data, num_problems, progress, path_tokens, offset)
    return profile


def plot_profile(profile: LayerProfile, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(profile.num_layers))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(layers, profile.value_cos, marker="o", label="value cosine (relayed decode vs fresh)")
    ax.plot(layers, profile.key_cos, marker="s", label="key cosine (after re-rotation)")
    ax.axvspan(profile.l_start - 0.5, profile.l_end + 0.5, alpha=0.15, color="tab:red",
               label=f"chosen band [{profile.l_start}, {profile.l_end}] ({profile.select})")
    ax.axvline(profile.l_det, color="tab:red", linestyle="--", label=f"L_det = {profile.l_det}")
    if profile.band_moved:
        start, det, end = profile.searched_band  # a selector with a band of its own moved it
        ax.axvspan(start - 0.5, end + 0.5, fill=False, hatch="//", edgecolor="tab:red", alpha=0.3,
                   label=f"band search's band [{start}, {end}], L_det {det} (the selector moved it)")
    if profile.deviation_band and tuple(profile.deviation_band) != (profile.l_start, profile.l_det, profile.l_end):
        start, det, end = profile.deviation_band
        ax.axvspan(start - 0.5, end + 0.5, alpha=0.12, color="tab:gray",
                   label=f"deviation band [{start}, {end}], L_det {det} (paper's rule)")
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine similarity")
    ax.set_title(f"RelayCaching layer profile: {profile.model} ({profile.calibration.get('tokens')} tokens)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
