"""``kvrelay demo``: the main job on the default model.

``gsm8k-chain3`` (solver -> critic -> finalizer) on a few GSM8K problems, every method side by side
on the same downstream calls: TTFT, speedups, reuse, fidelity against ``full``; plots written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.eval.harness import Bench, BenchConfig
from kvrelay.eval.plots import write_plots
from kvrelay.eval.report import format_by_agent, format_table
from kvrelay.reuse import PIPELINE_METHODS
from kvrelay.weights.loader import DEFAULT_MODEL


@dataclass
class DemoConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "model: an alias, a .gguf file, a Hugging Face folder or random:<preset>"})
    problems: int = field(default=5, metadata={"help": "GSM8K problems to run (>= 1)"})
    # kvcomm learns its anchor pools online: 5 problems are all warm-up for it (every call a dense
    # prefill), so the demo leaves it to `kvrelay bench --methods kvcomm` on 50+ problems.
    methods: tuple[str, ...] = field(default=tuple(m for m in PIPELINE_METHODS if m != "kvcomm"), metadata={
        "help": "comma-separated reuse method specs, each NAME or NAME[k=v,...]"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    repeats: int = field(default=2, metadata={"help": "timed runs per method and call, median kept (>= 1)"})
    data: str | None = field(default=None, metadata={
        "help": "GSM8K JSON-lines file (default: ../shared/data/gsm8k/test_dev.jsonl)"})
    out: str = field(default="kvrelay-demo", metadata={"help": "folder for the JSON and the plots (created)"})


def run_demo(cfg: DemoConfig, out=sys.stdout) -> dict:
    bench = Bench(BenchConfig(workload="gsm8k-chain3", methods=cfg.methods, limit=cfg.problems, model=cfg.model,
                              device=cfg.device, repeats=cfg.repeats, data=cfg.data))
    result = bench.run()
    print(f"\ngsm8k-chain3 (solver -> critic -> finalizer), {result['n']} problems, model {result['model']} on "
          f"{cfg.device}; {len(result['calls']) // len(result['results'])} downstream calls per method, each "
          "method on the same prompt ids; fidelity against full.\n", file=out)
    print(format_table(result["results"], result["fidelity_meaningful"]), file=out)
    print("\n" + format_by_agent(result["results"]), file=out)
    folder = Path(cfg.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    plots = write_plots(result, folder)
    print(f"\nwrote {folder / 'demo.json'} and plots: {', '.join(str(p) for p in plots)}", file=out)
    return result
