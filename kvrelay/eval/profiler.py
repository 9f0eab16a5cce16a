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

With ``search``, a last pass over the same calls chooses relay's token selector for the chosen band
(``calibrate_selector``): among a few candidates (the paper's thresholds; span openings kept with
stricter thresholds or the budget form; wider budgets detected at L_start and pruned through the band).
Each is held to ``full``'s first 32 greedy tokens, teacher-forced (``kvrelay.eval.path_fidelity``): the
KL along them and whether greedy@32 matches, beside the first token's KL. The choice is the lowest KL
along the continuation among those reusing at least as much as ``epic`` on the same calls (else as much
as the paper's), narrowed while any candidate meets them by the rest of the dominance bar: a first-token
KL at most 0.4x epic's (half, with a margin for train-to-test drift), then a greedy@32 share at least
epic's. ``relay`` uses it when a spec sets none of the selector's knobs.

The profile itself (data, load/save, lookup) is ``kvrelay.reuse.profile``; this module runs pipelines,
so it sits in ``eval``, above the engine and the pipeline runner.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.data.datasets import data_root
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.errors import KvRelayError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.path_fidelity import path_reference, score_path
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse.base import CallInput
from kvrelay.reuse.epic import EpicMethod
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
SELECTS = ("search", "fidelity", "deviation")  # how build_profile picks the band (the first is the default)


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


def _downstream_calls(lm: LoadedModel, workload: str | Sequence[str], data: str | None, num_problems: int,
                      capture: tuple[int, ...], on_call, desc: str, progress: bool, offset: int = 0) -> None:
    """Run each calibration pipeline with ``full``; ``on_call(call, store)`` sees every call that reads an
    upstream output, while the store holds the spans before it (carrying ``capture`` hidden states).

    ``workload``: one name or several (``num_problems`` of each, after skipping the first ``offset``), each
    on ``data`` or its calibration default (``calibration_data``)."""
    from tqdm import tqdm

    names = (workload,) if isinstance(workload, str) else tuple(workload)
    if data is not None and len(names) > 1:
        raise KvRelayError(f"calibration data {data!r} given for {len(names)} workloads: give it for one")
    problems = []
    for name in names:
        wl = get_workload(name)
        problems += [(wl, p) for p in wl.problems(calibration_data(data, name), offset + num_problems)[offset:]]
    for wl, problem in tqdm(problems, desc=desc, unit="problem", disable=not progress, file=sys.stderr):
        store = KVStore(4 << 30)  # one problem's spans at a time: captured hidden states are large
        runner = PipelineRunner(Engine(lm, store, capture_layers=capture), wl.spec, run_id=problem.problem_id)

        def probe(agent, call, position, store=store):
            if any(r.kind == "output" for r in call.refs):
                on_call(call, store)

        runner.run(problem.inputs, "full", before_call=probe)


class MethodScore(NamedTuple):
    """One method's means over the calibration calls; the path fields only when scored along full's
    continuation (``kvrelay.eval.path_fidelity``)."""

    kl: float  # first-token KL(full || method)
    reuse: float
    path_kl: float | None = None  # KL(full || method) over the continuation's positions
    greedy: float | None = None  # share of calls whose greedy continuation equals full's


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)


def score_methods(lm: LoadedModel, methods: dict, workload: str | Sequence[str], data: str | None,
                  num_problems: int, desc: str, progress: bool = True, path_tokens: int = 0,
                  offset: int = 0) -> dict[object, MethodScore]:
    """key -> each method's ``MethodScore`` over the calibration calls; with ``path_tokens`` > 0 also held to
    ``full``'s first ``path_tokens`` greedy tokens, teacher-forced."""
    one = GenerateOptions(SamplingConfig(max_new_tokens=1))
    scores: dict = {key: [] for key in methods}

    def on_call(call: CallInput, store: KVStore) -> None:
        engine = Engine(lm, store)
        if path_tokens > 0:
            ref = path_reference(engine, call, path_tokens)
            for key, method in methods.items():
                s = score_path(engine, call, method, ref)
                scores[key].append((s.first_kl, s.reuse, s.path_kl, float(s.greedy_match)))
            return
        full = engine.generate(call, "full", one).first_logits
        for key, method in methods.items():
            out = engine.generate(call, method, one)
            scores[key].append((kl_first_token(full, out.first_logits), out.stats.reuse_rate))

    capture = tuple(sorted({layer for m in methods.values() for layer in m.capture_layers(lm)}))
    _downstream_calls(lm, workload, data, num_problems, capture, on_call, desc, progress, offset)
    if not any(scores.values()):
        raise KvRelayError(f"calibration workload {workload!r} has no downstream call with an upstream output")
    # rows: one tuple per call; columns: the MethodScore fields measured
    return {key: MethodScore(*(_mean(list(col)) for col in zip(*rows, strict=True))) for key, rows in scores.items()}


