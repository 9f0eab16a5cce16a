"""``kvrelay bench``: every method on the same calls, TTFT + reuse + fidelity against ``full``.

Agent mode (default): the reference pipeline runs once with ``full``. Before each downstream
call publishes its KV, every method runs that call on the very same prompt ids, against a store
holding exactly the upstream spans (prompt + decode KV) — so each call is isolated and the
comparison is exact. E2e mode: each method runs the whole pipeline; task accuracy is scored.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

import kvrelay
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions, sync_device
from kvrelay.errors import ConfigError
from kvrelay.eval.configs import REFERENCES, BenchConfig  # noqa: F401 (REFERENCES: its import path before configs)
from kvrelay.eval.fidelity import first_token_agrees, first_token_margin, greedy_match, kl_first_token
from kvrelay.eval.report import CallRow, summarize
from kvrelay.eval.stats import mean, median
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import StaticSchedule
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import Workload, get_workload
from kvrelay.reuse import CallInput, ReuseMethod, get_method
from kvrelay.tier.tiered import open_store
from kvrelay.weights.loader import load_model


def new_token_mask(call: CallInput, store: KVStore, lm: LoadedModel) -> list[bool]:
    """Prompt tokens with no KV anywhere: not in a ref, not in the longest exact stored prefix."""
    new = [True] * len(call.prompt_ids)
    for ref in call.refs:
        new[ref.start : ref.end] = [False] * ref.num_tokens
    match = store.match_prefix(lm.fingerprint, call.prompt_ids)
    if match is not None:
        new[: match.num_tokens] = [False] * match.num_tokens
    new[-1] = True  # the last token is always computed (its logits are the point)
    return new


def ideal_ttft_ms(lm: LoadedModel, call: CallInput, new_mask: list[bool]) -> float:
    """TTFT of a call that computes only its new tokens, with nothing to load (the physical limit)."""
    model, n = lm.model, len(call.prompt_ids)
    idx = torch.tensor([i for i, is_new in enumerate(new_mask) if is_new])
    sync_device(model.device)
    t0 = time.perf_counter()
    cache = SequenceKV(lm.config, model.dtype, model.device, capacity=n + 1)
    cache.filled[:, :n] = True  # stands for reused KV; its values do not matter for timing
    model.prefill(torch.tensor(call.prompt_ids), cache, StaticSchedule(idx))
    sync_device(model.device)
    return (time.perf_counter() - t0) * 1e3


def checkout_commit(where: Path) -> str | None:
    """The short HEAD of the checkout holding ``where``, plus ``-dirty`` where its tracked code differs from HEAD
    (result files aside: a run that rewrites them leaves the next run's code as committed); None outside git."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=where)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode or not head.stdout.strip():
            return None
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)benchmarks/results")
    except OSError:
        return None
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def environment(device: str) -> dict:
    """The bench JSON's "env": machine, device, versions, commit (``-dirty``: run on edited code)."""
    commit = checkout_commit(Path(__file__).parent)
    machine = f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} torch threads"
    if device.startswith("cuda") and torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    return {"machine": machine, "device": device, "torch": torch.__version__, "kvrelay": kvrelay.__version__,
            "commit": commit, "python": platform.python_version()}


