"""What keeping stored spans off glibc's heap costs: spans in their own mapping vs a fixed mmap threshold.

    python benchmarks/span_pages_cost.py --rounds 2 --json benchmarks/results/span-pages-cost-cpu.json

Each round starts one fresh process per setting, in turn (glibc's mmap threshold cannot be set back to dynamic):

- ``own_pages``: the product (``cache.span_pages``: a span's tensors in one anonymous mapping of their own);
- ``heap_spans``: ``SequenceKV.export`` as it was, K and V cloned on the heap and hidden states kept as given;
- ``mmap_threshold``: own pages plus ``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, what ``MALLOC_MMAP_THRESHOLD_=131072``
  sets: every allocation of 128 KiB or more, activations included, gets a mapping of its own.

It times, in thread CPU time with one torch thread (so other load on the machine counts little), a 512-token
prefill and ``Engine.publish`` of calls of 150-500 tokens plus 8 new ones; medians per process, then the median over
rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("own_pages", "heap_spans", "mmap_threshold")
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 << 10
NUM_PREFILLS = 5
NUM_CALLS = 12


def measure(setting: str, model: str) -> dict:
    import torch

    torch.set_num_threads(1)  # ops run on this thread: its CPU time holds their compute and page faults
    import kvrelay.cache.kv as kv
    from kvrelay.cache.kv import SequenceKV
    from kvrelay.cache.store import KVStore
    from kvrelay.engine import Engine, GenerateOptions
    from kvrelay.model.sampling import SamplingConfig
    from kvrelay.weights.loader import load_model

    if setting == "mmap_threshold":
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
            raise RuntimeError("mallopt refused M_MMAP_THRESHOLD")
    elif setting == "heap_spans":
        kv.copies_in_own_pages = lambda ts: [t.clone() if i < 2 else t for i, t in enumerate(ts)]
    lm = load_model(model)
    ids = torch.randint(0, 20000, (600,), generator=torch.Generator().manual_seed(0))

    def prefill_ms() -> float:
        t0 = time.thread_time()
        lm.model.prefill(ids[:512], SequenceKV(lm.config, lm.dtype, "cpu", capacity=512))
        return (time.thread_time() - t0) * 1e3

    engine = Engine(lm, KVStore(64 << 20), methods=("full",))  # a small store: later calls evict earlier spans
    publish_ms = []
    prefill_ms()
    for i in range(NUM_CALLS + 2):
        out = engine.generate(ids[i * 7 : 150 + i * 31].tolist(), "full",
                              GenerateOptions(SamplingConfig(max_new_tokens=8), keep_cache=True))
        t0 = time.thread_time()
        engine.publish(f"s{i}", out)
        if i >= 2:  # the first two warm up
            publish_ms.append((time.thread_time() - t0) * 1e3)
    return {"prefill512_cpu_ms": statistics.median(prefill_ms() for _ in range(NUM_PREFILLS)),
            "publish_cpu_ms": statistics.median(publish_ms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a child process: measure one setting
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.model)))
        return 0
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            out = subprocess.run([sys.executable, __file__, "--one", setting, "--model", args.model],
                                 capture_output=True, text=True, check=True, cwd=REPO)
            runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(setting, runs[setting][-1], flush=True)
    summary = {s: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for s, rs in runs.items()}
    from kvrelay.eval.harness import environment

    result = {"env": environment("cpu"), "model": args.model, "rounds": args.rounds, "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
