"""Command line: ``kvrelay demo | generate`` (``python -m kvrelay`` too)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvrelay.errors import KvRelayError


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One flag per dataclass field (defaults and types come from the dataclass, not repeated here)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, tuple):
            text = ",".join(str(x) for x in default)
            parser.add_argument(flag, default=text, help=f"comma-separated (default: {text})")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def _dataclass_from_args(cls, args: argparse.Namespace):
    values = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if isinstance(default, tuple) and isinstance(value, str):
                from kvrelay.reuse import split_method_specs

                value = split_method_specs(value)
            values[f.name] = value
    return cls(**values)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvrelay.demo import DemoConfig, run_demo

    run_demo(_dataclass_from_args(DemoConfig, args))
    return 0


def _json_saver(path: str | None):
    """Writes a bench result to ``path`` (nothing when None); called after every problem too, so a stopped
    long run keeps the problems it finished."""
    import json

    def save(result: dict) -> None:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(result, indent=1) + "\n")

    return save


def _cmd_bench(args: argparse.Namespace) -> int:

    from kvrelay.eval.harness import Bench, BenchConfig
    from kvrelay.eval.plots import write_plots
    from kvrelay.eval.report import format_by_agent, format_table

    if args.workload == "gsm8k-branches":
        return _bench_branches(args)
    save = _json_saver(args.json)
    result = Bench(_dataclass_from_args(BenchConfig, args)).run(checkpoint=save)
    save(result)
    print(f"\n{result['workload']} ({result['mode']} mode), {result['n']} problems, model {result['model']} "
          f"on {result['env']['device']}")
    if not result["fidelity_meaningful"]:
        print("fidelity columns are not meaningful for random-weight models (n/a)")
    print(format_table(result["results"], result["fidelity_meaningful"]))
    print("\n" + format_by_agent(result["results"]))
    if args.json:
        print(f"wrote {args.json} (also after every problem)")
    if args.plot:
        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0


def _bench_branches(args: argparse.Namespace) -> int:

    from kvrelay.eval.branch_bench import BranchBenchConfig, format_branch_table, run_branch_bench
    from kvrelay.reuse import PIPELINE_METHODS

    if args.methods == ",".join(PIPELINE_METHODS):  # the pipeline default: use this workload's own
        args.methods = ",".join(BranchBenchConfig.methods)
    save = _json_saver(args.json)
    result = run_branch_bench(_dataclass_from_args(BranchBenchConfig, args), checkpoint=save)
    save(result)
    print(f"\ngsm8k-branches, {result['n']} problems, model {result['model']} on {result['env']['device']} "
          f"({result['env']['machine']})")
    print(format_branch_table(result))
    if args.json:
        print(f"wrote {args.json} (also after every problem)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from kvrelay.cache.store import KVStore
    from kvrelay.engine import Engine
    from kvrelay.model.loader import load_model
    from kvrelay.pipeline.runner import PipelineRunner
    from kvrelay.pipeline.spec import PipelineSpec

    spec = PipelineSpec.from_yaml(args.pipeline)
    inputs = {}
    for item in args.input:
        name, sep, text = item.partition("=")
        if not sep:
            if len(spec.inputs) != 1:
                raise KvRelayError(f"--input {item!r}: write NAME=TEXT (inputs: {list(spec.inputs)})")
            name, text = spec.inputs[0], item
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        inputs[name] = text
    lm = load_model(args.model, device=args.device)
    engine = Engine(lm, KVStore(args.store_bytes), methods=(args.method,))  # carries what the method needs
    results = PipelineRunner(engine, spec).run(inputs, args.method)
    for name, res in results.items():
        s = res.output.stats
        print(f"=== {name} [{args.method}: {s.num_prompt_tokens} prompt tokens, TTFT {s.ttft_ms:.1f} ms, "
              f"reuse {s.reuse_rate:.2f}, {s.num_generated_tokens} new tokens"
              + (f", fallback: {s.fallback}" if s.fallback else "") + "]")
        print(res.output.text)
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from kvrelay.eval.profiler import build_profile, plot_profile, profile_path
    from kvrelay.model.loader import load_model

    lm = load_model(args.model, device=args.device)
    profile = build_profile(lm, num_problems=args.problems, band_mass=args.band_mass, data=args.data,
                            workload=args.workload, select=args.select, kl_tolerance=args.kl_tolerance)
    out = Path(args.out) if args.out else profile_path(lm.fingerprint)
    profile.save(out)
    if out != profile_path(lm.fingerprint):  # relay finds profiles by model fingerprint in the cache
        profile.save(profile_path(lm.fingerprint))
    dev = profile.deviation_band
    print(f"{lm.name}: band holding {profile.band_mass:.0%} of the value deviation: L_start={dev[0]} L_det={dev[1]} "
          f"L_end={dev[2]} ({profile.calibration['tokens']} tokens)")
    for band, score in profile.band_scores.items():
        print(f"  relay band ({band}): first-token KL(full||relay) {score['kl']:.4f}, reuse {score['reuse']:.3f}")
    print(f"chosen ({profile.select}): L_start={profile.l_start} L_det={profile.l_det} L_end={profile.l_end}")
    print("value cos by layer: " + " ".join(f"{c:.3f}" for c in profile.value_cos))
    print(f"wrote {out} (and {profile_path(lm.fingerprint)})")
    if args.plot:
        plot_profile(profile, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvrelay.engine import Engine, GenerateOptions
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.pipeline.prompt import chat_prompt_ids

    lm = load_model(args.model, device=args.device)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = chat_prompt_ids(lm.tokenizer, messages).ids
    out = Engine(lm).generate(ids, "full", GenerateOptions(_dataclass_from_args(SamplingConfig, args)))
    print(out.text)
    s = out.stats
    print(f"\n[{lm.name}: {s.num_prompt_tokens} prompt tokens, TTFT {s.ttft_ms:.1f} ms, "
          f"{s.num_generated_tokens} tokens in {s.decode_ms:.0f} ms, stop: {out.stop_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvrelay.demo import DemoConfig
    from kvrelay.eval.harness import BenchConfig
    from kvrelay.eval.profiler import SELECTS
    from kvrelay.model.loader import DEFAULT_MODEL
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.reuse import METHODS

    parser = argparse.ArgumentParser(prog="kvrelay", description="KV-cache reuse across LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="gsm8k-chain3 on the default model, every method side by side")
    _add_dataclass_flags(demo, DemoConfig)
    demo.set_defaults(fn=_cmd_demo)
    bench = sub.add_parser("bench", help="every method on a named workload: TTFT, reuse, fidelity; table + JSON "
                                         "(gsm8k-branches: full, prefix, rksc per problem)")
    _add_dataclass_flags(bench, BenchConfig)
    from kvrelay.eval.branch_bench import BranchBenchConfig

    bench_fields = {f.name for f in dataclasses.fields(BenchConfig)}
    _add_dataclass_flags(bench, BranchBenchConfig, skip=tuple(bench_fields))  # gsm8k-branches only
    bench.add_argument("--json", default=None, help="write the result JSON here")
    bench.add_argument("--plot", default=None, help="write PNG plots into this folder")
    bench.set_defaults(fn=_cmd_bench)
    run = sub.add_parser("run", help="run one pipeline (YAML) with a method; print outputs and stats")
    run.add_argument("pipeline", help="PIPELINE.yaml")
    run.add_argument("--method", default="full", help=f"one of: {', '.join(METHODS)}")
    run.add_argument("--input", action="append", default=[], help="NAME=TEXT (or NAME=@file); repeatable")
    run.add_argument("--model", default=DEFAULT_MODEL)
    run.add_argument("--device", default="cpu")
    run.add_argument("--store-bytes", type=int, default=4 << 30)
    run.set_defaults(fn=_cmd_run)
    prof = sub.add_parser("profile", help="RelayCaching's offline layer-range profile (GSM8K train calibration)")
    prof.add_argument("--model", default=DEFAULT_MODEL)
    prof.add_argument("--device", default="cpu")
    prof.add_argument("--workload", default="gsm8k-chain3", help="calibration pipelines (default gsm8k-chain3)")
    prof.add_argument("--data", default=None, help="calibration data (default ../shared/data/gsm8k/train.jsonl)")
    prof.add_argument("--problems", type=int, default=20)
    prof.add_argument("--band-mass", type=float, default=0.5, help="share of deviation the band holds")
    prof.add_argument("--select", choices=SELECTS, default=SELECTS[0],
                      help="fidelity (default): score candidate bands with relay on the calibration calls and "
                           "keep the most reuse within --kl-tolerance of the lowest KL; deviation: the paper's band")
    prof.add_argument("--kl-tolerance", type=float, default=0.1,
                      help="relative KL slack when choosing by fidelity (default 0.1)")
    prof.add_argument("--out", default=None, help="PROFILE.json (default: the cache, keyed by model fingerprint)")
    prof.add_argument("--plot", default=None, help="PNG of the curves")
    prof.set_defaults(fn=_cmd_profile)
    gen = sub.add_parser("generate", help="one chat completion with the engine")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--system", default=None)
    _add_dataclass_flags(gen, SamplingConfig)
    gen.set_defaults(fn=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KvRelayError as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as exc:
        print(f"kvrelay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
