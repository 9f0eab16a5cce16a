"""Named benchmark workloads: a pipeline spec, its problems, and a scorer.

Prompts are written for an instruct model; upstream outputs go into the downstream user message.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrelay.data import datasets, scoring
from kvrelay.errors import ConfigError, DataFileError
from kvrelay.pipeline.spec import AgentSpec, PipelineSpec


@dataclass(frozen=True)
class Problem:
    inputs: dict[str, str]
    reference: object  # what the scorer compares against
    problem_id: str


@dataclass(frozen=True)
class Workload:
    name: str
    spec: PipelineSpec
    problems: Callable[[str | None, int | None], list[Problem]]  # (data path, limit) -> problems
    score: Callable[[str, object], float] | None  # (final answer text, reference) -> 0..1


MATH_ANSWER = "End with 'Answer: <number>'."

# ---------------------------------------------------------------------------- GSM8K


def _gsm8k_problems(path: str | None, limit: int | None) -> list[Problem]:
    return [Problem({"question": p.question}, p.answer, f"gsm8k-{i}")
            for i, p in enumerate(datasets.load_gsm8k(path, limit=limit))]


def _gsm8k_score(text: str, reference: object) -> float:
    return float(scoring.gsm8k_correct(text, str(reference)))


def gsm8k_chain3() -> Workload:
    spec = PipelineSpec("gsm8k-chain3", ("question",), (
        AgentSpec("solver", system=f"You are a careful math solver. Solve the problem step by step. {MATH_ANSWER}",
                  user="{question}", max_new_tokens=128),
        AgentSpec("critic", system="You are a strict reviewer of math solutions.",
                  user="Problem:\n{question}\n\nProposed solution:\n{solver}\n\nCheck every step of the proposed "
                       f"solution. Point out any mistake and solve it correctly. {MATH_ANSWER}",
                  max_new_tokens=96),
        AgentSpec("finalizer", system="You give the final answer to a math problem.",
                  user="Problem:\n{question}\n\nSolution:\n{solver}\n\nReview:\n{critic}\n\n"
                       f"State the correct final answer. {MATH_ANSWER}",
                  max_new_tokens=32),
    ))
    return Workload("gsm8k-chain3", spec, _gsm8k_problems, _gsm8k_score)


def _fc3(name: str, roles: tuple[str, str, str], task: str, answer_rule: str, tokens: tuple[int, int, int]
         ) -> PipelineSpec:
    """KVCOMM's fully connected graph: agent k sees the task and agents 1..k-1; agent 3 decides."""
    a1, a2, a3 = roles
    return PipelineSpec(name, ("question",), (
        AgentSpec("agent1", system=a1, user=f"{task}\n\n{answer_rule}", max_new_tokens=tokens[0]),
        AgentSpec("agent2", system=a2, user=f"{task}\n\nAnother agent answered:\n{{agent1}}\n\n"
                                           f"Give your own answer. {answer_rule}", max_new_tokens=tokens[1]),
        AgentSpec("agent3", system=a3, user=f"{task}\n\nAgent 1 answered:\n{{agent1}}\n\nAgent 2 answered:\n"
                                           f"{{agent2}}\n\nDecide the final answer. {answer_rule}",
                  max_new_tokens=tokens[2]),
    ))


def gsm8k_fc3() -> Workload:
    spec = _fc3("gsm8k-fc3", ("You are a math expert.", "You are a math teacher who double-checks answers.",
                              "You are the judge who decides the final answer."),
                "Problem:\n{question}", f"Reason step by step. {MATH_ANSWER}", (128, 96, 48))
    return Workload("gsm8k-fc3", spec, _gsm8k_problems, _gsm8k_score)


# ---------------------------------------------------------------------------- MMLU


def _mmlu_problems(path: str | None, limit: int | None) -> list[Problem]:
    out = []
    for i, p in enumerate(datasets.load_mmlu(path, limit=limit)):
        text = p.question + "\n" + "\n".join(f"{letter}. {c}" for letter, c in zip("ABCD", p.choices, strict=True))
        out.append(Problem({"question": text}, p.answer, f"mmlu-{p.subject}-{i}"))
    return out


def _mmlu_score(text: str, reference: object) -> float:
    return float(scoring.extract_letter(text) == reference)


def mmlu_fc3() -> Workload:
    spec = _fc3("mmlu-fc3", ("You are a knowledgeable expert.", "You are a careful fact checker.",
                             "You are the judge who decides the final answer."),
                "Question:\n{question}", "Explain briefly, then end with 'Answer: <letter>'.", (96, 96, 32))
    return Workload("mmlu-fc3", spec, _mmlu_problems, _mmlu_score)


