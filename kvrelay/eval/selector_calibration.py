"""Relay's token selector, chosen on calibration calls for a profile's band (``kvrelay profile``'s last pass,
or ``--selector-only``).

Each candidate (the paper's thresholds; span openings kept with stricter thresholds or the budget form; wider
budgets detected at L_start and pruned through the band) is held to ``full``'s first 32 greedy tokens,
teacher-forced (``kvrelay.eval.path_fidelity``): the KL along them and whether greedy@32 matches, beside the
first token's KL. The choice is the lowest KL along the continuation among those reusing at least as much as
``epic`` on the same calls (else as much as the paper's), narrowed while any candidate meets them by the rest
of the dominance bar: a first-token KL at most 0.4x epic's (half, with a margin for train-to-test drift), then
a greedy@32 share at least epic's. ``relay`` uses it when a spec sets none of the selector's knobs.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.eval.calibration_calls import MethodScore, calibration_data, score_methods
from kvrelay.model.lm import LoadedModel
from kvrelay.reuse.epic import EpicMethod
from kvrelay.reuse.profile import LayerProfile
from kvrelay.reuse.relay import PAPER_SELECTOR, RelayMethod

__all__ = ["AT_START", "KL_SHARE_OF_EPIC", "SELECTOR_CANDIDATES", "calibrate_selector", "choose_selector",
           "selector_spec"]


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


