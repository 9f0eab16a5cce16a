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
    # selectors chosen on one workload's calibration calls (``kvrelay profile --selector-only --for-workload``):
    # workload -> {"roles": {agent: role_key}, "layers": [l_start, l_det, l_end], "selector": {...},
    # "selector_scores": {...}, "calibration": {...}}; a call whose role is among a workload's uses its layers
    # and selector instead of the ones above
    workload_selectors: dict[str, dict] = field(default_factory=dict)

    @property
    def layers(self) -> tuple[int, int, int]:
        return self.l_start, self.l_det, self.l_end

    @property
    def band_moved(self) -> bool:
        """Whether the calibrated selector brought a band of its own (ends other than the band search's)."""
        return bool(self.searched_band) and self.searched_band[::2] != [self.l_start, self.l_end]

    def for_role(self, role: str) -> tuple[tuple[int, int, int], dict]:
        """(L_start, L_det, L_end) and the selector a call of this role runs: a workload's whose agents have it,
        else the profile's own."""
        name = self.workload_of(role)
        if name is None:
            return self.layers, self.selector
        entry = self.workload_selectors[name]
        return tuple(entry["layers"]), entry["selector"]

    def workload_of(self, role: str) -> str | None:
        """The workload whose selector serves calls of ``role``, if any ("", no system prompt, is no role)."""
        matches = (name for name, entry in self.workload_selectors.items() if role in entry["roles"].values())
        return next(matches, None) if role else None

    def _check_workload_selector(self, name: str, entry: object) -> None:
        """A TypeError naming the workload unless ``entry`` has roles (agent -> role key), a selector and layers
        inside the model entering at the profile's own L_start (upstream calls carry one layer's hidden states)."""
        layers = entry.get("layers") if isinstance(entry, dict) else None
        roles = entry.get("roles") if isinstance(entry, dict) else None
        if not (isinstance(roles, dict) and roles and all(isinstance(k, str) and isinstance(v, str) and v
                                                         for k, v in roles.items())
                and isinstance(entry.get("selector"), dict) and isinstance(layers, list) and len(layers) == 3
                and all(type(x) is int for x in layers)):
            raise TypeError(f"workload selector {name!r} needs roles {{agent: role key}}, layers [l_start, l_det, "
                            f"l_end] and a selector")
        if not (layers[0] == self.l_start and layers[0] <= layers[1] <= layers[2] < self.num_layers):
            raise TypeError(f"workload selector {name!r}: layers {layers} must enter at the profile's L_start "
                            f"{self.l_start} and satisfy L_start <= L_det <= L_end < {self.num_layers}")

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        try:
            d = json.loads(Path(path).read_text())
            d["det_scores"] = {int(k): v for k, v in d.get("det_scores", {}).items()}
            profile = cls(**d)
            for name, entry in profile.workload_selectors.items():
                profile._check_workload_selector(name, entry)
            return profile
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise KvRelayError(f"{path}: not a readable RelayCaching profile ({exc})") from exc


def profile_path(fingerprint: str) -> Path:
    """Where ``kvrelay profile`` writes a model's profile (and where ``layer_profile`` looks first)."""
    return cache_dir() / "profiles" / f"relay-{fingerprint}.json"


_PROFILES: dict[str, LayerProfile] = {}  # fingerprint -> profile, read once per process


def layer_profile(lm: LoadedModel, shipped_dir: Path = SHIPPED_PROFILES) -> LayerProfile:
    """The model's profile: yours (the cache dir), else the one shipped with kvrelay, else a ConfigError.

    When yours and the shipped one disagree on the layers, says which it uses (a profile cached by an
    older kvrelay would otherwise silently outlive a better shipped one).
    """
    if lm.profile_fingerprint in _PROFILES:
        return _PROFILES[lm.profile_fingerprint]
    path = profile_path(lm.profile_fingerprint)
    shipped = shipped_dir / path.name
    if path.exists():
        profile = LayerProfile.load(path)
        if shipped.exists():
            other = LayerProfile.load(shipped)
            if profile.layers != other.layers:
                print(f"kvrelay: RelayCaching layers {_fmt_layers(profile)} from your profile {path}; the profile "
                      f"shipped with kvrelay has {_fmt_layers(other)} - delete yours to use it", file=sys.stderr)
            elif missing := sorted(set(other.workload_selectors) - set(profile.workload_selectors)):
                print(f"kvrelay: relay's selectors from your profile {path}; the profile shipped with kvrelay also "
                      f"has selectors for {', '.join(missing)} - delete yours to use them", file=sys.stderr)
    elif shipped.exists():
        profile = LayerProfile.load(shipped)
    else:
        raise ConfigError(
            f"relay: no RelayCaching layer profile for model {lm.name!r} (fingerprint {lm.profile_fingerprint}; "
            f"looked in {path} and {shipped}). Build one with `kvrelay profile --model {lm.name}`, or give the layers: "
            f"relay[band=start:det:end]")
    _PROFILES[lm.profile_fingerprint] = profile
    return profile


def _fmt_layers(profile: LayerProfile) -> str:
    return f"L_start {profile.l_start} / L_det {profile.l_det} / L_end {profile.l_end} (chosen by {profile.select})"
