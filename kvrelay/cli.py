"""Command line: ``kvrelay demo | generate | methods | export-hf`` (``python -m kvrelay`` too)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from kvrelay.errors import ConfigError, DataFileError, KvRelayError
from kvrelay.flags import (
    Parser,
    add_dataclass_flags,
    add_model_flags,
    check_output_dir,
    check_output_file,
    dataclass_from_args,
    finite_float,
    load_model_from,
    non_negative_integer,
    positive_integer,
)

# the names commands added elsewhere (serve) use
_add_dataclass_flags = add_dataclass_flags
_dataclass_from_args = dataclass_from_args


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvrelay.demo import DemoConfig, run_demo

    cfg = dataclass_from_args(DemoConfig, args)
    check_output_dir(cfg.out, "--out")
    run_demo(cfg)
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
    from kvrelay.pipeline.workloads import get_workload

    check_output_file(args.json, "--json")
    check_output_dir(args.plot, "--plot")
    if args.workload == "gsm8k-branches":
        return _bench_branches(args)
    cfg = dataclass_from_args(BenchConfig, args)
    _check_data(cfg.workload, cfg.data, cfg.warm_data)
    if cfg.mode == "e2e" and get_workload(cfg.workload).score is None:
        raise ConfigError(f"workload {cfg.workload!r} has no task score: use --mode agent")
    save = _json_saver(args.json)
    result = Bench(cfg).run(checkpoint=save)
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


def _check_data(workload: str, *paths: str | None) -> None:
    """Read the data files once before the model loads: a bad line fails in a second, not after a run (a pipeline
    file, which has no default data, without its first one fails too)."""
    from kvrelay.pipeline.workloads import get_workload, is_pipeline_file

    for i, path in enumerate(paths):
        if path is not None or (i == 0 and is_pipeline_file(workload)):
            get_workload(workload).problems(path, None)


def _read_input(name: str, text: str) -> str:
    """An --input value: TEXT, or @FILE read as UTF-8."""
    if not text.startswith("@"):
        return text
    path = Path(text[1:])
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataFileError(f"--input {name}=@{path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise DataFileError(f"--input {name}=@{path}: not a UTF-8 text file (byte {exc.start})") from None
    except OSError as exc:
        raise DataFileError(f"--input {name}=@{path}: cannot read ({exc.strerror or exc})") from None


def _bench_branches(args: argparse.Namespace) -> int:

    from kvrelay.eval.branch_bench import BranchBenchConfig, format_branch_table, run_branch_bench
    from kvrelay.reuse import PIPELINE_METHODS

    if args.methods == ",".join(PIPELINE_METHODS):  # the pipeline default: use this workload's own
        args.methods = ",".join(BranchBenchConfig.methods)
    cfg = dataclass_from_args(BranchBenchConfig, args)
    _check_data("gsm8k-chain3", cfg.data)  # the branches read GSM8K problems
    save = _json_saver(args.json)
    result = run_branch_bench(cfg, checkpoint=save)
    save(result)
    print(f"\ngsm8k-branches, {result['n']} problems, model {result['model']} on {result['env']['device']} "
          f"({result['env']['machine']})")
    print(format_branch_table(result))
    if args.json:
        print(f"wrote {args.json} (also after every problem)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from kvrelay.engine import Engine
    from kvrelay.pipeline.runner import PipelineRunner
    from kvrelay.pipeline.spec import PipelineSpec
    from kvrelay.reuse import PIPELINE_METHODS, get_method
    from kvrelay.tier.tiered import open_store

    spec = PipelineSpec.from_yaml(args.pipeline)
    if get_method(args.method).name not in PIPELINE_METHODS:
        raise ConfigError(f"--method {args.method}: runs on the gsm8k-branches workload only "
                          f"(kvrelay bench --workload gsm8k-branches); pipelines take {', '.join(PIPELINE_METHODS)}")
    inputs = {}
    for item in args.input:
        name, sep, text = item.partition("=")
        if not sep:
            if len(spec.inputs) != 1:
                raise ConfigError(f"--input {item!r}: write NAME=TEXT (inputs: {list(spec.inputs)})")
            name, text = spec.inputs[0], item
        if name in inputs:
            raise ConfigError(f"--input {name}: given twice")
        inputs[name] = _read_input(name, text)
    spec.check_inputs(inputs)
    lm = load_model_from(args)
    if lm.decode_weights != "fp32":
        print(f"kvrelay: decode weights: {lm.decode_weights}", file=sys.stderr)
    store = open_store(args.store, args.store_bytes, fingerprint=lm.fingerprint)
    engine = Engine(lm, store, methods=(args.method,))  # carries what the method needs
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
    from kvrelay.eval.selector_calibration import calibrate_selector, calibrate_workload_selector
    from kvrelay.pipeline.workloads import get_workload, is_pipeline_file
    from kvrelay.reuse.profile import layer_profile

    check_output_file(args.out, "--out")
    check_output_file(args.plot, "--plot")
    if not 0 < args.band_mass <= 1:
        raise ConfigError(f"--band-mass must be in (0, 1], got {args.band_mass}")
    if args.kl_tolerance < 0:
        raise ConfigError(f"--kl-tolerance must be >= 0, got {args.kl_tolerance}")
    workloads = list(dict.fromkeys(name.strip() for name in args.workload.split(",")))  # each once
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
    _check_data(workloads[0], args.data)  # a pipeline file without --data fails here
    no_train = [name for name in workloads if not name.startswith("gsm8k") and not is_pipeline_file(name)]
    if no_train and args.data is None and args.offset == 0:
        raise ConfigError(f"--workload {','.join(no_train)} has no train split: its default file holds the problems "
                          "`kvrelay bench` runs first; give --offset N (e.g. 100) or --data")
    if args.for_workload and (not args.selector_only or len(workloads) > 1):
        missing = "" if args.selector_only else " without --selector-only"
        raise ConfigError("--for-workload chooses a selector for one workload's agents: give --selector-only and "
                          f"one --workload (got {args.workload!r}{missing})")
    lm = load_model_from(args)
    if args.for_workload:  # keep the model's profile; add (or replace) the selector of this workload's agents
        profile = calibrate_workload_selector(lm, layer_profile(lm), workloads[0], args.data, args.problems,
                                              path_tokens=args.path_tokens, offset=args.offset)
    elif args.selector_only:  # keep the model's searched band, choose the selector (and any band of its own) again
        profile = calibrate_selector(lm, layer_profile(lm), workloads, args.data, args.problems,
                                     path_tokens=args.path_tokens, offset=args.offset)
    else:
        profile = build_profile(lm, num_problems=args.problems, band_mass=args.band_mass, data=args.data,
                                workload=workloads[0], select=args.select, kl_tolerance=args.kl_tolerance,
                                path_tokens=args.path_tokens, offset=args.offset)
    out = Path(args.out) if args.out else profile_path(lm.profile_fingerprint)
    profile.save(out)
    if out != profile_path(lm.profile_fingerprint):  # relay finds profiles by model fingerprint in the cache
        profile.save(profile_path(lm.profile_fingerprint))
    dev = profile.deviation_band
    print(f"{lm.name}: band holding {profile.band_mass:.0%} of the value deviation: L_start={dev[0]} L_det={dev[1]} "
          f"L_end={dev[2]} ({profile.calibration['tokens']} tokens)")
    for band, score in profile.band_scores.items():
        print(f"  relay band ({band}): first-token KL(full||relay) {score['kl']:.4f}, reuse {score['reuse']:.3f}")
    print(f"chosen ({profile.select}): L_start={profile.l_start} L_det={profile.l_det} L_end={profile.l_end}")
    workload_name = get_workload(workloads[0]).name  # a pipeline file's: its pipeline's name
    entry = profile.workload_selectors[workload_name] if args.for_workload else None
    for spec, score in (entry or {"selector_scores": profile.selector_scores})["selector_scores"].items():
        path = (f", KL over {args.path_tokens} tokens {score['path_kl']:.4f}, greedy@{args.path_tokens} "
                f"{score['greedy']:.2f}") if "path_kl" in score else ""
        print(f"  selector {spec}: first-token KL(full||relay) {score['kl']:.4f}, reuse {score['reuse']:.3f}{path}")
    print(f"selector: {profile.selector or 'the paper thresholds'}"
          + (f", on a band of its own: L_start={profile.l_start} L_det={profile.l_det} L_end={profile.l_end} "
             f"(the band search's: {profile.searched_band})" if profile.band_moved else ""))
    if entry is not None:
        start, det, end = entry["layers"]
        print(f"selector for {workload_name}'s agents ({', '.join(entry['roles'])}): "
              f"{entry['selector'] or 'the paper thresholds'}, L_start={start} L_det={det} L_end={end}")
    print("value cos by layer: " + " ".join(f"{c:.3f}" for c in profile.value_cos))
    print(f"wrote {out} (and {profile_path(lm.profile_fingerprint)})")
    if args.plot:
        plot_profile(profile, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.engine import Engine, GenerateOptions
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.pipeline.prompt import chat_prompt_ids

    sampling = dataclass_from_args(SamplingConfig, args)
    lm = load_model_from(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = chat_prompt_ids(lm.tokenizer, messages).ids
    out = Engine(lm).generate(ids, "full", GenerateOptions(sampling))
    print(out.text)
    s = out.stats
    print(f"\n[{lm.name}: {s.num_prompt_tokens} prompt tokens, TTFT {s.ttft_ms:.1f} ms, "
          f"{s.num_generated_tokens} tokens in {s.decode_ms:.0f} ms (decode weights: {lm.decode_weights}; "
          f"matmuls: {lm.matmuls}; threads: {torch.get_num_threads()}), "
          f"stop: {out.stop_reason}]", file=sys.stderr)
    return 0


def _cmd_methods(args: argparse.Namespace) -> int:
    import json

    from kvrelay.reuse.catalog import format_catalog, method_catalog

    infos = method_catalog(tuple(args.names))
    print(json.dumps([info.to_dict() for info in infos], indent=1) if args.json else format_catalog(infos))
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from kvrelay.weights.hf_export import export_hf

    out = export_hf(args.model, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out} (load it with vLLM: python -m kvrelay.vllm.launch serve {out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvrelay.server.cli import add_serve_parser

    parser = Parser(prog="kvrelay", description="KV-cache reuse across LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo_parser, _add_bench_parser, _add_run_parser, _add_profile_parser, _add_generate_parser,
                _add_methods_parser, _add_export_parser, add_serve_parser):
        add(sub)
    return parser


def _add_demo_parser(sub) -> None:
    from kvrelay.demo import DemoConfig

    demo = sub.add_parser("demo", help="gsm8k-chain3 on the default model, every method side by side")
    add_dataclass_flags(demo, DemoConfig)
    demo.set_defaults(fn=_cmd_demo)


def _add_bench_parser(sub) -> None:
    from kvrelay.eval.branch_bench import BranchBenchConfig
    from kvrelay.eval.harness import BenchConfig

    bench = sub.add_parser("bench", help="every method on a named workload: TTFT, reuse, fidelity; table + JSON "
                                         "(gsm8k-branches: full, prefix, rksc per problem)")
    add_dataclass_flags(bench, BenchConfig)
    bench_fields = {f.name for f in dataclasses.fields(BenchConfig)}
    add_dataclass_flags(bench, BranchBenchConfig, skip=tuple(bench_fields))  # gsm8k-branches only
    bench.add_argument("--json", default=None,
                       help="result JSON file, rewritten after every problem (checked before the run starts)")
    bench.add_argument("--plot", default=None, help="folder for the PNG plots (created; checked before the run)")
    bench.set_defaults(fn=_cmd_bench)


def _add_run_parser(sub) -> None:
    from kvrelay.reuse import PIPELINE_METHODS
    from kvrelay.weights.loader import DEFAULT_MODEL

    run = sub.add_parser("run", help="run one pipeline (YAML) with a method; print outputs and stats")
    run.add_argument("pipeline", help="pipeline file (YAML): inputs, agents with {name} placeholders")
    run.add_argument("--method", default="full",
                     help=f"reuse method spec NAME or NAME[k=v,...]; choices: {', '.join(PIPELINE_METHODS)} "
                          "(default: full)")
    run.add_argument("--input", action="append", default=[],
                     help="a task input as NAME=TEXT or NAME=@FILE (UTF-8 text); repeatable")
    add_model_flags(run, DEFAULT_MODEL)
    run.add_argument("--store-bytes", type=positive_integer, default=4 << 30,
                     help="KV store budget in bytes (default: 4 GiB)")
    run.add_argument("--store", default="memory",
                     help="span store: memory (default), disk:PATH or redis://host:port/db (a shared tier behind "
                          "the memory store; credentials are never printed)")
    run.set_defaults(fn=_cmd_run)


def _add_profile_parser(sub) -> None:
    from kvrelay.eval.profiler import SELECTS
    from kvrelay.weights.loader import DEFAULT_MODEL

    prof = sub.add_parser("profile", help="RelayCaching's offline layer-range profile (calibrated on GSM8K train)")
    add_model_flags(prof, DEFAULT_MODEL, int4_decode=False)  # the profile relays decode KV: fp32's, always
    prof.add_argument("--workload", default="gsm8k-chain3",
                      help="calibration pipelines, a workload name or a pipeline file (.yaml, with --data: a "
                           "JSON-lines file of its inputs), or several comma-separated with --selector-only "
                           "(their calls pooled; default: gsm8k-chain3)")
    prof.add_argument("--data", default=None,
                      help="calibration data file (default: ../shared/data/gsm8k/train.jsonl for GSM8K workloads, "
                           "else the workload's own file)")
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
    prof.add_argument("--for-workload", action="store_true",
                      help="with --selector-only and one --workload: keep the profile's selector for every other "
                           "call and add one chosen on this workload's calls alone, used for calls whose system "
                           "prompt is one of its agents' (a server request with that system message included)")
    prof.add_argument("--kl-tolerance", type=finite_float, default=0.1,
                      help="relative KL slack when choosing by fidelity, >= 0 (default: 0.1)")
    prof.add_argument("--path-tokens", type=non_negative_integer, default=32,
                      help="score relay's selectors along full's first N greedy tokens (teacher-forced: the KL "
                           "there, and whether greedy@N matches) and choose by that KL; 0: by the first token's "
                           "(default: 32)")
    prof.add_argument("--out", default=None, help="a copy of the profile JSON here too; the profile relay reads is the "
                      "one in the cache, keyed by model fingerprint, which is written either way")
    prof.add_argument("--plot", default=None, help="PNG file of the curves")
    prof.set_defaults(fn=_cmd_profile)


def _add_generate_parser(sub) -> None:
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.weights.loader import DEFAULT_MODEL

    gen = sub.add_parser("generate", help="one chat completion with the engine")
    gen.add_argument("prompt", help="the user message (text, taken literally)")
    add_model_flags(gen, DEFAULT_MODEL)
    gen.add_argument("--system", default=None, help="a system message (default: none)")
    add_dataclass_flags(gen, SamplingConfig)
    gen.set_defaults(fn=_cmd_generate)


def _add_methods_parser(sub) -> None:
    methods = sub.add_parser("methods", help="every reuse method with its settings, defaults and one line of meaning")
    methods.add_argument("names", nargs="*", help="only these methods (default: every registered one)")
    methods.add_argument("--json", action="store_true", help="print JSON: a list of {name, summary, settings}")
    methods.set_defaults(fn=_cmd_methods)


def _add_export_parser(sub) -> None:
    from kvrelay.weights.hf_export import EXPORT_DTYPES

    export = sub.add_parser("export-hf", help="write a model as a Hugging Face folder (config, safetensors, "
                                              "tokenizer with chat template) that transformers and vLLM load")
    export.add_argument("model", help="an embedded model alias (smollm2-135m, gemma3-270m) or a .gguf file")
    export.add_argument("out_dir", help="the folder to write (must be absent or empty unless --overwrite)")
    export.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32",
                        help="weights' dtype; float32 holds kvrelay's own dequantized numbers (default: float32)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    export.set_defaults(fn=_cmd_export_hf)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is then caught below
        return code
    except BrokenPipeError:  # the reader went away (``kvrelay methods | head``): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so Python's exit flush raises nothing
        return 0
    except (KvRelayError, ValueError, KeyError, OSError) as exc:
        message = str(exc) if not isinstance(exc, KeyError) else str(exc.args[0] if exc.args else exc)
        print(f"kvrelay: error: {' '.join(message.split()) or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
