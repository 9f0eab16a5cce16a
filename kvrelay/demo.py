"""``kvrelay demo``: the main job on the default model. ``make demo`` runs it from a fresh clone,
install included, and it prints where that time went.

``gsm8k-chain3`` (solver -> critic -> finalizer) on a few GSM8K problems: ``full``, ``prefix`` and the
best repair methods side by side on the same downstream calls: TTFT by agent, speedups, reuse,
fidelity against ``full``; plots written; then where the time went. ``kvrelay bench`` runs every method.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from kvrelay.engine import Engine
from kvrelay.errors import ConfigError
from kvrelay.eval.configs import DEMO_METHODS, DemoConfig  # noqa: F401 (DEMO_METHODS: its import path before configs)
from kvrelay.eval.harness import Bench
from kvrelay.eval.plots import write_plots
from kvrelay.eval.report import format_by_agent, format_table, format_time_split
from kvrelay.pipeline.workloads import Workload
from kvrelay.reuse import PIPELINE_METHODS
from kvrelay.weights.loader import cache_dir

# Environment variables the Makefile sets: when `make` started and when the venv install finished
# (epoch seconds), so that the time table can include the install, which happens outside Python.
MAKE_START_ENV = "KVRELAY_MAKE_START"
INSTALLED_AT_ENV = "KVRELAY_INSTALLED_AT"


class _Clock:
    """Seconds spent per stage of the run, and the progress bar over every generate call (``demo_calls``)."""

    REFERENCE = "reference pipeline (full, every agent's output)"

    def __init__(self, bar: tqdm, labels: dict[int, str]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bar, self.labels = bar, labels  # id(method object) -> its spec
        self.probing = False  # inside a downstream call's comparison of the methods

    def label(self, method) -> str:
        if not self.probing:
            return self.REFERENCE
        return f"method {self.labels.get(id(method), str(method))}"


class _TimedEngine(Engine):
    """An Engine that charges each generate call to the clock (a method, or the reference pipeline)."""

    clock: _Clock

    def generate(self, call, method="full", options=None):
        label = self.clock.label(method)
        self.clock.bar.set_postfix_str(label.removeprefix("method "), refresh=True)
        t0 = time.perf_counter()
        out = super().generate(call, method, options)
        self.clock.seconds[label] += time.perf_counter() - t0
        self.clock.bar.update(1)  # one call of the reference pipeline or of a method
        return out


def demo_calls(workload: Workload, problems: int, num_methods: int, repeats: int) -> int:
    """The generate calls a demo run makes, which its bar counts: every agent's call of the reference pipeline and,
    on each downstream call (one with something to reuse: an upstream output, or a task input an earlier agent's
    prompt holds), each method's greedy fidelity run and its ``repeats`` timed runs. Counting only the agents
    would leave the bar still for minutes while the methods run."""
    spec = workload.spec
    seen: set[str] = set()  # upstream agents and the inputs their prompts hold
    downstream = 0
    for name in spec.order:
        refs = set(spec.agent(name).refs())
        downstream += bool(refs & seen)
        seen |= refs | {name}
    return problems * (len(spec.agents) + downstream * num_methods * (1 + repeats))


def capped(workload: Workload, max_new_tokens: int) -> Workload:
    """``workload`` with each agent's output capped at ``max_new_tokens``."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    agents = tuple(replace(a, max_new_tokens=min(a.max_new_tokens, max_new_tokens)) for a in workload.spec.agents)
    return replace(workload, spec=replace(workload.spec, agents=agents))


class _DemoBench(Bench):
    clock: _Clock

    def _engine(self, store):
        engine = _TimedEngine(self.lm, store, self.methods.values())
        engine.clock = self.clock
        return engine

    def _probe_call(self, problem_id, agent, position, call, engine):
        seconds = self.clock.seconds
        methods_before = sum(s for k, s in seconds.items() if k.startswith("method "))
        self.clock.probing = True
        t0 = time.perf_counter()
        try:
            return super()._probe_call(problem_id, agent, position, call, engine)
        finally:
            self.clock.probing = False
            spent = time.perf_counter() - t0
            methods_s = sum(s for k, s in seconds.items() if k.startswith("method ")) - methods_before
            # what the methods did not take: the ideal prefill and the fidelity arithmetic
            seconds["ideal prefill + fidelity"] += spent - methods_s


