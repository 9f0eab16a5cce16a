"""Any-offset matcher lookup time against the prefill it saves (no torch for the lookups).

    python benchmarks/matcher_lookup.py [--json benchmarks/results/matcher-lookup-cpu.json] [--gc-probe-spans 10000]

Stored spans are 512 tokens each, 10 / 1,000 / 10,000 of them (added in steps, one index per text kind):
- random: uniform ids; the prompt is 256-token chunks, each copied from a stored span at a random
  offset (3 in 4) or fresh;
- natural: GSM8K train problems (question + answer) tokenized with SmolLM2's tokenizer, spans are
  windows at random offsets of that stream (they overlap: many spans hold the same blocks, at
  different alignments); the prompt is chunks copied from spans (3 in 4) or fresh GSM8K test text;
- repeated: natural spans, one in 100 also holding a run of 16-512 copies of one token (a table
  rule, padding); the prompt is that token repeated (the matcher's worst case before issue 54);
- periodic: the same with a 6-token phrase (a markdown table's rule line, ``| --- | --- |`` and a newline):
  one span in 100 holds a run of 16-512 tokens of it, from any of its tokens; the prompt repeats the line;
- ruled: natural spans, one in 10 also holding a line of 32-100 copies of one token ended by a newline (then its
  own text goes on); the prompt is lines of 40 such tokens, a newline and 24 tokens of natural text (a table of
  rule lines: each stored line that ends as long as a prompt line's stretch goes on past its newline);
- shared: every span opens with one system prompt (300 GSM8K test tokens) and goes on with its own natural text
  (every stored call of an agent); the prompt opens with that system prompt and goes on as a natural one (its
  chunks copied from spans start inside the system prompt, so the prompt holds it, or its tail, again and again).
  Every occurrence meets groups whose members are all the spans (visited by class, see ``index_splits``).

Lookup = ``TokenIndex.find`` as the server calls it (block 16, ``min_tokens`` 16, ``prefer="oldest"``),
one fresh prompt per sample: p50 and p99 (nearest rank) over the samples (up to 30 / 15 / 10 / 5 by
prompt length, fewer once a cell has run ``--cell-s``; longer prompts are skipped after a p50 over
``--max-p50-s``). Beside the wall-clock times, the lookup's own CPU time (``time.thread_time``) and the load
average: on a shared machine a wall-clock p99 over a few samples measures the neighbours too. And the garbage
collector's pauses: the full collections that ran inside lookups (how many, the longest), and per index size the
objects it tracks and a ``gc.collect()`` (median of 3), once the spans are stored. What was loaded before the
lookups (modules, tokenizer, GSM8K text) is frozen out of its sight first, as ``kvrelay serve`` does.
``--gc-probe-spans N`` first stores N random spans of ``--gc-probe-tokens`` in an index alone and records the
tracked objects it adds per span and a ``gc.collect()`` then.
Saved prefill = tokens matched x SmolLM2-135M's prefill time per token, measured here on a 1,024-token
prompt (median of 3 after a warmup; the per-token time grows with context, so this underestimates the
saving at 4K-32K).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import time

from kvrelay.data.datasets import data_root
from kvrelay.server.index import TokenIndex

SPAN_TOKENS = 512
CHUNK_TOKENS = 256
SPAN_COUNTS = (10, 1000, 10000)
PROMPT_TOKENS = (1024, 4096, 8192, 32768)
SAMPLES = {1024: 30, 4096: 15, 8192: 10, 32768: 5}
VOCAB = 49152
SYSTEM_TOKENS = 300
KINDS = ("random", "natural", "repeated", "periodic", "ruled", "shared")
RULED_LINE_TOKENS = 40  # a prompt line's rule tokens (then its newline and RULED_TEXT_TOKENS of text)
RULED_TEXT_TOKENS = 24
RULE_LINE = "| --- | --- |\n"


def gsm8k_ids(tokenizer, name: str, max_tokens: int) -> list[int]:
    ids: list[int] = []
    with open(data_root() / "gsm8k" / name) as f:
        for line in f:
            row = json.loads(line)
            ids += tokenizer.encode(row["question"] + "\n" + row["answer"] + "\n\n")
            if len(ids) >= max_tokens:
                break
    return ids


class Kind:
    """A text kind: how spans and prompts are made."""

    def __init__(self, name: str, rng: random.Random, train: list[int], test: list[int], rule: list[int]) -> None:
        self.name, self.rng, self.train, self.test = name, rng, train, test
        self.rule = rule  # what repeated text repeats: one token, or a line of several
        self.spans: list[tuple[int, ...]] = []
        self.system = test[-SYSTEM_TOKENS:] if name == "shared" else []  # no prompt's fresh chunk holds it

    def span(self) -> list[int]:
        rng = self.rng
        if self.name == "random":
            return [rng.randrange(VOCAB) for _ in range(SPAN_TOKENS)]
        at = rng.randrange(len(self.train) - SPAN_TOKENS)
        ids = self.system + self.train[at:at + SPAN_TOKENS - len(self.system)]
        if self.name in ("repeated", "periodic") and rng.random() < 0.01:
            n = rng.randint(16, SPAN_TOKENS)
            at = rng.randrange(SPAN_TOKENS - n + 1)
            phase = rng.randrange(len(self.rule))
            ids[at:at + n] = [self.rule[(phase + k) % len(self.rule)] for k in range(n)]
        if self.name == "ruled" and rng.random() < 0.1:
            n = rng.randint(32, 100)
            at = rng.randrange(SPAN_TOKENS - n)
            ids[at:at + n + 1] = [self.rule[0]] * n + [self.rule[1]]
        return ids

    def prompt(self, num_tokens: int) -> list[int]:
        rng = self.rng
        if self.name in ("repeated", "periodic"):
            return [self.rule[k % len(self.rule)] for k in range(num_tokens)]
        if self.name == "ruled":
            out = []
            while len(out) < num_tokens:
                at = rng.randrange(len(self.test) - RULED_TEXT_TOKENS)
                out += [self.rule[0]] * RULED_LINE_TOKENS + [self.rule[1]] + self.test[at:at + RULED_TEXT_TOKENS]
            return out[:num_tokens]
        out: list[int] = list(self.system)
        while len(out) < num_tokens:
            if rng.random() < 0.75:
                src = rng.choice(self.spans)
                at = rng.randrange(SPAN_TOKENS - CHUNK_TOKENS + 1)
                out += src[at:at + CHUNK_TOKENS]
            elif self.name == "random":
                out += [rng.randrange(VOCAB) for _ in range(CHUNK_TOKENS)]
            else:
                at = rng.randrange(len(self.test) - len(self.system) - CHUNK_TOKENS)
                out += self.test[at:at + CHUNK_TOKENS]
        return out[:num_tokens]


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


class GcWatch:
    """The garbage collector's collections, as ``gc.callbacks`` reports them: (generation, ms)."""

    def __init__(self) -> None:
        self.done: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.done.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))


