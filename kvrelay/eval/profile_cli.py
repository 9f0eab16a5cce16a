"""``kvrelay profile``: the command that measures a model's relay profile (``kvrelay.eval.profiler``) and writes it
where relay finds it (the cache dir, keyed by the model's fingerprint).

Every flag is checked before the model loads: a bad workload, data file or number fails in a second, not after a
calibration run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.errors import ConfigError
from kvrelay.eval.configs import SELECTS
from kvrelay.flags import (
    add_model_flags,
    check_output_file,
    check_workload_data,
    finite_float,
    load_model_from,
    non_negative_integer,
    positive_integer,
)
from kvrelay.pipeline.workloads import get_workload, is_pipeline_file
from kvrelay.weights.aliases import DEFAULT_MODEL

if TYPE_CHECKING:
    from kvrelay.reuse.profile import LayerProfile

__all__ = ["add_profile_parser", "run_profile"]


def add_profile_parser(sub) -> None:
    prof = sub.add_parser("profile", help="RelayCaching's offline layer-range profile (calibrated on GSM8K train)")
    add_model_flags(prof, DEFAULT_MODEL, int4_decode=False)  # the profile relays decode KV: fp32's, always
    prof.add_argument("--workload", default="gsm8k-chain3",
                      help="calibration pipelines, a workload name or a pipeline file (.yaml, with --data: a "
                           "JSON-lines file of its inputs), or several comma-separated with --selector-only "
                           "(their calls pooled; default: gsm8k-chain3)")
    prof.add_argument("--data", default=None,
                      help="calibration data file (default for GSM8K workloads: gsm8k/train.jsonl under "
                           "$KVRELAY_DATA, else ../shared/data; else the workload's own file)")
    prof.add_argument("--problems", type=positive_integer, default=20,
                      help="calibration problems, of each workload (default: 20)")
    prof.add_argument("--offset", type=non_negative_integer, default=0,
                      help="skip the first N problems of each workload's data: HumanEval has no train split, and "
                           "`kvrelay bench` runs its first ones (default: 0)")
    prof.add_argument("--band-mass", type=finite_float, default=0.5,
                      help="share of the value deviation the band holds, in (0, 1] (default: 0.5)")
    prof.add_argument("--select", choices=SELECTS, default=SELECTS[0],
                      help="search: score bands with L_start, L_det and L_end all free (L_end below the top too) "
                           "with relay on the calibration calls and keep the most reuse within --kl-tolerance of "
                           "the lowest KL; fidelity: the same over bands that end at the top layer; deviation: "
                           "the paper's band; choices: "
                           f"{', '.join(SELECTS)} (default: {SELECTS[0]})")
    prof.add_argument("--selector-only", action="store_true",
                      help="keep the model's current profile (its band search's band and curves) and only choose "
                           "relay's token selector again on the calibration calls (a selector may bring a band of "
                           "its own)")
    prof.add_argument("--kl-tolerance", type=finite_float, default=0.1,
                      help="relative KL slack when choosing by fidelity, >= 0 (default: 0.1)")
    prof.add_argument("--path-tokens", type=non_negative_integer, default=32,
                      help="score relay's selectors along full's first N greedy tokens (teacher-forced: the KL "
                           "there, and whether greedy@N matches) and choose by that KL; 0: by the first token's "
                           "(default: 32)")
    prof.add_argument("--out", default=None, help="a copy of the profile JSON here too; the profile relay reads is the "
                      "one in the cache, keyed by model fingerprint, which is written either way")
    prof.add_argument("--plot", default=None, help="PNG file of the curves")
    prof.set_defaults(fn=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    """Check the flags, calibrate (the whole profile, or its selector only), write the profile and report it."""
    # here, not at the top: the parser above is built for every ``kvrelay`` command, and these load torch
    from kvrelay.eval.profiler import build_profile, plot_profile
    from kvrelay.eval.selector_calibration import calibrate_selector
    from kvrelay.reuse.profile import layer_profile, profile_path

    workloads = _calibration_workloads(args)
    lm = load_model_from(args)
    if args.selector_only:  # keep the model's searched band, choose the selector (and any band of its own) again
        profile = calibrate_selector(lm, layer_profile(lm), workloads, args.data, args.problems,
                                     path_tokens=args.path_tokens, offset=args.offset)
    else:
        profile = build_profile(lm, num_problems=args.problems, band_mass=args.band_mass, data=args.data,
                                workload=workloads[0], select=args.select, kl_tolerance=args.kl_tolerance,
                                path_tokens=args.path_tokens, offset=args.offset)
    cached = profile_path(lm.fingerprint)  # relay finds profiles by model fingerprint in the cache (its own first)
    out = Path(args.out) if args.out else cached
    profile.save(out)
    if out != cached:
        profile.save(cached)
    _print_profile(lm.name, profile, args.path_tokens)
    print(f"wrote {out} (and {cached})")
    if args.plot:
        plot_profile(profile, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _calibration_workloads(args: argparse.Namespace) -> list[str]:
    """The ``--workload`` names, each once, after every check that needs no model (a ConfigError otherwise)."""
    check_output_file(args.out, "--out")
    check_output_file(args.plot, "--plot")
    if not 0 < args.band_mass <= 1:
        raise ConfigError(f"--band-mass must be in (0, 1], got {args.band_mass}")
    if args.kl_tolerance < 0:
        raise ConfigError(f"--kl-tolerance must be >= 0, got {args.kl_tolerance}")
    workloads = list(dict.fromkeys(name.strip() for name in args.workload.split(",")))
    for name in workloads:
        if name == "gsm8k-branches":
            raise ConfigError("--workload gsm8k-branches: profiles calibrate on pipeline workloads (e.g. gsm8k-chain3)")
        get_workload(name)  # an unknown name fails here, before the model loads
    if len(workloads) > 1 and not args.selector_only:
        raise ConfigError(f"--workload {args.workload}: several workloads calibrate the selector only "
                          "(--selector-only); the band and curves come from one")
    if len(workloads) > 1 and args.data is not None:
        raise ConfigError(f"--data is for one workload, got {len(workloads)}: each of several reads its default")
    if len(workloads) > 1 and any(is_pipeline_file(name) for name in workloads):
        raise ConfigError(f"--workload {args.workload}: a pipeline file calibrates alone (its --data is its own)")
    check_workload_data(workloads[0], args.data)  # a pipeline file without --data fails here
    no_train = [name for name in workloads if not name.startswith("gsm8k") and not is_pipeline_file(name)]
    if no_train and args.data is None and args.offset == 0:
        raise ConfigError(f"--workload {','.join(no_train)} has no train split: its default file holds the problems "
                          "`kvrelay bench` runs first; give --offset N (e.g. 100) or --data")
    return workloads


def _print_profile(model: str, profile: LayerProfile, path_tokens: int) -> None:
    """The profile in the names a user acts on: each band and selector as the relay spec of docs/methods.md's
    settings (what no setting names follows a ``+``)."""
    from kvrelay.eval.selector_calibration import candidate_specs
    from kvrelay.reuse.relay_policy import knobs_as_spec

    dev = profile.deviation_band
    print(f"{model}: band holding {profile.band_mass:.0%} of the value deviation: L_start={dev[0]} L_det={dev[1]} "
          f"L_end={dev[2]} ({profile.calibration['tokens']} tokens)")
    for band, score in profile.band_scores.items():  # each scored with the paper's thresholds
        spec = knobs_as_spec({}, band.split(","))
        print(f"  {spec}: first-token KL(full||relay) {score['kl']:.4f}, reuse {score['reuse']:.3f}")
    start, det, end = profile.searched_band or profile.layers
    print(f"chosen ({profile.select}): L_start={start} L_det={det} L_end={end} (band={start}:{det}:{end})")
    specs = candidate_specs(profile)
    for label, score in profile.selector_scores.items():
        path = (f", KL over {path_tokens} tokens {score['path_kl']:.4f}, greedy@{path_tokens} "
                f"{score['greedy']:.2f}") if "path_kl" in score else ""
        print(f"  {specs.get(label, label)}: first-token KL(full||relay) {score['kl']:.4f}, "
              f"reuse {score['reuse']:.3f}{path}")
    print(f"relay runs (selector=profile): {knobs_as_spec(profile.selector, profile.layers)}"
          + (f" (the band search's band: {':'.join(map(str, profile.searched_band))})" if profile.band_moved else ""))
    print("value cos by layer: " + " ".join(f"{c:.3f}" for c in profile.value_cos))