class Bench:
    def __init__(self, cfg: BenchConfig, lm: LoadedModel | None = None) -> None:
        self.cfg = cfg
        self.lm = lm or load_model(cfg.model, device=cfg.device)
        self.workload: Workload = get_workload(cfg.workload)
        self.methods: dict[str, ReuseMethod] = {m: get_method(m) for m in cfg.methods}
        # what each method resolves from the model (relay: its profile's layers and selector), resolved here, once
        # the model is known and before any output: a band past its layers or a missing profile is refused now
        self.method_settings = {m: resolved for m, meth in self.methods.items() if (resolved := meth.settings(self.lm))}
        self._kept: dict[str, KVStore] = {}  # keep_store: one store per method (e2e) or for the run ("")
        self.fidelity_meaningful = not self.lm.name.startswith("random:")
        self.env = environment(cfg.device)  # taken once, at start: the commit whose code this run loaded

    def run(self, progress: bool = True, checkpoint: Callable[[dict], None] | None = None) -> dict:
        """Every problem; ``checkpoint`` receives the result so far after each problem but the last (a long
        run that is stopped keeps what it finished)."""
        torch.manual_seed(self.cfg.seed)
        problems = self.workload.problems(self.cfg.data, self.cfg.offset + self.cfg.limit)[self.cfg.offset:]
        if not problems:
            raise ConfigError(f"offset {self.cfg.offset} is past the last problem of {self.cfg.workload!r}")
        warm_ids = self._warm_up(progress) if self.cfg.warm_problems else []
        bar = tqdm(problems, desc=f"{self.cfg.workload} ({self.cfg.mode})", unit="problem", disable=not progress,
                   file=sys.stderr)
        rows: list[CallRow] = []
        scores: dict[str, list[float]] = {m: [] for m in self.methods}
        peak_bytes = 0
        for i, problem in enumerate(bar):
            if self.cfg.mode == "agent":
                peak_bytes = max(peak_bytes, self._agent_mode(problem, rows))
            else:
                peak_bytes = max(peak_bytes, self._e2e_problem(problem, rows, scores))
            if checkpoint is not None and i + 1 < len(problems):
                checkpoint(self._result(i + 1, rows, scores, peak_bytes, warm_ids))
        return self._result(len(problems), rows, scores, peak_bytes, warm_ids)

    def _warm_up(self, progress: bool) -> list[str]:
        """Run ``warm_problems`` unrecorded problems through the stateful methods; return their ids."""
        cfg = self.cfg
        stateful = {m: meth for m, meth in self.methods.items() if meth.stateful}  # BenchConfig: at least one
        if cfg.warm_data is not None:
            warm = self.workload.problems(cfg.warm_data, cfg.warm_problems)
        else:
            end = cfg.offset + cfg.limit
            warm = self.workload.problems(cfg.data, end + cfg.warm_problems)[end:]
        if len(warm) < cfg.warm_problems:
            where = cfg.warm_data or f"after problem {cfg.offset + cfg.limit - 1} of {cfg.workload!r}"
            raise ConfigError(f"warm_problems={cfg.warm_problems}, but only {len(warm)} problems exist {where}; "
                              "lower it or pass warm_data")
        for problem in tqdm(warm, desc=f"warm-up ({', '.join(stateful)})", unit="problem", disable=not progress,
                            file=sys.stderr):
            if cfg.mode == "e2e":  # each stateful method runs the whole pipeline, learning from its own calls
                for meth in stateful.values():
                    PipelineRunner(self._engine(KVStore(cfg.store_bytes)), self.workload.spec,
                                   run_id=problem.problem_id).run(problem.inputs, meth)
                continue
            engine = self._engine(KVStore(cfg.store_bytes))
            runner = PipelineRunner(engine, self.workload.spec, run_id=problem.problem_id)

            def learn(agent, call: CallInput, position: int, engine: Engine = engine) -> None:
                if call.refs:  # the calls the measured run probes: the methods learn from them as they would there
                    for meth in stateful.values():
                        engine.generate(call, meth, GenerateOptions(SamplingConfig(max_new_tokens=1), learn=True))

            runner.run(problem.inputs, "full", before_call=learn)
        return [p.problem_id for p in warm]

    def _engine(self, store: KVStore) -> Engine:
        """An engine on ``store`` that runs this bench's method objects (stateful ones keep their state)."""
        return Engine(self.lm, store, self.methods.values())

    def _store(self, key: str = "") -> KVStore:
        """A fresh store per problem, or with ``keep_store`` the run's store (one per ``key``)."""
        if not self.cfg.keep_store:
            return open_store(self.cfg.store, self.cfg.store_bytes, fingerprint=self.lm.fingerprint)
        if key not in self._kept:
            self._kept[key] = open_store(self.cfg.store, self.cfg.store_bytes, fingerprint=self.lm.fingerprint)
        return self._kept[key]

    def _result(self, num_problems: int, rows: list[CallRow], scores: dict[str, list[float]], peak_bytes: int,
                warm_ids: list[str]) -> dict:
        accuracy = {m: mean(v) for m, v in scores.items()} if self.cfg.mode == "e2e" else None
        results = summarize(rows, accuracy)
        for s in results.values():
            s["peak_store_bytes"] = peak_bytes
        return {"env": self.env, "model": self.lm.name, "workload": self.cfg.workload,
                "n": num_problems, "mode": self.cfg.mode, "fidelity_meaningful": self.fidelity_meaningful,
                "config": {k: v for k, v in self.cfg.__dict__.items()}, "warm_problem_ids": warm_ids,
                "method_settings": self.method_settings,
                "results": results,
                "calls": [r.__dict__ for r in rows]}

    # ------------------------------------------------------------------ agent mode
    def _agent_mode(self, problem, rows: list[CallRow]) -> int:
        engine = self._engine(self._store())
        store = engine.store
        runner = PipelineRunner(engine, self.workload.spec, run_id=problem.problem_id)

        def probe(agent, call: CallInput, position: int) -> None:
            if call.refs:  # a downstream call: it has something to reuse
                rows.extend(self._probe_call(problem.problem_id, agent.name, position, call, engine))

        runner.run(problem.inputs, "full", before_call=probe)
        return store.peak_bytes

    def _probe_call(self, problem_id: str, agent: str, position: int, call: CallInput, engine: Engine
                    ) -> list[CallRow]:
        lm, cfg, store = self.lm, self.cfg, engine.store
        # Stateful methods (KVCOMM's anchor pools) learn from this call once, in its last timed run,
        # so that every run of it (fidelity and timing) plans from the same state.
        greedy = {m: engine.generate(call, meth, GenerateOptions(SamplingConfig(cfg.greedy_tokens), learn=False))
                  for m, meth in self.methods.items()}  # fidelity outputs; also the warm-up
        new_mask = new_token_mask(call, store, lm)
        ttft: dict[str, list[float]] = {m: [] for m in (*self.methods, "ideal")}
        stats = {}
        for rep in range(cfg.repeats):  # interleaved, so machine noise hits every method alike
            for m, meth in self.methods.items():
                one = GenerateOptions(SamplingConfig(max_new_tokens=1), learn=rep == cfg.repeats - 1)
                out = engine.generate(call, meth, one)
                ttft[m].append(out.stats.ttft_ms)
                stats[m] = out.stats
            ttft["ideal"].append(ideal_ttft_ms(lm, call, new_mask))
        ref = greedy["full"]
        margin = first_token_margin(ref.first_logits)
        rows = []
        for m in self.methods:
            s, out = stats[m], greedy[m]
            rows.append(CallRow(
                problem_id, agent, position, m, s.num_prompt_tokens, sum(new_mask), median(ttft[m]),
                median(ttft["full"]), median(ttft["prefix"]), median(ttft["ideal"]), s.num_prompt_token_layers,
                s.num_reused_token_layers, s.num_reused_tokens * s.num_layers, s.num_recomputed_token_layers,
                first_token_agrees(ref.first_logits, out.first_logits),
                kl_first_token(ref.first_logits, out.first_logits),
                greedy_match(ref.output_ids, out.output_ids, cfg.greedy_tokens), s.fallback, margin))
        return rows

    # ------------------------------------------------------------------ e2e mode
    def _e2e_problem(self, problem, rows: list[CallRow], scores: dict[str, list[float]]) -> int:
        """Each method runs the whole pipeline on one problem; its final output is scored."""
        if self.workload.score is None:
            raise ConfigError(f"workload {self.cfg.workload!r} has no task score: use --mode agent")
        per_method = {}
        peak = 0
        for m, meth in self.methods.items():
            engine = self._engine(self._store(m))
            store = engine.store
            per_method[m] = PipelineRunner(engine, self.workload.spec, run_id=problem.problem_id).run(problem.inputs,
                                                                                                    meth)
            peak = max(peak, store.peak_bytes)
            final = per_method[m][self.workload.spec.output].output.text
            scores[m].append(self.workload.score(final, problem.reference))
        for m in self.methods:
            for name, res in per_method[m].items():
                if not res.call.refs:
                    continue
                s, full_s = res.output.stats, per_method["full"][name].output.stats
                pre_s = per_method["prefix"][name].output.stats
                rows.append(CallRow(
                    problem.problem_id, name, res.position, m, s.num_prompt_tokens, 0, s.ttft_ms,
                    full_s.ttft_ms, pre_s.ttft_ms, None, s.num_prompt_token_layers, s.num_reused_token_layers,
                    s.num_reused_tokens * s.num_layers, s.num_recomputed_token_layers, fallback=s.fallback))
        return peak
