"""Per-token cost of a grammar mask on CPU: xgrammar vs llguidance vs outlines-core, on our tokenizers.

For each model's tokenizer (SmolLM2-135M: 49K tokens, Gemma 3 270M: 262K) and each library: the time to set
the library up for the tokenizer, to compile a tool-call arguments schema (nested object, enum, array,
required keys), and per decode step the time to compute the next-token mask, to apply it to a [vocab] fp32
logits row (kvrelay's apply, the same for all three: they fill the same int32 bitmask; the
libraries' own apply kernels are timed too where they have one), and to advance the grammar by the
token taken. The tokens walked are our tokenizer's ids of a valid arguments object, so every library
sees the same steps. Then the model's own decode step (batch 1) so the mask's cost reads as a fraction
of a step.

    python benchmarks/grammar_mask.py --json benchmarks/results/grammar-mask-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvrelay.engine.engine import Engine, GenerateOptions
from kvrelay.eval.harness import environment
from kvrelay.model.sampling import SamplingConfig
from kvrelay.server.grammar import apply_bitmask
from kvrelay.weights.loader import load_model, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"]},
    },
    "required": ["city", "unit"],
}
TEXT = '{"city": "Paris", "unit": "celsius", "days": 3, "tags": ["rain", "wind"], "where": {"lat": 48.85, "lon": 2.35}}'


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, byte_level: bool) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        size = tokenizer.vocab_size
        vocab = [tokenizer.backend.id_to_token(i) for i in range(size)]
        kind = xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.BYTE_FALLBACK
        info = xgr.TokenizerInfo(vocab, kind, vocab_size=size, stop_token_ids=sorted(tokenizer.stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.bitmask = xgr.allocate_token_bitmask(1, size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def own_apply(self, logits: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)

    def advance(self, matcher, token_id: int) -> None:
        assert matcher.accept_token(token_id), token_id


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, byte_level: bool) -> None:
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        eos = tokenizer.token_to_id(tokenizer.eos_token)
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
        self.bitmask = llt.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, schema: dict):
        spec = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                         "key_separator": ": "}}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(spec)
        self.llg.LLMatcher(self.tok, grammar)  # the first matcher does the grammar's own setup
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def mask(self, matcher) -> None:
        self.llt.fill_next_token_bitmask(matcher, self.bitmask, 0)

    def own_apply(self, logits: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, self.bitmask)

    def advance(self, matcher, token_id: int) -> None:
        assert matcher.consume_token(token_id), (token_id, matcher.get_error())


class _OutlinesCore:
    """Regex-only: a JSON schema becomes a regex, indexed over the whole vocabulary at compile time."""

    name = "outlines-core"

    def __init__(self, tokenizer, byte_level: bool) -> None:
        import outlines_core
        import outlines_core.json_schema as ocj

        self.oc, self.ocj = outlines_core, ocj
        eos = tokenizer.token_to_id(tokenizer.eos_token)
        by_text: dict[bytes, list[int]] = {}
        special = set(tokenizer.backend.get_added_tokens_decoder())
        for i in range(tokenizer.vocab_size):
            if i in special or i == eos:
                continue
            piece = tokenizer.backend.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass")
            if piece and b"\xef\xbf\xbd" not in piece:  # partial characters: left out (a simplification)
                by_text.setdefault(piece, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_text)
        self.size = tokenizer.vocab_size
        self.bitmask = torch.zeros(1, (self.size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        regex = self.ocj.build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, matcher) -> None:
        matcher.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), self.bitmask.element_size())

    def advance(self, matcher, token_id: int) -> None:
        matcher.advance(token_id)


LIBRARIES = {"xgrammar": _Xgrammar, "llguidance": _Llguidance, "outlines-core": _OutlinesCore}


def bench_library(cls, tokenizer, byte_level: bool, text: str, repeats: int) -> dict:
    setup_ms, lib = _timed(lambda: cls(tokenizer, byte_level))
    compile_ms, compiled = _timed(lambda: lib.compile(SCHEMA))
    ids = tokenizer.encode(text)
    mask_us, apply_us, advance_us, own_apply_us = [], [], [], []
    logits = torch.randn(tokenizer.vocab_size)
    size = tokenizer.vocab_size
    for _ in range(repeats):
        matcher = lib.matcher(compiled)
        for token_id in ids:
            t0 = time.perf_counter()
            lib.mask(matcher)
            t1 = time.perf_counter()
            row = apply_bitmask(logits, lib.bitmask[0], size)
            apply_us.append((time.perf_counter() - t1) * 1e6)
            assert torch.isfinite(row[token_id]), f"{lib.name} masked out the valid token {token_id}"
            if hasattr(lib, "own_apply"):
                own = logits.clone()
                t_own = time.perf_counter()
                lib.own_apply(own)
                own_apply_us.append((time.perf_counter() - t_own) * 1e6)
                assert torch.equal(own, row), f"{lib.name}'s own apply disagrees with kvrelay's"
            t2 = time.perf_counter()
            lib.advance(matcher, token_id)
            t3 = time.perf_counter()
            mask_us.append((t1 - t0) * 1e6)
            advance_us.append((t3 - t2) * 1e6)
    total = [a + b + c for a, b, c in zip(mask_us, apply_us, advance_us, strict=True)]
    return {"setup_ms": setup_ms, "compile_ms": compile_ms, "num_steps": len(total),
            "median_mask_us": statistics.median(mask_us), "median_apply_us": statistics.median(apply_us),
            "median_advance_us": statistics.median(advance_us), "median_step_us": statistics.median(total),
            "p90_step_us": sorted(total)[int(0.9 * (len(total) - 1))],
            "median_own_apply_us": statistics.median(own_apply_us) if own_apply_us else None}


def decode_step_ms(ref: str, num_tokens: int) -> float:
    """Median ms of one decode step of the model at batch 1 (``Engine.step``, sampled at temperature 1 so the
    sequence runs its ``num_tokens`` steps; the first steps are a warm-up)."""
    engine = Engine(load_model(ref, progress=False))
    prompt = engine.lm.tokenizer.encode("Write a long story about a lighthouse keeper and the sea. " * 4)
    times_ms = []
    while len(times_ms) < num_tokens:
        seq = engine.start(prompt, options=GenerateOptions(SamplingConfig(num_tokens + 8, 1.0, seed=len(times_ms))))
        while not seq.done:
            t0 = time.perf_counter()
            engine.step([seq])
            times_ms.append((time.perf_counter() - t0) * 1e3)
        engine.finish(seq)
    return statistics.median(times_ms[4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per model (0: skip)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {"command": "python benchmarks/grammar_mask.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
        "environment": environment("cpu"), "schema": SCHEMA, "text": TEXT, "torch_threads": 1, "models": {}}
    for ref in args.models.split(","):
        tokenizer = load_tokenizer(ref)
        byte_level = "smollm" in ref
        entry: dict = {"vocab_size": tokenizer.vocab_size, "libraries": {}}
        for name in args.libraries.split(","):
            try:
                entry["libraries"][name] = result = bench_library(LIBRARIES[name], tokenizer, byte_level, TEXT,
                                                                  args.repeats)
                print(f"{ref} {name}: step {result['median_step_us']:.1f} us (mask {result['median_mask_us']:.1f}, "
                      f"apply {result['median_apply_us']:.1f}, advance {result['median_advance_us']:.1f}); "
                      f"compile {result['compile_ms']:.0f} ms, setup {result['setup_ms']:.0f} ms", flush=True)
            except Exception as exc:  # noqa: BLE001 - a library that cannot run this case is reported, not fatal
                entry["libraries"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{ref} {name}: error {exc}", flush=True)
        if args.decode_tokens:
            step_ms = decode_step_ms(ref, args.decode_tokens)
            entry["decode_step_ms"] = step_ms
            for result in entry["libraries"].values():
                if "median_step_us" in result:
                    result["fraction_of_decode_step"] = result["median_step_us"] / 1e3 / step_ms
            print(f"{ref}: decode step {step_ms:.1f} ms", flush=True)
        report["models"][ref] = entry
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
