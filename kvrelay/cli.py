"""Command line: ``kvrelay demo | bench | run | generate | methods | export-hf`` (``python -m kvrelay`` too);
``profile`` is ``kvrelay.eval.profile_cli``'s, ``serve`` is ``kvrelay.server.cli``'s."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvrelay.closed_pipe import reader_gone
from kvrelay.errors import ConfigError, DataFileError, KvRelayError
from kvrelay.flags import (
    Parser,
    add_dataclass_flags,
    add_model_flags,
    add_threads_flag,
    check_output_dir,
    check_output_file,
    check_workload_data,
    dataclass_from_args,
    load_model_from,
    positive_integer,
    set_threads,
)

# the names commands added elsewhere (serve) use
_add_dataclass_flags = add_dataclass_flags
_dataclass_from_args = dataclass_from_args


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvrelay.demo import DemoConfig, run_demo

    cfg = dataclass_from_args(DemoConfig, args)
    check_output_dir(cfg.out, "--out")
    check_workload_data("gsm8k-chain3", cfg.data)
    set_threads(args)
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
    given = [_flag(name) for name in _branch_only_fields() if getattr(args, name) is not None]
    if given:  # not read on this workload: refused rather than ignored
        raise ConfigError(f"{', '.join(given)}: gsm8k-branches only (--workload gsm8k-branches); "
                          f"workload {args.workload!r} does not read {'it' if len(given) == 1 else 'them'}")
    cfg = dataclass_from_args(BenchConfig, args)
    check_workload_data(cfg.workload, cfg.data, cfg.warm_data)
    if cfg.mode == "e2e" and get_workload(cfg.workload).score is None:
        raise ConfigError(f"workload {cfg.workload!r} has no task score: use --mode agent")
    save = _json_saver(args.json)
    result = Bench(cfg).run(checkpoint=save)
    save(result)
    print(f"\n{result['workload']} ({result['mode']} mode), {result['n']} problem{'s' * (result['n'] != 1)}, "
          f"model {result['model']} on {result['env']['device']}")
    if not result["fidelity_meaningful"]:
        print("fidelity columns are not meaningful for random-weight models (n/a)")
    print(format_table(result["results"], result["fidelity_meaningful"], cfg.greedy_tokens))
    print("\n" + format_by_agent(result["results"]))
    if args.json:
        print(f"wrote {args.json} (also after every problem)")
    if args.plot:
        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0


def _branch_only_fields() -> tuple[str, ...]:
    """``BranchBenchConfig``'s fields that ``BenchConfig`` lacks: the flags only gsm8k-branches reads."""
    from kvrelay.eval.configs import BenchConfig, BranchBenchConfig

    bench_fields = {f.name for f in dataclasses.fields(BenchConfig)}
    return tuple(f.name for f in dataclasses.fields(BranchBenchConfig) if f.name not in bench_fields)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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


def branch_bench_config(args: argparse.Namespace):
    """gsm8k-branches' config from ``kvrelay bench``'s flags: its own methods unless given, and the config's default
    for each of its flags not given (None on the command line: other workloads refuse them when given)."""
    from kvrelay.eval.branch_bench import BranchBenchConfig
    from kvrelay.reuse import PIPELINE_METHODS

    args = argparse.Namespace(**vars(args))
    if args.methods == ",".join(PIPELINE_METHODS):  # the pipeline default: use this workload's own
        args.methods = ",".join(BranchBenchConfig.methods)
    for name in _branch_only_fields():
        if getattr(args, name) is None:
            delattr(args, name)
    return dataclass_from_args(BranchBenchConfig, args)


