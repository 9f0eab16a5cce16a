"""``kvrelay demo`` (first version): a 2-agent GSM8K chain, ``full`` vs ``prefix``, side by side.

Agent 1 (solver) answers the question; agent 2 (checker) continues the same conversation: its
prompt is the solver's prompt, the solver's generated ids spliced in, and a new user turn. Every
method's checker call runs on the very same prompt ids; fidelity is against ``full``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from kvrelay.cache.store import KVStore
from kvrelay.engine import generate
from kvrelay.eval.datasets import load_gsm8k
from kvrelay.eval.fidelity import first_token_agrees, greedy_match, kl_first_token
from kvrelay.eval.stats import mean, median, median_ratio
from kvrelay.model.loader import DEFAULT_MODEL, LoadedModel, load_model
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.prompt import chat_prompt_ids, splice_marker

SOLVER_SYSTEM = "You are a careful math tutor. Solve the problem step by step and end with 'Answer: <number>'."
CHECKER_TURN = "Check the solution above step by step. If it is wrong, correct it. End with 'Answer: <number>'."


@dataclass
class DemoConfig:
    model: str = DEFAULT_MODEL
    num_problems: int = 3
    solver_tokens: int = 128
    greedy_tokens: int = 32  # G: first greedy tokens compared with full
    methods: tuple[str, ...] = ("full", "prefix")
    data: str | None = None
    device: str = "cpu"
    repeats: int = 3  # timed checker calls per method and problem; the median is kept

    def __post_init__(self) -> None:
        if self.num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {self.num_problems}")
        if "full" not in self.methods:
            raise ValueError("the methods must include 'full', the fidelity reference")


@dataclass
class MethodRows:
    ttft_ms: list[float] = field(default_factory=list)
    reuse: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)


def _checker_prompt(lm: LoadedModel, question: str, solver_ids: list[int]) -> list[int]:
    messages = [
        {"role": "system", "content": SOLVER_SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": splice_marker("solver")},
        {"role": "user", "content": CHECKER_TURN},
    ]
    return chat_prompt_ids(lm.tokenizer, messages, {"solver": solver_ids}).ids


def run_demo(cfg: DemoConfig, out=sys.stdout) -> dict[str, MethodRows]:
    lm = load_model(cfg.model, device=cfg.device)
    problems = load_gsm8k(cfg.data, limit=cfg.num_problems)
    store = KVStore(budget_bytes=2 << 30)
    rows = {m: MethodRows() for m in cfg.methods}
    greedy = SamplingConfig(max_new_tokens=cfg.greedy_tokens)
    for i, problem in enumerate(tqdm(problems, desc="demo", unit="problem", file=sys.stderr)):
        solver_prompt = chat_prompt_ids(lm.tokenizer, [{"role": "system", "content": SOLVER_SYSTEM},
                                                       {"role": "user", "content": problem.question}]).ids
        solver = generate(lm, solver_prompt, "full", store, SamplingConfig(cfg.solver_tokens),
                          publish_as=f"solver-{i}")
        checker_ids = _checker_prompt(lm, problem.question, solver.output_ids)
        results = {}
        for method in cfg.methods:
            generate(lm, checker_ids, method, store, SamplingConfig(max_new_tokens=1))  # warm-up
            timed = [generate(lm, checker_ids, method, store, SamplingConfig(max_new_tokens=1))
                     for _ in range(cfg.repeats)]
            results[method] = generate(lm, checker_ids, method, store, greedy)
            results[method].stats.ttft_ms = median([t.stats.ttft_ms for t in timed])
        ref = results["full"]
        for method, res in results.items():
            r = rows[method]
            r.ttft_ms.append(res.stats.ttft_ms)
            r.reuse.append(res.stats.reuse_rate)
            r.agree.append(first_token_agrees(ref.first_logits, res.first_logits))
            r.kl.append(kl_first_token(ref.first_logits, res.first_logits))
            r.greedy.append(greedy_match(ref.output_ids, res.output_ids, cfg.greedy_tokens))
        if i == 0:
            print(f"\nproblem 1: {problem.question[:100]}...\nsolver: {solver.text[:200]!r}\n"
                  f"checker (full): {ref.text[:200]!r}\n", file=out)
    _print_table(lm, cfg, rows, out)
    return rows


def _print_table(lm: LoadedModel, cfg: DemoConfig, rows: dict[str, MethodRows], out) -> None:
    full = rows["full"].ttft_ms
    print(f"model {lm.name} ({lm.config.num_layers} layers) on {cfg.device}; {len(full)} checker calls "
          f"(the 2nd agent); TTFT = median of {cfg.repeats} timed calls each", file=out)
    header = f"{'method':<8} {'TTFT ms':>9} {'speedup':>8} {'reuse':>7} {'1st-tok agree':>14} " \
             f"{'KL(full||m)':>12} {'greedy@' + str(cfg.greedy_tokens):>10}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for method, r in rows.items():
        print(f"{method:<8} {median(r.ttft_ms):>9.1f} {median_ratio(full, r.ttft_ms):>7.2f}x "
              f"{mean(r.reuse):>7.3f} {mean(r.agree):>14.2f} {mean(r.kl):>12.2e} {mean(r.greedy):>10.2f}",
              file=out)
