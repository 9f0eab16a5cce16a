"""The settings of the commands that measure: ``kvrelay bench`` (``BenchConfig``; ``BranchBenchConfig`` for its
gsm8k-branches workload), ``kvrelay demo`` (``DemoConfig``) and how ``kvrelay profile`` picks a band (``SELECTS``).

Torch-free: the CLI derives these commands' flags from them, and ``kvrelay --help`` or a mistyped flag should not
wait seconds for torch to load. The modules that run the commands import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.errors import ConfigError
from kvrelay.reuse import PIPELINE_METHODS, get_method, split_method_specs
from kvrelay.weights.aliases import DEFAULT_MODEL

SELECTS = ("search", "fidelity", "deviation")  # how build_profile picks the band (the first is the default)
REFERENCES = ("full", "prefix")  # always measured: speedups and fidelity are relative to them


@dataclass
class BenchConfig:
    workload: str = "gsm8k-chain3"
    methods: tuple[str, ...] = PIPELINE_METHODS
    limit: int = 5  # problems
    offset: int = 0  # first problem (a long run split into lanes; merge them with report.merge_results)
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    mode: str = "agent"  # agent | e2e
    data: str | None = None
    repeats: int = 3  # timed TTFT runs per method and call (median kept), interleaved across methods
    greedy_tokens: int = 32  # G of greedy_match_rate
    seed: int = 0
    store_bytes: int = 4 << 30
    store: str = field(default="memory", metadata={"help": "span store: memory, disk:PATH or redis://host:port/db "
                                                           "(a shared tier behind the memory store)"})
    # One store across the problems of the run, as a serving engine keeps its cache: every method then
    # also reuses the exact cross-request prefix (an agent's system prompt) before its own approximation.
    # Off: a fresh store per problem (method-only comparisons).
    keep_store: bool = field(default=False, metadata={
        "help": "keep one store across the problems of the run, so every method also reuses the exact "
                "cross-request prefix (off: a fresh store per problem, for method-only comparisons)"})
    # Problems run first and not recorded, so that stateful methods (KVCOMM's anchor pools) are measured
    # warm, as in a server that has been running; 0 measures them from a cold start. They are the
    # warm_problems after the measured ones (disjoint from them), or the first ones of warm_data.
    warm_problems: int = 0
    warm_data: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.methods, str):
            self.methods = split_method_specs(self.methods)
        for spec in self.methods:
            if get_method(spec).name not in PIPELINE_METHODS:  # also validates names and parameters
                raise ConfigError(f"method {spec!r} runs on the gsm8k-branches workload only")
        if self.mode not in ("agent", "e2e"):
            raise ConfigError(f"mode must be 'agent' or 'e2e', got {self.mode!r}")
        for name in ("limit", "repeats", "greedy_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.offset < 0:
            raise ConfigError(f"offset must be >= 0, got {self.offset}")
        if self.warm_problems < 0:
            raise ConfigError(f"warm_problems must be >= 0, got {self.warm_problems}")
        if self.warm_data is not None and not self.warm_problems:
            raise ConfigError("warm_data is given but warm_problems is 0")
        if self.warm_problems and not any(get_method(spec).stateful for spec in self.methods):
            # refused here, before a model loads, and not after the warm-up's data is read
            raise ConfigError(f"warm_problems={self.warm_problems} has nothing to warm: none of the methods "
                              f"{', '.join(self.methods)} keeps state across calls (kvcomm does)")
        # references first, then the requested methods in order, no duplicates
        self.methods = tuple(dict.fromkeys((*REFERENCES, *self.methods)))


@dataclass
class BranchBenchConfig:
    methods: tuple[str, ...] = ("full", "prefix", "rksc")
    limit: int = 5  # problems
    offset: int = 0  # first problem (to split a run into lanes)
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    data: str | None = None
    branches: int = 8
    branch_tokens: int = 64
    compare_budgets_mb: tuple[float, ...] = (8.0, 24.0)  # block-cache budgets for RSBCM vs LRU
    # requests in flight at once when the trace is replayed (1 = the run's own order; more: a server
    # interleaving several problems' requests, so a problem's root must survive the others' blocks)
    compare_concurrency: tuple[int, ...] = (1, 4)

    def __post_init__(self) -> None:
        if isinstance(self.methods, str):
            self.methods = split_method_specs(self.methods)
        for spec in self.methods:
            if spec not in REFERENCES and get_method(spec).name != "rksc":
                raise ConfigError(f"gsm8k-branches runs full, prefix and rksc[...], not {spec!r}")
        self.methods = tuple(dict.fromkeys((*REFERENCES, *self.methods)))
        self.compare_budgets_mb = tuple(float(b) for b in self.compare_budgets_mb)
        self.compare_concurrency = tuple(int(c) for c in self.compare_concurrency)
        if any(c < 1 for c in self.compare_concurrency):
            raise ConfigError(f"compare_concurrency must be >= 1, got {self.compare_concurrency}")
        if self.limit < 1 or self.offset < 0:
            raise ConfigError(f"limit must be >= 1 and offset >= 0, got {self.limit} and {self.offset}")
        from kvrelay.branches.prompts import BranchConfig  # here: it loads the tokenizer's stack (jinja2)

        BranchConfig(self.branches, self.branch_tokens)  # validates


# full and prefix are the references; epic is the most faithful repair per recomputed token-layer on
# SmolLM2 (docs/methods.md), relay is this project's method. naive and cacheblend add little to the
# story for their time; kvcomm learns its anchor pools online, so a few problems are all warm-up for it.
# `kvrelay bench` runs all seven (PIPELINE_METHODS).
DEMO_METHODS = ("full", "prefix", "epic", "relay")

# The demo's torch threads (its --threads default), as every BENCHMARKS.md command runs (OMP_NUM_THREADS=1): with
# one thread per op, another process on a core slows a call but does not stall every parallel region on it, so the
# methods' TTFTs stay comparable on a busy small machine; torch's default (a thread per core) swung single calls
# 0.9-10 s on a loaded 2-core VM and put every reuse method behind full.
DEMO_THREADS = 1
DEMO_THREADS_WHY = (", as in BENCHMARKS.md's runs: a core that other processes take then slows every method's calls "
                    "alike instead of stalling some of them, so the speedups stay comparable")


@dataclass
class DemoConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "model: an alias, a .gguf file, a Hugging Face folder or random:<preset>"})
    # 2 problems: the second one shows what a kept store buys (the agents' system prompts are reused
    # exactly); more problems tighten the medians, not the story.
    problems: int = field(default=2, metadata={"help": "GSM8K problems to run (>= 1)"})
    methods: tuple[str, ...] = field(default=DEMO_METHODS, metadata={
        "help": "comma-separated reuse method specs, each NAME or NAME[k=v,...] (full and prefix always run)"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    # 3, as kvrelay bench: one timed run per call let a single stalled prefill on a busy machine decide a method's
    # row; the two extra runs are 1-token prefills, a small share of the demo's time beside the reference pipeline.
    repeats: int = field(default=3, metadata={"help": "timed runs per method and call, interleaved across methods, "
                                                      "median kept (>= 1)"})
    greedy_tokens: int = field(default=16, metadata={
        "help": "G of greedy@G: tokens each method decodes greedily to compare with full (>= 1)"})
    # The reference pipeline decodes every agent's output with `full`: half the run at the workload's
    # 128/96/32 tokens. A cap of 64 keeps the solver's and critic's outputs (the spans downstream calls
    # reuse) long enough to dominate the downstream prompts.
    max_new_tokens: int = field(default=64, metadata={
        "help": "cap on each agent's output tokens (kvrelay bench uses the workload's own: 128/96/32)"})
    keep_store: bool = field(default=True, metadata={
        "help": "keep one store across the problems, as a server keeps its cache (the agents' system "
                "prompts are then reused exactly from the second problem on)"})
    data: str | None = field(default=None, metadata={
        "help": "GSM8K JSON-lines file (default: gsm8k/test_dev.jsonl under $KVRELAY_DATA, else ../shared/data)"})
    out: str = field(default="kvrelay-demo", metadata={"help": "folder for the JSON and the plots (created)"})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:  # the others are checked by BenchConfig
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def bench_config(self) -> BenchConfig:
        return BenchConfig(workload="gsm8k-chain3", methods=self.methods, limit=self.problems, model=self.model,
                           device=self.device, repeats=self.repeats, greedy_tokens=self.greedy_tokens,
                           keep_store=self.keep_store, data=self.data)
