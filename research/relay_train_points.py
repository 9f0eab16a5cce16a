"""Relay points with explicit layers and knobs, scored on calibration (train) calls beside epic.

Each point is held to ``full``'s first 32 greedy tokens, teacher-forced, as ``kvrelay profile`` scores its
candidates (``kvrelay.eval.calibration_calls.score_methods``): first-token KL(full || m), reuse, the KL along
the continuation and the greedy@32 share, means over the downstream calls. For exploring which settings a
profile's candidates should hold, on problems the profile's own calibration does not use (``--offset``).

Usage: python research/relay_train_points.py --model gemma3-270m --workload gsm8k-chain3 --offset 100
    --problems 10 --points POINTS.json --json OUT.json
POINTS.json: {"name": {relay knob: value, ...}, ...}: the three layers and the profile's knob vocabulary
(``kvrelay.reuse.relay_policy.KNOBS``), e.g. {"[3,3,13] top_r=0.3": {"l_start": 3, "l_det": 3, "l_end": 13,
"l_pre": 16, "l_suf": 0, "top_r": 0.3, "prune": 0.25}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvrelay.errors import ConfigError
from kvrelay.eval.calibration_calls import score_methods
from kvrelay.eval.harness import environment
from kvrelay.reuse.epic import EpicMethod
from kvrelay.reuse.relay import RelayMethod
from kvrelay.weights.loader import load_model


def load_points(path: str, cls: type[RelayMethod] = RelayMethod) -> tuple[dict[str, dict], dict[str, RelayMethod]]:
    """The file's points (name -> knobs) and name -> relay with those knobs; a one-line exit naming the file or
    point when they are bad (before the model loads)."""
    try:
        points = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--points {path}: not a readable JSON file ({exc})") from exc
    if not isinstance(points, dict) or not all(isinstance(v, dict) for v in points.values()):
        raise SystemExit(f"--points {path}: expected {{name: {{relay knob: value}}}}")
    if "epic" in points:
        raise SystemExit(f"{path}: 'epic' is the baseline's name; name the relay point otherwise")
    methods = {}
    for name, knobs in points.items():
        layers = tuple(knobs.get(k) for k in ("l_start", "l_det", "l_end"))
        if None in layers:
            raise SystemExit(f"--points {path}: point {name!r} needs l_start, l_det and l_end")
        try:
            methods[name] = cls.with_knobs(layers, {k: v for k, v in knobs.items()
                                                    if k not in ("l_start", "l_det", "l_end")})
        except ConfigError as exc:
            raise SystemExit(f"--points {path}: point {name!r}: {exc}") from exc
    return points, methods


def calls_parser(description: str, problems: int = 10, path_tokens: bool = True) -> argparse.ArgumentParser:
    """The flags of a study scored on a workload's calibration (train) calls: this script's and its kin's."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="gsm8k-chain3")
    ap.add_argument("--offset", type=int, default=100, help="skip this many problems (GSM8K: of train)")
    ap.add_argument("--problems", type=int, default=problems)
    if path_tokens:
        ap.add_argument("--path-tokens", type=int, default=32, help="score along full's first N greedy tokens")
    ap.add_argument("--json", required=True, help="where to write the scores")
    ap.add_argument("--threads", type=int, default=1)
    return ap


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0])
    ap.add_argument("--points", required=True, help="JSON file: name -> relay knobs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    points, relays = load_points(args.points)
    methods = {"epic": EpicMethod(), **relays}
    lm = load_model(args.model)
    scores = score_methods(lm, methods, args.workload, None, args.problems, "points", True, args.path_tokens,
                           args.offset)
    out = {"model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
           "path_tokens": args.path_tokens, "points": points,
           "environment": environment("cpu"),
           "scores": {name: score._asdict() for name, score in scores.items()}}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for name, score in scores.items():
        print(f"{name:60s} " + " ".join(f"{k}={v:.4f}" for k, v in score._asdict().items() if v is not None))


if __name__ == "__main__":
    main()