# ---------------------------------------------------------------------------- a shared document

DOC_ROWS = range(20, 26)  # per subject: the MMLU rows a document states (no default was chosen on them)


def _doc_problems(path: str | None, limit: int | None) -> list[Problem]:
    """One document per problem: six MMLU facts of one subject (each question with its correct answer), subjects
    in sorted order, a later round on each subject's next six rows; the question asked is one of the six, with
    its options."""
    by_subject: dict[str, list[datasets.MMLUProblem]] = {}
    for p in datasets.load_mmlu(path):
        by_subject.setdefault(p.subject, []).append(p)
    subjects = sorted(s for s, rows in by_subject.items() if len(rows) >= DOC_ROWS.stop)
    if not subjects:
        raise DataFileError(f"mmlu-doc3 needs a subject with at least {DOC_ROWS.stop} MMLU rows (a document states "
                            f"rows {DOC_ROWS.start}-{DOC_ROWS.stop - 1}); {path or 'the MMLU data'} has none")
    out = []
    for i in range(len(subjects) if limit is None else limit):
        subject, num_round = subjects[i % len(subjects)], i // len(subjects)
        rows = by_subject[subject][DOC_ROWS.start + len(DOC_ROWS) * num_round:][:len(DOC_ROWS)]
        if len(rows) < len(DOC_ROWS):
            break  # every subject's rows are used up
        facts = "\n".join(f"{k + 1}. {p.question} Answer: {p.choices['ABCD'.index(p.answer)]}"
                          for k, p in enumerate(rows))
        asked = rows[i % len(rows)]
        options = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", asked.choices, strict=True))
        out.append(Problem({"document": f"Notes on {subject.replace('_', ' ')}:\n{facts}",
                            "question": f"{asked.question}\n{options}"}, asked.answer,
                           f"mmlu-doc-{subject}-{num_round}"))
    return out


def mmlu_doc3() -> Workload:
    """Three agents over a shared document: every agent reads the whole document, so the answerer and the checker
    reuse it (and the analyst's notes) at an offset after their own system prompt."""
    spec = PipelineSpec("mmlu-doc3", ("document", "question"), (
        AgentSpec("analyst", system="You are an analyst. Read the document and write brief notes on the facts that "
                                    "bear on the question.",
                  user="Document:\n{document}\n\nQuestion: {question}", max_new_tokens=48),
        AgentSpec("answerer", system="You answer multiple-choice questions from a document and an analyst's notes. "
                                     "Give the letter of the correct option, then one sentence why.",
                  user="Document:\n{document}\n\nNotes:\n{analyst}\n\nQuestion: {question}", max_new_tokens=24),
        AgentSpec("checker", system="You are a checker. Say whether the answer agrees with the document, then give "
                                    "the correct letter.",
                  user="Document:\n{document}\n\nQuestion: {question}\n\nAnswer: {answerer}", max_new_tokens=24),
    ))
    return Workload("mmlu-doc3", spec, _doc_problems, _mmlu_score)


# ---------------------------------------------------------------------------- HumanEval


def _humaneval_problems(path: str | None, limit: int | None) -> list[Problem]:
    return [Problem({"question": p.prompt}, p, p.task_id) for p in datasets.load_humaneval(path, limit=limit)]


def _humaneval_score(text: str, reference: object) -> float:
    p = reference
    return float(scoring.run_humaneval(p.prompt, text, p.test, p.entry_point).passed)


CODE_RULE = "Reply with the complete Python function in one ```python code block."


def humaneval_fc3() -> Workload:
    spec = _fc3("humaneval-fc3", ("You are an expert Python programmer.", "You are a Python code reviewer.",
                                  "You are the lead engineer who decides the final code."),
                "Complete this Python function:\n```python\n{question}```", CODE_RULE, (160, 160, 160))
    return Workload("humaneval-fc3", spec, _humaneval_problems, _humaneval_score)


def humaneval_adr() -> Workload:
    spec = PipelineSpec("humaneval-adr", ("question",), (
        AgentSpec("architect", system="You are a software architect.",
                  user="Plan how to implement this Python function. List the steps and edge cases; no code.\n"
                       "```python\n{question}```", max_new_tokens=96),
        AgentSpec("developer", system="You are an expert Python developer.",
                  user="Implement this function:\n```python\n{question}```\n\nFollow this plan:\n{architect}\n\n"
                       f"{CODE_RULE}", max_new_tokens=160),
        AgentSpec("reviewer", system="You are a meticulous code reviewer.",
                  user="Task:\n```python\n{question}```\n\nPlan:\n{architect}\n\nImplementation:\n{developer}\n\n"
                       f"Fix any bug and return the final function. {CODE_RULE}", max_new_tokens=160),
    ))
    return Workload("humaneval-adr", spec, _humaneval_problems, _humaneval_score)