def score_bands(lm: LoadedModel, candidates: list[Band], workload: str, data: str | None, num_problems: int,
                progress: bool = True, offset: int = 0) -> dict[Band, MethodScore]:
    """Band -> its ``MethodScore`` (first-token KL(full || relay), reuse) over the calibration calls."""
    # the paper's selector on every band: a band is chosen before the selector, whatever profile the model has now
    methods = {band: RelayMethod(l_start=band[0], l_det=band[1], l_end=band[2], **PAPER_SELECTOR)
               for band in candidates}
    return score_methods(lm, methods, workload, data, num_problems, "scoring bands", progress, offset=offset)


# relay's selectors tried on the calibration calls: the paper's thresholds; span openings kept (EPIC's observation)
# with stricter thresholds or the budget form at three shares; and, detecting where the carried states enter
# (``AT_START``: L_det = L_start, so the refused tokens cost nothing), wider budgets narrowed through the band,
# with and without the drift correction, with the openings in the band or at every layer
AT_START = "detect_at_start"
_SPANS = {"l_pre": 4, "l_suf": 4}
SELECTOR_CANDIDATES: tuple[dict, ...] = (
    {}, {**_SPANS, "tau_dev": 3.0, "tau_inf": 3.0},
    {"top_r": 0.1, **_SPANS}, {"top_r": 0.15, **_SPANS}, {"top_r": 0.2, **_SPANS},
    *({AT_START: True, "top_r": r, **_SPANS, "prune": p} for r, p in ((0.25, 0.1), (0.3, 0.1), (0.4, 0.2))),
    # without the spans' last tokens (kept to the band's end, they cost what a wider budget does)
    *({AT_START: True, "top_r": r, "l_pre": 4, "l_suf": 0, "prune": p} for r, p in ((0.3, 0.1), (0.35, 0.1),
                                                                                     (0.4, 0.15), (0.5, 0.25))),
    {AT_START: True, "top_r": 0.5, **_SPANS, "prune": 0.3},  # half the span admitted, pruned hard
    # the four without the last tokens again, each pruning layer correcting the span tokens it does not compute
    *({AT_START: True, "top_r": r, "l_pre": 4, "l_suf": 0, "prune": p, "drift": 0.35}
      for r, p in ((0.3, 0.1), (0.35, 0.1), (0.4, 0.15), (0.5, 0.25))),
    # the spans' first tokens computed at every layer (as EPIC computes them) instead of inside the band only
    *({AT_START: True, "top_r": r, "l_pre": n, "l_suf": 0, "prune": p, "pre_dense": True, **d}
      for r, p, d in ((0.35, 0.1, {"drift": 0.35}), (0.5, 0.25, {})) for n in (2, 4)),
    # more openings at every layer (EPIC computes 16) paid for by a narrower budget: what the continuation reads
    *({AT_START: True, "top_r": r, "l_pre": n, "l_suf": 0, "prune": p, "pre_dense": True, **d}
      for r, n, p in ((0.3, 6, 0.1), (0.2, 8, 0.1), (0.25, 8, 0.1), (0.25, 8, 0.15)) for d in ({}, {"drift": 0.35})),
)


def selector_spec(knobs: dict) -> str:
    if not knobs:
        return "relay (paper's selector)"
    return "relay[" + ",".join("l_det=l_start" if k == AT_START else f"{k}={v}" for k, v in knobs.items()) + "]"


def _rank_score(score: tuple) -> float:
    """What ``choose_selector`` minimizes: the KL along full's continuation where it was scored, else the
    first token's."""
    return score[2] if len(score) > 2 and score[2] is not None else score[0]


