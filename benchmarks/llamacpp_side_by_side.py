"""llama.cpp side by side: its prefill TTFT (shipped Q4_1 GGUF and Q8_0/F16/F32 written from the same
weights) and its own KV reuse, against every kvrelay method, on the same downstream calls and token ids.

The reference pipeline runs with ``full`` (as ``kvrelay bench``'s agent mode). Before each downstream
call, with the store holding exactly the upstream spans, every variant runs that call's prompt ids,
interleaved, ``--repeats`` times (median kept):
- kvrelay: every method through ``Engine.generate`` (``stats.ttft_ms``: plan, KV loads, scheduled
  prefill; the harness's TTFT window);
- llama.cpp, per GGUF format: ``full`` (prompt eval from an empty cache + first token), ``prefix``
  (slot state save/restore, longest token prefix) and ``cache_reuse`` (the server's in-order chunk
  reuse, RoPE shift without repair), over the states of this problem's earlier calls (prompt +
  output ids, evaluated untimed); see benchmarks/llamacpp_peers.py.
Both sides run ``--threads`` threads. Before the first call of each workload, the first-token logits
and ``--sanity-tokens`` greedy tokens of each GGUF are compared with kvrelay's ``full``.

Needs the bench extra (llama-cpp-python built from its sdist, see pyproject.toml).
Usage: OMP_NUM_THREADS=1 python benchmarks/llamacpp_side_by_side.py --limit 12 \
           --json benchmarks/results/llamacpp-side-by-side.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

# run as `python benchmarks/llamacpp_side_by_side.py` (run_all.sh, the table's caption): the project root, not
# benchmarks/, must be on the path for its `benchmarks.` imports
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gguf_formats import FORMATS, write_gguf_as  # noqa: E402
from benchmarks.llamacpp_peers import LlamaCpp, SavedSeq  # noqa: E402
from kvrelay.cache.store import KVStore  # noqa: E402
from kvrelay.engine import Engine, GenerateOptions  # noqa: E402
from kvrelay.eval.harness import environment  # noqa: E402
from kvrelay.model.sampling import SamplingConfig  # noqa: E402
from kvrelay.pipeline.runner import PipelineRunner  # noqa: E402
from kvrelay.pipeline.workloads import get_workload  # noqa: E402
from kvrelay.reuse import PIPELINE_METHODS, get_method  # noqa: E402
from kvrelay.weights.loader import DEFAULT_MODEL, cache_dir, gguf_path, load_model  # noqa: E402

SHIPPED_FORMAT = "Q4_1"
PEERS = ("prefix", "cache_reuse")


def gguf_files(model: str, formats: list[str], out_dir: Path) -> dict[str, Path]:
    """The shipped GGUF and, written once into ``out_dir``, the other formats from its weights."""
    shipped = gguf_path(model)
    files = {}
    for fmt in formats:
        if fmt == SHIPPED_FORMAT:
            files[fmt] = shipped
            continue
        dst = out_dir / f"{shipped.stem.split('.')[0]}.{fmt}.gguf"
        if not dst.exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_suffix(".partial")
            write_gguf_as(shipped, tmp, fmt)
            tmp.rename(dst)
        files[fmt] = dst
    return files


def sanity(engine: Engine, call, llamas: dict[str, LlamaCpp], num_tokens: int) -> dict:
    """Per format: max |first-token logit diff| vs kvrelay full, and how many greedy tokens agree."""
    ours = engine.generate(call, "full", GenerateOptions(SamplingConfig(max_new_tokens=num_tokens)))
    ref_logits = ours.first_logits.float().numpy()
    out = {}
    for fmt, llama in llamas.items():
        logits, tokens = llama.greedy(call.prompt_ids, num_tokens)
        agree = 0
        for a, b in zip(tokens, ours.output_ids, strict=False):
            if a != b:
                break
            agree += 1
        out[fmt] = {"max_abs_logit_diff": float(abs(logits - ref_logits).max()),
                    "greedy_prefix_agreeing": agree, "num_greedy_tokens": min(num_tokens, len(ours.output_ids))}
    return out


class SideBySide:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lm = load_model(args.model)
        self.methods = {m: get_method(m) for m in args.methods.split(",")}
        files = gguf_files(args.model, args.formats.split(","), Path(args.gguf_dir))
        self.llamas = {fmt: LlamaCpp(path, args.ctx_tokens, args.threads, args.flash_attn)
                       for fmt, path in files.items()}
        self.peer_formats = [f for f in args.peer_formats.split(",") if f in self.llamas]
        self.rows: list[dict] = []
        self.sanity: dict[str, dict] = {}

    def variants(self) -> list[str]:
        return [*self.methods, *(f"llama.cpp {fmt} {v}" for fmt in self.llamas for v in self.llama_variants(fmt))]

    def llama_variants(self, fmt: str) -> tuple[str, ...]:
        return ("full", *PEERS) if fmt in self.peer_formats else ("full",)

    def warm_up(self, name: str, limit: int, num_warm: int) -> list[str]:
        """Unrecorded problems after the measured ones, through which the stateful methods (kvcomm's anchor
        pools) learn from every downstream call, as in ``kvrelay bench --warm-problems``."""
        wl = get_workload(name)
        stateful = [meth for meth in self.methods.values() if meth.stateful]
        warm = wl.problems(None, limit + num_warm)[limit:] if stateful else []
        for problem in warm:
            engine = Engine(self.lm, KVStore(4 << 30), self.methods.values())

            def learn(agent, call, position, engine=engine):
                for meth in stateful if call.refs else ():
                    engine.generate(call, meth, GenerateOptions(SamplingConfig(max_new_tokens=1), learn=True))

            PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=learn)
        return [p.problem_id for p in warm]

    def run_workload(self, name: str, limit: int, checkpoint=None) -> None:
        wl = get_workload(name)
        for problem in wl.problems(None, limit):
            engine = Engine(self.lm, KVStore(4 << 30), self.methods.values())
            finished: list[list[int]] = []  # prompt + output ids of every call so far, in order
            saved: dict[str, list[SavedSeq]] = {fmt: [] for fmt in self.peer_formats}
            publish = engine.publish

            def record(span_id, out, *a, publish=publish, finished=finished, **kw):
                finished.append(list(out.prompt_ids) + list(out.output_ids))
                return publish(span_id, out, *a, **kw)

            engine.publish = record  # the script sees each finished call's ids; the library is unchanged

            def probe(agent, call, position, engine=engine, problem=problem, finished=finished, saved=saved):
                if not call.refs:
                    return
                if name not in self.sanity:
                    self.sanity[name] = sanity(engine, call, self.llamas, self.args.sanity_tokens)
                for fmt in self.peer_formats:  # the server slots that served the earlier calls
                    saved[fmt].extend(self.llamas[fmt].save(ids) for ids in finished[len(saved[fmt]):])
                self.rows.append(self.time_call(name, problem.problem_id, agent.name, call, engine, saved))
                r = self.rows[-1]
                print(f"{name} {problem.problem_id} {agent.name} ({r['num_prompt_tokens']} tokens): "
                      + ", ".join(f"{v} {ms:.0f}" for v, ms in r["ttft_ms"].items()) + " ms", file=sys.stderr)

            PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)
            if checkpoint is not None:
                checkpoint()

    def time_call(self, workload: str, problem_id: str, agent: str, call, engine: Engine,
                  saved: dict[str, list[SavedSeq]]) -> dict:
        reps = self.args.repeats
        times: dict[str, list[float]] = {v: [] for v in self.variants()}
        restore: dict[str, list[float]] = {}
        first: dict[str, int] = {}
        reused: dict[str, int] = {}
        computed: dict[str, float] = {}  # share of the prompt's token-layers the forward computed
        for rep in range(reps):  # interleaved: machine noise hits every variant alike
            for m, meth in self.methods.items():
                one = GenerateOptions(SamplingConfig(max_new_tokens=1), learn=rep == reps - 1)
                out = engine.generate(call, meth, one)
                times[m].append(out.stats.ttft_ms)
                first[m], reused[m] = out.output_ids[0] if out.output_ids else -1, out.stats.num_reused_tokens
                computed[m] = out.stats.num_computed_token_layers / out.stats.num_prompt_token_layers
            for fmt, llama in self.llamas.items():
                for v in self.llama_variants(fmt):
                    key = f"llama.cpp {fmt} {v}"
                    if v == "full":
                        t = llama.full(call.prompt_ids)
                    elif v == "prefix":
                        t = llama.prefix(call.prompt_ids, saved[fmt])
                    else:
                        t = llama.cache_reuse(call.prompt_ids, saved[fmt], self.args.cache_reuse_min)
                    times[key].append(t.ttft_ms)
                    restore.setdefault(key, []).append(t.restore_ms)
                    first[key], reused[key] = t.first_token, t.num_reused_tokens
        med = {v: statistics.median(t) for v, t in times.items()}
        return {"workload": workload, "problem_id": problem_id, "agent": agent,
                "num_prompt_tokens": len(call.prompt_ids), "ttft_ms": med,
                "restore_ms": {k: statistics.median(v) for k, v in restore.items() if any(v)},
                "num_reused_tokens": reused, "computed_token_layer_fraction": computed, "first_token": first}


def _median_ratio(rows: list[dict], variant: str, base_ms: list[float]) -> float:
    return statistics.median(r["ttft_ms"][variant] / b for r, b in zip(rows, base_ms, strict=True))


def summarize(rows: list[dict], formats: list[str], peer_formats: list[str]) -> dict:
    """Per workload and agent: median TTFT of every variant, the fastest llama.cpp full and peer, ratios."""
    out: dict[str, dict] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["agent"]), []).append(r)
        groups.setdefault((r["workload"], "all"), []).append(r)
    for (wl, agent), rs in groups.items():
        variants = list(rs[0]["ttft_ms"])
        fastest_full = [min(r["ttft_ms"][f"llama.cpp {f} full"] for f in formats) for r in rs]
        fastest_peer = [min([r["ttft_ms"][f"llama.cpp {f} full"] for f in formats]
                            + [r["ttft_ms"][f"llama.cpp {f} {p}"] for f in peer_formats for p in PEERS]) for r in rs]
        s = {"num_calls": len(rs), "median_prompt_tokens": statistics.median(r["num_prompt_tokens"] for r in rs),
             "median_ttft_ms": {v: statistics.median(r["ttft_ms"][v] for r in rs) for v in variants},
             "median_fastest_llamacpp_full_ms": statistics.median(fastest_full),
             "median_fastest_llamacpp_any_ms": statistics.median(fastest_peer),
             # per call, then the median: each ratio compares the same prompt
             "median_ratio_vs_fastest_llamacpp_full": {
                 v: _median_ratio(rs, v, fastest_full) for v in variants},
             "median_ratio_vs_fastest_llamacpp_any": {
                 v: _median_ratio(rs, v, fastest_peer) for v in variants},
             "fastest_full_format_counts": {f: sum(min(formats, key=lambda x: r["ttft_ms"][f"llama.cpp {x} full"]) == f
                                                   for r in rs) for f in formats},
             "first_token_agrees_with_own_full": {
                 v: statistics.mean(r["first_token"][v] == r["first_token"][
                     "full" if not v.startswith("llama.cpp") else v.rsplit(" ", 1)[0] + " full"] for r in rs)
                 for v in variants},
             "median_computed_token_layer_fraction": {
                 m: statistics.median(r["computed_token_layer_fraction"][m] for r in rs)
                 for m in rs[0].get("computed_token_layer_fraction", {})},
             "median_num_reused_tokens": {v: statistics.median(r["num_reused_tokens"][v] for r in rs)
                                          for v in variants}}
        out.setdefault(wl, {})[agent] = s
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gsm8k-chain3,copy-agents:5")
    parser.add_argument("--limit", type=int, default=12, help="gsm8k-chain3 problems")
    parser.add_argument("--copy-limit", type=int, default=1, help="copy-agents problems")
    parser.add_argument("--methods", default=",".join(PIPELINE_METHODS))
    parser.add_argument("--formats", default=",".join((SHIPPED_FORMAT, *FORMATS)))
    parser.add_argument("--gguf-dir", default=str(cache_dir() / "llamacpp-gguf"),
                        help="where the Q8_0/F16/F32 files are written (once)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ctx-tokens", type=int, default=4096)
    parser.add_argument("--peer-formats", default="F16", help="formats llama.cpp's own reuse runs on")
    parser.add_argument("--warm-problems", type=int, default=2,
                        help="unrecorded problems (after the measured ones) that warm kvcomm's anchor pools")
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--cache-reuse-min", type=int, default=16, help="the server's --cache-reuse N")
    parser.add_argument("--sanity-tokens", type=int, default=16)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install '.[bench]' (see pyproject.toml)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    bench = SideBySide(args)
    warm_ids: dict[str, list[str]] = {}

    def write() -> dict:
        result = {"env": {**environment("cpu"), "llama_cpp_python": llama_cpp.__version__,
                          "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode()},
                  "model": bench.lm.name, "config": vars(args), "warm_problem_ids": warm_ids,
                  "gguf_files": {f: str(x.path) for f, x in bench.llamas.items()}, "sanity": bench.sanity,
                  "summary": summarize(bench.rows, list(bench.llamas), bench.peer_formats), "calls": bench.rows}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result

    for name in args.workloads.split(","):
        limit = args.copy_limit if name.startswith("copy-agents") else args.limit
        warm_ids[name] = bench.warm_up(name, limit, args.warm_problems)
        bench.run_workload(name, limit, checkpoint=write)
    result = write()
    for wl, per_agent in result["summary"].items():
        s = per_agent["all"]
        print(f"{wl}: {s['num_calls']} calls, fastest llama.cpp full {s['median_fastest_llamacpp_full_ms']:.0f} ms; "
              "TTFT / fastest llama.cpp full: " + ", ".join(
                  f"{v} {x:.2f}" for v, x in s["median_ratio_vs_fastest_llamacpp_full"].items()))
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
