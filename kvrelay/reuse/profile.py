"""RelayCaching's layer profile as plain data: the dataclass, load/save, and where a model's profile is found.

A profile says which layers ``relay`` repairs on one model: ``L_start``/``L_det``/``L_end``, with the
per-layer curves they were chosen from. Building one runs calibration pipelines, which sits above
``reuse`` (``kvrelay.eval.profiler``, ``kvrelay profile``); this module only reads and writes them, so
planning a call never runs a pipeline.

Lookup (``layer_profile``): yours in the cache dir (``kvrelay profile`` writes it there, keyed by model
fingerprint), else the one shipped with kvrelay (``kvrelay/profiles/``), else a ``ConfigError`` saying
how to get one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.errors import ConfigError, KvRelayError
from kvrelay.weights.loader import cache_dir

if TYPE_CHECKING:
    from kvrelay.model.lm import LoadedModel

SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "profiles"  # measured for the embedded models


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
    select: str = "deviation"  # how (l_start, l_det, l_end) was chosen: "deviation" or "fidelity"
    deviation_band: list[int] = field(default_factory=list)  # the paper's (l_start, l_det, l_end)
    # "l_start,l_det,l_end" -> {"kl": mean first-token KL(full || relay), "reuse": mean reuse} on calibration
    band_scores: dict[str, dict[str, float]] = field(default_factory=dict)
    # relay's token selector chosen on the calibration calls for this band (e.g. {"top_r": 0.2, "l_pre": 4,
    # "l_suf": 4}); empty: the paper's thresholds. Used when a relay spec sets none of the selector's knobs.
    selector: dict[str, float | int | str] = field(default_factory=dict)
    selector_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # spec -> kl, reuse[, path_kl, greedy]
    # the band search's (l_start, l_det, l_end) before the selector's calibration (which may move l_det to l_start,
    # or the band itself: a selector chosen with a band of its own)
    searched_band: list[int] = field(default_factory=list)

    @property
    def layers(self) -> tuple[int, int, int]:
        return self.l_start, self.l_det, self.l_end

    @property
    def band_moved(self) -> bool:
        """Whether the calibrated selector brought a band of its own (ends other than the band search's)."""
        return bool(self.searched_band) and self.searched_band[::2] != [self.l_start, self.l_end]

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        try:
            d = json.loads(Path(path).read_text())
            d["det_scores"] = {int(k): v for k, v in d.get("det_scores", {}).items()}
            # selectors keyed by one workload's agents (an older kvrelay wrote them) are not read: a default tuned on
            # one workload's calls; the model's own selector serves every call
            d.pop("workload_selectors", None)
            return cls(**d)
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise KvRelayError(f"{path}: not a readable RelayCaching profile ({exc})") from exc


def profile_path(fingerprint: str) -> Path:
    """Where ``kvrelay profile`` writes a model's profile (and where ``layer_profile`` looks first)."""
    return cache_dir() / "profiles" / f"relay-{fingerprint}.json"


_PROFILES: dict[str, LayerProfile] = {}  # fingerprint -> profile, read once per process


def layer_profile(lm: LoadedModel, shipped_dir: Path = SHIPPED_PROFILES) -> LayerProfile:
    """The model's profile: yours (the cache dir), else the one shipped with kvrelay, found under the model's own
    fingerprint, else under the one its profile is another model's (``LoadedModel.prefill_fingerprint``: the fp32
    path of an int4-decode model, the source of an exported folder); else a ConfigError. A profile for a model of
    another depth is a ConfigError too.

    When yours and the shipped one disagree on the layers, says which it uses (a profile cached by an
    older kvrelay would otherwise silently outlive a better shipped one).
    """
    fingerprints = list(dict.fromkeys([lm.fingerprint, lm.profile_fingerprint]))
    for fingerprint in fingerprints:
        if fingerprint in _PROFILES:
            return _PROFILES[fingerprint]
    looked = []
    for fingerprint in fingerprints:
        path = profile_path(fingerprint)
        shipped = shipped_dir / path.name
        looked += [str(path), str(shipped)]
        profile = _read_profile(path, shipped)
        if profile is None:
            continue
        if profile.num_layers != lm.config.num_layers:
            raise ConfigError(f"relay: the layer profile found for model {lm.name!r} (fingerprint {fingerprint}, "
                              f"{path if path.exists() else shipped}) is for a model of {profile.num_layers} layers; "
                              f"{lm.name!r} has {lm.config.num_layers}. Build its own with `kvrelay profile --model "
                              f"{lm.name}`")
        _PROFILES[fingerprint] = profile
        return profile
    raise ConfigError(
        f"relay: no RelayCaching layer profile for model {lm.name!r} (fingerprint {' or '.join(fingerprints)}; "
        f"looked in {', '.join(looked)}). Build one with `kvrelay profile --model {lm.name}`, or give the layers: "
        f"relay[band=start:det:end]")


def _read_profile(path: Path, shipped: Path) -> LayerProfile | None:
    """Yours at ``path`` (saying so when it disagrees with the shipped one), else the shipped one, else None."""
    if path.exists():
        profile = LayerProfile.load(path)
        if shipped.exists():
            other = LayerProfile.load(shipped)
            if profile.layers != other.layers:
                print(f"kvrelay: RelayCaching layers {_fmt_layers(profile)} from your profile {path}; the profile "
                      f"shipped with kvrelay has {_fmt_layers(other)} - delete yours to use it", file=sys.stderr)
        return profile
    return LayerProfile.load(shipped) if shipped.exists() else None


def _fmt_layers(profile: LayerProfile) -> str:
    return f"L_start {profile.l_start} / L_det {profile.l_det} / L_end {profile.l_end} (chosen by {profile.select})"
