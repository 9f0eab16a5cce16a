"""RelayCaching's offline layer-range profile: where relayed decode KV deviates, and where to look.

On calibration pipelines (GSM8K *train*), for every upstream output spliced into a downstream
prompt, compare per layer the relayed decode KV (re-rotated to its new position) with the KV a
fresh prefill of the downstream prompt gives the same tokens: value cosine and key cosine.

- ``L_start``/``L_end``: the shortest contiguous band of layers holding ``band_mass`` of the total
  value deviation (1 - cos).
- ``L_det``: the band layer whose per-token deviations best predict (Spearman) the tokens' mean
  deviation over the band layers after it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.errors import KvRelayError
from kvrelay.model.loader import LoadedModel, cache_dir
from kvrelay.reuse.base import CallInput


@dataclass
class LayerProfile:
    fingerprint: str
    model: str
    num_layers: int
    l_start: int
    l_det: int
    l_end: int
    band_mass: float
    value_cos: list[float]  # per layer, mean over relayed tokens
    key_cos: list[float]
    deviation: list[float]  # per layer, mean (1 - value cos)
    det_scores: dict[int, float] = field(default_factory=dict)  # candidate L_det -> Spearman score
    calibration: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        try:
            d = json.loads(Path(path).read_text())
            d["det_scores"] = {int(k): v for k, v in d.get("det_scores", {}).items()}
            return cls(**d)
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise KvRelayError(f"{path}: not a readable RelayCaching profile ({exc})") from exc


def profile_path(fingerprint: str) -> Path:
    return cache_dir() / "profiles" / f"relay-{fingerprint}.json"


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine per token over heads x dims. a, b: [L, Hkv, n, hd] -> [L, n]."""
    a = a.float().permute(0, 2, 1, 3).flatten(2)  # [L, n, Hkv*hd]
    b = b.float().permute(0, 2, 1, 3).flatten(2)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def measure_call(lm: LoadedModel, call: CallInput, store: KVStore) -> tuple[torch.Tensor, torch.Tensor]:
    """(value cos, key cos), each [num_layers, n] over the tokens of the call's upstream outputs."""
    from kvrelay.engine import generate  # the profiler runs pipelines: engine and pipeline sit above reuse
    from kvrelay.model.sampling import SamplingConfig

    fresh = generate(lm, call, "full", store, SamplingConfig(max_new_tokens=1), keep_cache=True).cache
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
        return empty, empty
    return torch.cat(v_cos, dim=1), torch.cat(k_cos, dim=1)


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


def build_profile(lm: LoadedModel, num_problems: int = 20, band_mass: float = 0.5, data: str | None = None,
                  workload: str = "gsm8k-chain3", progress: bool = True) -> LayerProfile:
    """Run calibration pipelines with ``full`` and profile every downstream call's upstream outputs."""
    from tqdm import tqdm

    from kvrelay.eval.datasets import data_root
    from kvrelay.pipeline.runner import PipelineRunner
    from kvrelay.pipeline.workloads import get_workload

    wl = get_workload(workload)
    data = data or str(data_root() / "gsm8k" / "train.jsonl")  # calibration never touches the test data
    v_all, k_all = [], []
    for problem in tqdm(wl.problems(data, num_problems), desc="profiling", unit="problem", disable=not progress,
                        file=sys.stderr):
        store = KVStore(4 << 30)
        runner = PipelineRunner(lm, wl.spec, store, run_id=problem.problem_id)

        def probe(agent, call, position, store=store):
            if any(r.kind == "output" for r in call.refs):
                v, k = measure_call(lm, call, store)
                v_all.append(v)
                k_all.append(k)

        runner.run(problem.inputs, "full", before_call=probe)
    if not v_all:
        raise KvRelayError(f"workload {workload!r} has no downstream call with an upstream output to profile")
    v_cos, k_cos = torch.cat(v_all, dim=1), torch.cat(k_all, dim=1)  # [L, tokens]
    token_dev = 1 - v_cos
    deviation = token_dev.mean(1).tolist()
    l_start, l_end = choose_band(deviation, band_mass)
    l_det, scores = choose_detection_layer(token_dev, l_start, l_end)
    return LayerProfile(lm.fingerprint, lm.name, lm.config.num_layers, l_start, l_det, l_end, band_mass,
                        v_cos.mean(1).tolist(), k_cos.mean(1).tolist(), deviation, scores,
                        {"workload": workload, "data": data, "problems": num_problems,
                         "tokens": int(v_cos.shape[1])})


def plot_profile(profile: LayerProfile, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(profile.num_layers))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(layers, profile.value_cos, marker="o", label="value cosine (relayed decode vs fresh)")
    ax.plot(layers, profile.key_cos, marker="s", label="key cosine (after re-rotation)")
    ax.axvspan(profile.l_start - 0.5, profile.l_end + 0.5, alpha=0.15, color="tab:red",
               label=f"band [{profile.l_start}, {profile.l_end}]")
    ax.axvline(profile.l_det, color="tab:red", linestyle="--", label=f"L_det = {profile.l_det}")
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine similarity")
    ax.set_title(f"RelayCaching layer profile: {profile.model} ({profile.calibration.get('tokens')} tokens)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