# ---------------------------------------------------------------------------- copy-agents

_WORDS = ("agent context cache token layer value key model output input prefix reuse memory graph node edge "
          "answer question review plan code test result state step check final shared span position").split()


def _filler(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def copy_agents(num_agents: int = 5, prefix_tokens: int = 512, output_tokens: int = 512) -> Workload:
    """KVCOMM's TTFT microbenchmark: agent k's prompt is a shared prefix + the outputs of agents 1..k-1.

    Deterministic, no dataset: the prefix and the outputs are fixed pseudo-text (about the given
    token counts); outputs are forced, their KV built as decoding them would build it.
    """
    if num_agents < 1:
        raise ConfigError(f"copy-agents needs at least 1 agent, got {num_agents}")
    words_per_token = 0.8  # these words are ~1.25 tokens each with the default tokenizer
    agents = []
    for k in range(1, num_agents + 1):
        upstream = "".join(f"\n\nAgent {j} wrote:\n{{agent{j}}}" for j in range(1, k))
        agents.append(AgentSpec(f"agent{k}", system="You are one agent of a team.",
                                user=f"Context:\n{{context}}{upstream}\n\nAgent {k}, continue the work.",
                                max_new_tokens=1,
                                forced_output=_filler(1000 + k, int(output_tokens * words_per_token))))
    spec = PipelineSpec(f"copy-agents-{num_agents}", ("context",), tuple(agents))

    def problems(path: str | None, limit: int | None) -> list[Problem]:
        n = 1 if limit is None else limit
        return [Problem({"context": _filler(i, int(prefix_tokens * words_per_token))}, None, f"copy-{i}")
                for i in range(n)]

    return Workload(spec.name, spec, problems, None)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gsm8k-chain3": gsm8k_chain3, "gsm8k-fc3": gsm8k_fc3, "mmlu-fc3": mmlu_fc3, "mmlu-doc3": mmlu_doc3,
    "humaneval-fc3": humaneval_fc3, "humaneval-adr": humaneval_adr, "copy-agents": copy_agents,
}


PIPELINE_FILE_SUFFIXES = (".yaml", ".yml")


def is_pipeline_file(name: str) -> bool:
    """Whether a workload name is a pipeline file of the user's (``pipeline_workload``)."""
    return name.endswith(PIPELINE_FILE_SUFFIXES)


def pipeline_workload(path: str) -> Workload:
    """A pipeline file as a workload: its problems are the lines of a JSON-lines file of its inputs (the data
    file, which it needs), unscored; named after the pipeline (its ``name``, else the file's stem)."""
    spec = PipelineSpec.from_yaml(path)
    name = Path(path).stem if spec.name == str(Path(path)) else spec.name  # no name: from_yaml used the path

    def problems(data: str | None, limit: int | None) -> list[Problem]:
        if data is None:
            raise ConfigError(f"workload {path}: give its problems with --data, a JSON-lines file of objects with "
                              f"the pipeline's inputs ({', '.join(spec.inputs) or 'none'}) as strings")
        return [Problem(inputs, None, f"{name}-{i}") for i, inputs in enumerate(datasets.load_inputs(
            data, spec.inputs, limit))]

    return Workload(name, spec, problems, None)


def get_workload(name: str) -> Workload:
    """A workload by name (``copy-agents:N`` sets the number of agents, default 5), or a pipeline file
    (``pipeline_workload``)."""
    if is_pipeline_file(name):
        return pipeline_workload(name)
    base, _, arg = name.partition(":")
    if base == "gsm8k-branches":
        raise ConfigError("gsm8k-branches is not a pipeline: run it with `kvrelay bench --workload gsm8k-branches` "
                          "(kvrelay.eval.branch_bench)")
    if base not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}, gsm8k-branches "
                          "(copy-agents:N), or a pipeline file (.yaml) with --data")
    if arg:
        if base != "copy-agents" or not arg.isdigit():
            raise ConfigError(f"bad workload parameter in {name!r}: only copy-agents:N takes one")
        return copy_agents(int(arg))
    return WORKLOADS[base]()