def collect_ms() -> float:
    """A full collection's time, median of 3."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 1)


def gc_probe(num_spans: int, span_tokens: int) -> dict:
    """Tracked objects an index of ``num_spans`` random spans adds, per span, and a full collection then."""
    rng = random.Random(1)
    gc.collect()
    before, before_ms = len(gc.get_objects()), collect_ms()
    index = TokenIndex(block_len=16)
    for k in range(num_spans):
        index.add(f"p{k}", [rng.randrange(VOCAB) for _ in range(span_tokens)])
    gc.collect()
    out = {"num_spans": num_spans, "span_tokens": span_tokens,
           "tracked_objects_per_span": round((len(gc.get_objects()) - before) / num_spans, 2),
           "gc_collect_ms_without_index": before_ms, "gc_collect_ms_with_index": collect_ms()}
    del index
    gc.collect()
    return out


def prefill_ms_per_token(ids: list[int], num_tokens: int) -> float:
    import torch

    from kvrelay.cache.kv import SequenceKV
    from kvrelay.weights.loader import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    lm = load_model("smollm2-135m", progress=False)
    prompt = torch.tensor(ids[:num_tokens])
    times = []
    for k in range(4):
        t0 = time.perf_counter()
        lm.model.prefill(prompt, SequenceKV(lm.config, lm.dtype, "cpu", capacity=num_tokens))
        if k:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) / num_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", default=",".join(map(str, PROMPT_TOKENS)))
    parser.add_argument("--span-counts", default=",".join(map(str, SPAN_COUNTS)))
    parser.add_argument("--cell-s", type=float, default=10.0, help="stop sampling a cell after it")
    parser.add_argument("--max-p50-s", type=float, default=3.0, help="skip longer prompts once a lookup p50 is over")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--gc-probe-spans", type=int, default=0)
    parser.add_argument("--gc-probe-tokens", type=int, default=1024)
    args = parser.parse_args()
    probe = gc_probe(args.gc_probe_spans, args.gc_probe_tokens) if args.gc_probe_spans else None
    if probe:
        print(f"gc probe: {probe}", flush=True)
    from kvrelay.weights.loader import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    t0 = time.perf_counter()
    train = gsm8k_ids(tokenizer, "train.jsonl", 400_000)
    test = gsm8k_ids(tokenizer, "test_dev.jsonl", 100_000)
    rules = {"periodic": tokenizer.encode(RULE_LINE), "repeated": tokenizer.encode("=====")[:1],
             "ruled": tokenizer.encode("=====")[:1] + tokenizer.encode("\n")[-1:]}
    print(f"tokenized {len(train)} + {len(test)} GSM8K tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    ms_per_token = prefill_ms_per_token(train, args.prefill_tokens)
    print(f"SmolLM2-135M prefill: {ms_per_token:.3f} ms/token at {args.prefill_tokens} tokens", flush=True)

    # as ``kvrelay serve`` does once loaded: the modules, tokenizer and text stay out of the collector's sight,
    # so what a collection walks from here on is what the index (and this script's spans) added
    gc.collect()
    gc.freeze()
    load_at_start = round(os.getloadavg()[0], 1)
    rows = []
    watch = GcWatch()
    for name in args.kinds.split(","):
        kind = Kind(name, random.Random(0), train, test, rules.get(name, []))
        index = TokenIndex(block_len=16)
        for num_spans in map(int, args.span_counts.split(",")):
            t0, before = time.perf_counter(), len(kind.spans)
            while len(kind.spans) < num_spans:
                # a tuple of ints leaves the collector's sight (a list of 512 would be walked at each collection:
                # 5M references at 10,000 spans, this script's own copy, not the index)
                kind.spans.append(tuple(kind.span()))
                index.add(f"s{len(kind.spans)}", kind.spans[-1])
            add_ms = (time.perf_counter() - t0) * 1e3
            gc.collect()
            tracked, gc_ms = len(gc.get_objects()), collect_ms()
            print(f"{name:8s} spans {num_spans:6d}: {tracked} objects tracked, gc.collect {gc_ms} ms", flush=True)
            slow = False
            for num_tokens in map(int, args.prompt_tokens.split(",")):
                if slow:  # the previous size was over the budget: a longer prompt would be too
                    rows.append({"text": name, "num_spans": num_spans, "prompt_tokens": num_tokens,
                                 "skipped": f"a shorter prompt's lookup p50 was over {args.max_p50_s} s"})
                    print(f"{name:8s} spans {num_spans:6d} prompt {num_tokens:6d}: skipped", flush=True)
                    continue
                times, cpu_times, matched, work, full_gc_ms = [], [], [], [], []
                cell_t0 = time.perf_counter()
                for k in range(SAMPLES.get(num_tokens, 5)):
                    if k >= 2 and time.perf_counter() - cell_t0 > args.cell_s:
                        break
                    q = kind.prompt(num_tokens)
                    watch.done.clear()
                    t0, cpu_t0 = time.perf_counter(), time.thread_time()
                    found = index.find(q, min_tokens=16, prefer="oldest")
                    times.append((time.perf_counter() - t0) * 1e3)
                    cpu_times.append((time.thread_time() - cpu_t0) * 1e3)
                    full_gc_ms += [ms for generation, ms in watch.done if generation == 2]
                    matched.append(sum(m.num_tokens for m in found))
                    work.append(index.last_work / num_tokens)
                p50, p99 = statistics.median(times), percentile(times, 99)
                slow = p50 > args.max_p50_s * 1e3
                saved_ms = statistics.median(matched) * ms_per_token
                row = {"text": name, "num_spans": num_spans, "prompt_tokens": num_tokens, "samples": len(times),
                       "lookup_ms_p50": round(p50, 2), "lookup_ms_p99": round(p99, 2),
                       "lookup_ms_max": round(max(times), 2),
                       "matched_tokens_median": statistics.median(matched),
                       "saved_prefill_ms": round(saved_ms, 1),
                       "p99_over_saved_prefill": round(p99 / saved_ms, 4) if saved_ms else None,
                       "p99_over_prompt_prefill": round(p99 / (num_tokens * ms_per_token), 4),
                       "cpu_p99_over_saved_prefill":
                           round(percentile(cpu_times, 99) / saved_ms, 4) if saved_ms else None,
                       "lookup_cpu_ms_p50": round(statistics.median(cpu_times), 2),
                       "lookup_cpu_ms_p99": round(percentile(cpu_times, 99), 2),
                       "work_per_token_max": round(max(work), 1),
                       "full_gcs_in_lookups": len(full_gc_ms),
                       "full_gc_ms_max": round(max(full_gc_ms), 1) if full_gc_ms else None,
                       "gc_tracked_objects": tracked, "gc_collect_ms": gc_ms,
                       "load_avg_1m": round(os.getloadavg()[0], 1),
                       "add_ms_per_span": round(add_ms / (num_spans - before), 3)}
                rows.append(row)
                print(f"{name:8s} spans {num_spans:6d} prompt {num_tokens:6d}: lookup p50 {p50:8.1f} p99 {p99:8.1f} ms,"
                      f" (cpu p99 {row['lookup_cpu_ms_p99']:8.1f}), matched {row['matched_tokens_median']:7.0f},"
                      f" p99/saved {row['p99_over_saved_prefill']}, max {row['lookup_ms_max']:.1f} ms,"
                      f" full gcs {len(full_gc_ms)} (max {row['full_gc_ms_max']} ms), load {row['load_avg_1m']}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()} {platform.processor()}".strip(),
                       "python": platform.python_version(), "span_tokens": SPAN_TOKENS,
                       "prefill": {"model": "smollm2-135m", "prompt_tokens": args.prefill_tokens,
                                   "ms_per_token": round(ms_per_token, 4),
                                   "how": "model.prefill of GSM8K tokens, median of 3 after a warmup"},
                       "lookup": "TokenIndex.find, block 16, min_tokens 16, prefer oldest; one fresh prompt per sample",
                       "load_avg_1m_at_start": load_at_start,
                       "load_avg_1m_at_end": round(os.getloadavg()[0], 1),
                       "gc_probe": probe,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