def _num_converted() -> int:
    models = cache_dir() / "models"
    return len(list(models.iterdir())) if models.is_dir() else 0


def _make_stages(now_epoch_s: float) -> list[tuple[str, float]]:
    """Under `make demo`: the install (when this `make` run did one) and Python's start up to the demo
    (interpreter, imports: their first run also compiles the modules), from the Makefile's timestamps."""
    try:
        start, installed = float(os.environ[MAKE_START_ENV]), float(os.environ[INSTALLED_AT_ENV])
    except (KeyError, ValueError):
        return []
    if installed < start:  # installed by an earlier `make`
        return [("python start + imports", now_epoch_s - start)]
    return [("install (make: venv + pip)", installed - start), ("python start + imports", now_epoch_s - installed)]


def run_demo(cfg: DemoConfig, out=sys.stdout) -> dict:
    make_stages = _make_stages(time.time())
    t_start = time.perf_counter()
    converted_before = _num_converted()
    bench_cfg = cfg.bench_config()
    bench = _DemoBench(bench_cfg)
    bench.workload = capped(bench.workload, cfg.max_new_tokens)
    load_s = time.perf_counter() - t_start
    load_label = "model conversion (once) + load" if _num_converted() > converted_before else "model load"
    num_agents = len(bench.workload.spec.agents)
    total = demo_calls(bench.workload, cfg.problems, len(bench.methods), bench_cfg.repeats)
    with tqdm(total=total, desc=f"demo: {cfg.problems} problems x {num_agents} agents, {len(bench.methods)} methods",
              unit="call", file=sys.stderr) as bar:
        bench.clock = _Clock(bar, {id(m): spec for spec, m in bench.methods.items()})
        result = bench.run(progress=False)
    threads = torch.get_num_threads()
    print(f"\ngsm8k-chain3 (solver -> critic -> finalizer), {result['n']} problems, model {result['model']} on "
          f"{cfg.device}; {len(result['calls']) // len(result['results'])} downstream calls per method, each "
          f"method on the same prompt ids; agent outputs capped at {cfg.max_new_tokens} tokens; fidelity against "
          f"full (greedy@G: G = {cfg.greedy_tokens}); "
          f"{'one store kept across problems' if cfg.keep_store else 'a fresh store per problem'}.\n"
          f"TTFTs are timings on this machine ({threads} torch thread{'s' * (threads != 1)}): noisy while other "
          "processes keep it busy.\n", file=out)
    print(format_table(result["results"], result["fidelity_meaningful"]), file=out)
    print("\n" + format_by_agent(result["results"]), file=out)
    folder = Path(cfg.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    plots = write_plots(result, folder)
    print(f"\nwrote {folder / 'demo.json'} and plots: {', '.join(str(p) for p in plots)}", file=out)
    stages = [*make_stages, (load_label, load_s)]
    stages += sorted(bench.clock.seconds.items(), key=lambda kv: -kv[1])
    stages.append(("other (data, reports, plots)", time.perf_counter() - t_start - load_s - sum(
        bench.clock.seconds.values())))
    print("\n" + format_time_split(stages), file=out)
    if MAKE_START_ENV in os.environ:
        total_s = time.time() - float(os.environ[MAKE_START_ENV])
        print(f"make demo, start to end: {total_s:.0f} s.", file=out)
    print(f"Every method ({len(PIPELINE_METHODS)}) on more problems: kvrelay bench, with a fresh store per problem "
          f"unless --keep-store{' (the demo keeps one across problems)' if cfg.keep_store else ''}.", file=out)
    return result