def choose_selector(scores: dict[str, tuple], paper: str, reuse_bar: float | None = None,
                    kl_bar: float | None = None, greedy_bar: float | None = None) -> str:
    """scores: spec -> (first-token KL, reuse[, path KL, greedy share]). The lowest KL (along full's
    continuation where scored, else the first token's) among the selectors that reuse at least ``reuse_bar``
    (epic's on the same calls: what relay must match to beat it); when none reuses that much, among those
    that reuse at least as much as the paper's (``paper``). Within those, the bars narrow the choice in turn
    while some selector meets them: a first-token KL at most ``kl_bar``, then a greedy share at least
    ``greedy_bar``. Ties: more reuse."""
    ok = [key for key, score in scores.items() if reuse_bar is not None and score[1] >= reuse_bar - 1e-9]
    if not ok:
        bar = scores[paper][1] - 1e-9
        ok = [key for key, score in scores.items() if score[1] >= bar]
    if kl_bar is not None:
        ok = [key for key in ok if scores[key][0] <= kl_bar + 1e-12] or ok
    if greedy_bar is not None:
        ok = [key for key in ok if len(scores[key]) > 3 and scores[key][3] is not None
              and scores[key][3] >= greedy_bar - 1e-9] or ok
    return min(ok, key=lambda key: (_rank_score(scores[key]), -scores[key][1]))


def calibration_data(data: str | None, workload: str) -> str | None:
    """The calibration calls' data: ``data``; else GSM8K *train* for GSM8K workloads (calibration never
    touches their test data); else the workload's own file (HumanEval has no train split: skip the problems
    a bench runs with ``offset``)."""
    if data is None and workload.startswith("gsm8k"):
        return str(data_root() / "gsm8k" / "train.jsonl")
    return data


# the dominance bar calibration aims at: relay's first-token KL at most 0.5 x epic's at epic's reuse, with a
# margin: from train calls to test problems relay's KL ratio to epic's rose by 10-15% on both models
# (BENCHMARKS.md, "Session 23"), so a point chosen right at the bar lands above it
KL_SHARE_OF_EPIC = 0.5 * 0.8


def calibrate_selector(lm: LoadedModel, profile: LayerProfile, workload: str | Sequence[str], data: str | None,
                       num_problems: int, progress: bool = True, path_tokens: int = 32,
                       offset: int = 0) -> LayerProfile:
    """``profile`` with the selector chosen on calibration calls for its band (``choose_selector``, with epic's
    on the same calls as the bars: its reuse, ``KL_SHARE_OF_EPIC`` x its first-token KL and its greedy share,
    the dominance bars, KL's with a margin; ranked by the KL along ``full``'s first ``path_tokens`` greedy
    tokens, or, with 0, by the first token's under the reuse bar only); a selector chosen with ``AT_START``
    moves the profile's L_det to L_start (the band search's own L_det stays in ``searched_band``).
    ``workload``: one name or several, their calls pooled (``_downstream_calls``)."""
    start, det, end = profile.searched_band or profile.layers
    candidates = {selector_spec(k): k for k in SELECTOR_CANDIDATES}
    methods = {spec: RelayMethod(l_start=start, l_det=start if k.get(AT_START) else det, l_end=end,
                                 **({key: v for key, v in k.items() if key != AT_START} or PAPER_SELECTOR))
               for spec, k in candidates.items()}
    scores = score_methods(lm, {**methods, "epic": EpicMethod()}, workload, data, num_problems, "scoring selectors",
                           progress, path_tokens, offset)
    epic = scores.pop("epic")
    kl_bar = KL_SHARE_OF_EPIC * epic.kl if path_tokens > 0 else None
    chosen = choose_selector(scores, selector_spec({}), epic.reuse, kl_bar, epic.greedy)
    knobs = candidates[chosen]
    profile.searched_band = [start, det, end]
    profile.l_det = start if knobs.get(AT_START) else det
    profile.selector = {k: v for k, v in knobs.items() if k != AT_START}
    profile.selector_scores = {spec: _score_dict(s) for spec, s in {**scores, "epic": epic}.items()}
    profile.calibration["selector_problems"] = num_problems
    names = [workload] if isinstance(workload, str) else list(workload)
    profile.calibration["selector_workloads"] = {name: calibration_data(data, name) or "default" for name in names}
    profile.calibration["selector_offset"] = offset
    profile.calibration["selector_path_tokens"] = path_tokens
    return profile


def _score_dict(score: MethodScore) -> dict[str, float]:
    return {k: v for k, v in score._asdict().items() if v is not None}


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

    _downstream_calls(lm, workload, data, num_problems, (), on_call, "profiling", progress, offset)
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
    profile = LayerProfile(lm.profile_fingerprint, lm.name, lm.config.num_layers, *chosen, band_mass,
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
