"""Command line: ``kvrelay demo | generate`` (``python -m kvrelay`` too)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvrelay.errors import KvRelayError


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One flag per dataclass field (defaults and types come from the dataclass, not repeated here)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, tuple):
            parser.add_argument(flag, default=",".join(default),
                                help=f"comma-separated (default: {','.join(default)})")
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
                value = tuple(v.strip() for v in value.split(",") if v.strip())
            values[f.name] = value
    return cls(**values)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvrelay.demo import DemoConfig, run_demo

    run_demo(_dataclass_from_args(DemoConfig, args))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvrelay.engine import generate
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.pipeline.prompt import chat_prompt_ids

    lm = load_model(args.model, device=args.device)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = chat_prompt_ids(lm.tokenizer, messages).ids
    out = generate(lm, ids, "full", sampling=_dataclass_from_args(SamplingConfig, args))
    print(out.text)
    s = out.stats
    print(f"\n[{lm.name}: {s.num_prompt_tokens} prompt tokens, TTFT {s.ttft_ms:.1f} ms, "
          f"{s.num_generated_tokens} tokens in {s.decode_ms:.0f} ms, stop: {out.stop_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvrelay.demo import DemoConfig
    from kvrelay.model.loader import DEFAULT_MODEL
    from kvrelay.model.sampling import SamplingConfig

    parser = argparse.ArgumentParser(prog="kvrelay", description="KV-cache reuse across LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="2-agent GSM8K chain on the default model, methods side by side")
    _add_dataclass_flags(demo, DemoConfig)
    demo.set_defaults(fn=_cmd_demo)
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
