"""The prompts of a ``gsm8k-branches`` problem: a shared root, one hint per branch, the verifier's question."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.errors import ConfigError
from kvrelay.pipeline.prompt import chat_prompt_ids, splice_marker

if TYPE_CHECKING:
    from kvrelay.data.datasets import GSM8KProblem

SYSTEM = "You are a careful math solver."
HINTS = (
    "Solve it step by step.",
    "First list the known quantities, then compute the answer.",
    "Write an equation for the unknown and solve it.",
    "Work backwards from what is asked.",
    "Break the problem into small parts and solve each part.",
    "Think about the units of every quantity, then compute.",
    "Explain your reasoning briefly, then compute.",
    "Check each calculation as you go.",
    "Use the simplest method you can find.",
    "Start with what changes and what stays the same.",
    "Compute the intermediate totals first.",
    "Restate the question in your own words, then solve it.",
)
ANSWER_RULE = "End with 'Answer: <number>'."
VERIFY_QUESTION = "Is the proposed solution correct? Answer Yes or No."


@dataclass(frozen=True)
class BranchConfig:
    num_branches: int = 8  # B
    branch_tokens: int = 64  # T: tokens each branch decodes at most

    def __post_init__(self) -> None:
        if not 1 <= self.num_branches <= len(HINTS):
            raise ConfigError(f"num_branches must be in 1..{len(HINTS)} (one hint each), got {self.num_branches}")
        if self.branch_tokens < 1:
            raise ConfigError(f"branch_tokens must be >= 1, got {self.branch_tokens}")


@dataclass
class BranchPrompts:
    """Token ids of one problem's prompts; every prompt starts with ``root_ids``."""

    root_ids: list[int]
    branch_ids: list[list[int]]
    question: str
    tokenizer: object = field(repr=False)
    system: str = SYSTEM

    @classmethod
    def build(cls, tokenizer, question: str, cfg: BranchConfig, system: str = SYSTEM) -> BranchPrompts:
        branch_ids, root = [], None
        for hint in HINTS[: cfg.num_branches]:
            ids, root_len = _split_prompt(tokenizer, question, f"{hint} {ANSWER_RULE}", system)
            root = root or ids[:root_len]
            branch_ids.append(ids)
        return cls(root, branch_ids, question, tokenizer, system)

    def verifier_ids(self, output_ids: list[int]) -> list[int]:
        return self.verifier_prompt(output_ids)[0]

    def verifier_prompt(self, output_ids: list[int]) -> tuple[list[int], int]:
        """The verifier prompt's ids and where the branch output starts in it."""
        rest = f"Proposed solution:\n{splice_marker('out')}\n\n{VERIFY_QUESTION}"
        prompt = chat_prompt_ids(self.tokenizer, _messages(self.question, rest, self.system),
                                 {"out": output_ids, "root": []})
        if prompt.ids[: prompt.segments[0].end] != self.root_ids:
            raise AssertionError("verifier prompt does not start with the branches' root")
        return prompt.ids, prompt.span_of("out").start


def few_shot_system(examples: Sequence[GSM8KProblem]) -> str:
    """The system prompt followed by worked examples: a long prefix that every problem using the same
    examples shares (GSM8K is often run 8-shot), where a block cache's ranking decides what stays."""
    shots = "\n\n".join(f"Problem:\n{p.question}\nSolution:\n{p.solution}\nAnswer: {p.answer}" for p in examples)
    return f"{SYSTEM}\n\nWorked examples:\n\n{shots}" if shots else SYSTEM


def _messages(question: str, rest: str, system: str = SYSTEM) -> list[dict[str, str]]:
    """System + user message; the empty ⟦root⟧ splice makes the root (system + problem) tokenize on its own."""
    user = f"Problem:\n{question}\n\n{splice_marker('root')}{rest}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _split_prompt(tokenizer, question: str, rest: str, system: str = SYSTEM) -> tuple[list[int], int]:
    """Chat prompt ids with the root tokenized on its own, and the root's length."""
    prompt = chat_prompt_ids(tokenizer, _messages(question, rest, system), {"root": []})
    return prompt.ids, prompt.segments[0].end


def answer_ids(tokenizer) -> tuple[int, int]:
    """The single-token ids of the verifier's "Yes" and "No"."""
    ids = [tokenizer.encode(word) for word in ("Yes", "No")]
    if any(len(i) != 1 for i in ids):
        raise ConfigError(f"the verifier needs 'Yes' and 'No' to be single tokens; this tokenizer gives {ids}")
    return ids[0][0], ids[1][0]