def _bench_branches(args: argparse.Namespace) -> int:
    from kvrelay.eval.branch_bench import format_branch_table, run_branch_bench

    cfg = branch_bench_config(args)
    check_workload_data("gsm8k-chain3", cfg.data)  # the branches read GSM8K problems
    save = _json_saver(args.json)
    result = run_branch_bench(cfg, checkpoint=save)
    save(result)
    print(f"\ngsm8k-branches, {result['n']} problem{'s' * (result['n'] != 1)}, model {result['model']} on "
          f"{result['env']['device']} ({result['env']['machine']})")
    print(format_branch_table(result))
    if args.json:
        print(f"wrote {args.json} (also after every problem)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from kvrelay.engine import Engine
    from kvrelay.pipeline.runner import PipelineRunner
    from kvrelay.pipeline.spec import PipelineSpec
    from kvrelay.reuse import PIPELINE_METHODS, get_method
    from kvrelay.tier.store_url import parse_store_url
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
    try:  # a URL open_store would refuse, refused before the model loads
        parse_store_url(args.store)
    except ConfigError as exc:
        raise ConfigError(f"--store: {exc}") from None
    lm = load_model_from(args)
    if lm.decode_weights != "fp32":
        print(f"kvrelay: decode weights: {lm.decode_weights}", file=sys.stderr)
    try:  # what only opening it finds (a directory that cannot be made) names the flag too
        store = open_store(args.store, args.store_bytes, fingerprint=lm.fingerprint)
    except ConfigError as exc:
        raise ConfigError(f"--store: {exc}") from None
    engine = Engine(lm, store, methods=(args.method,))  # carries what the method needs

    def show(res) -> None:  # as each agent finishes: an error in a later one keeps what came before on screen
        s = res.output.stats
        print(f"=== {res.agent} [{args.method}: {s.num_prompt_tokens} prompt tokens, TTFT {s.ttft_ms:.1f} ms, "
              f"reuse {s.reuse_rate:.2f}, {s.num_generated_tokens} new tokens"
              + (f", fallback: {s.fallback}" if s.fallback else "") + "]")
        print(res.output.text, flush=True)

    PipelineRunner(engine, spec).run(inputs, args.method, progress=show)
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
    out = _stream_generation(Engine(lm), ids, GenerateOptions(sampling))
    s = out.stats
    print(f"\n[{lm.name}: {s.num_prompt_tokens} prompt tokens, TTFT {s.ttft_ms:.1f} ms, "
          f"{s.num_generated_tokens} tokens in {s.decode_ms:.0f} ms (decode weights: {lm.decode_weights}; "
          f"matmuls: {lm.matmuls}; threads: {torch.get_num_threads()}), "
          f"stop: {out.stop_reason}]", file=sys.stderr)
    return 0


def _stream_generation(engine, ids: list[int], options):
    """One ``full`` call whose text is printed as it is decoded (a long answer on a CPU takes minutes, and Ctrl-C
    keeps what was printed); the finished output."""
    from kvrelay.server.textstream import IncrementalDecoder

    seq = engine.start(ids, "full", options)
    decoder, num_printed = IncrementalDecoder(engine.lm.tokenizer), 0
    while True:
        text = decoder.feed(seq.output_ids)
        print(text[num_printed:], end="", flush=True)
        num_printed = len(text)
        if seq.done:
            break
        engine.step([seq])
    out = engine.finish(seq)
    if seq.error is not None:
        raise seq.error
    print(out.text[num_printed:] if out.text.startswith(text) else "")  # what a split character held back
    return out


def _cmd_methods(args: argparse.Namespace) -> int:
    import json

    from kvrelay.reuse.catalog import format_catalog, method_catalog

    infos = method_catalog(tuple(args.names))
    print(json.dumps([info.to_dict() for info in infos], indent=1) if args.json else format_catalog(infos))
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from kvrelay.weights.hf_export import export_hf

    out = export_hf(args.model, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out} (load it with vLLM: python -m kvrelay.vllm.launch serve {out} --dtype {args.dtype} "
          "--enforce-eager; docs/vllm.md)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvrelay import __version__
    from kvrelay.eval.profile_cli import add_profile_parser
    from kvrelay.server.cli import add_serve_parser

    parser = Parser(prog="kvrelay", description="KV-cache reuse across LLM agents")
    parser.add_argument("--version", action="version", version=f"kvrelay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo_parser, _add_bench_parser, _add_run_parser, add_profile_parser, _add_generate_parser,
                _add_methods_parser, _add_export_parser, add_serve_parser):
        add(sub)
    return parser


def _add_demo_parser(sub) -> None:
    from kvrelay.eval.configs import DEMO_THREADS, DEMO_THREADS_WHY, DemoConfig

    demo = sub.add_parser("demo", help="gsm8k-chain3 on the default model: full, prefix and the best repairs side "
                                       "by side (kvrelay bench runs every method)")
    add_dataclass_flags(demo, DemoConfig)
    add_threads_flag(demo, DEMO_THREADS, DEMO_THREADS_WHY)
    demo.set_defaults(fn=_cmd_demo)


def _add_bench_parser(sub) -> None:
    from kvrelay.eval.configs import BenchConfig, BranchBenchConfig

    bench = sub.add_parser("bench", help="every method on a named workload: TTFT, reuse, fidelity; table + JSON "
                                         "(gsm8k-branches: full, prefix, rksc per problem)")
    add_dataclass_flags(bench, BenchConfig)
    bench_fields = {f.name for f in dataclasses.fields(BenchConfig)}
    add_dataclass_flags(bench, BranchBenchConfig, skip=tuple(bench_fields))  # gsm8k-branches only
    # their help keeps the config's defaults; None tells a flag given from one not given, which other workloads refuse
    bench.set_defaults(**dict.fromkeys(_branch_only_fields()))
    bench.add_argument("--json", default=None,
                       help="result JSON file, rewritten after every problem (checked before the run starts)")
    bench.add_argument("--plot", default=None, help="folder for the PNG plots (created; checked before the run)")
    bench.set_defaults(fn=_cmd_bench)


def _add_run_parser(sub) -> None:
    from kvrelay.reuse import PIPELINE_METHODS
    from kvrelay.weights.aliases import DEFAULT_MODEL

    run = sub.add_parser("run", help="run one pipeline (YAML) with a method; print outputs and stats")
    run.add_argument("pipeline", help="pipeline file (YAML): inputs, agents with {name} placeholders")
    run.add_argument("--method", default="full",
                     help=f"reuse method spec NAME or NAME[k=v,...]; choices: {', '.join(PIPELINE_METHODS)} "
                          "(default: full)")
    run.add_argument("--input", action="append", default=[],
                     help="a task input as NAME=TEXT or NAME=@FILE (UTF-8 text); repeatable; a pipeline with one "
                          "input also takes TEXT alone (a text with '=' in it: NAME=TEXT)")
    add_model_flags(run, DEFAULT_MODEL)
    run.add_argument("--store-bytes", type=positive_integer, default=4 << 30,
                     help="KV store budget in bytes (default: 4 GiB)")
    run.add_argument("--store", default="memory",
                     help="span store: memory (default), disk:PATH or redis://host:port/db (a shared tier behind "
                          "the memory store; credentials are never printed)")
    run.set_defaults(fn=_cmd_run)


def _add_generate_parser(sub) -> None:
    from kvrelay.model.sampling_config import SamplingConfig
    from kvrelay.weights.aliases import DEFAULT_MODEL

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
    except KeyboardInterrupt:  # Ctrl-C in a long command: one line and the shell's status for SIGINT, no traceback
        print("\nkvrelay: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``kvrelay methods | head``): stop quietly, as Unix tools do
        return reader_gone()
    except (KvRelayError, ValueError, KeyError, OSError) as exc:
        message = str(exc) if not isinstance(exc, KeyError) else str(exc.args[0] if exc.args else exc)
        print(f"kvrelay: error: {' '.join(message.split()) or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
