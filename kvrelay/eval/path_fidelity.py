"""Fidelity along ``full``'s greedy continuation, teacher-forced: what greedy@32 measures, as a score.

A method's first ``n`` greedy tokens equal ``full``'s exactly when, fed ``full``'s own continuation, the
method's top-1 next token agrees with ``full``'s at each of those ``n`` positions (until a position
differs, both read the same tokens). So greedy@n can be read from one forced chunk per method instead of
``n`` decode steps, and the KL(full || method) at those positions gives a smooth score beside it: the
first-token KL sees only the first position, and calibration ranked by it can buy first-token KL with
tokens that the continuation then reads wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.engine.call import CallStats
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.reuse.base import CallInput, ReuseMethod


def forced_logits(engine: Engine, call: CallInput, method: str | ReuseMethod, fed_ids: list[int]
                  ) -> tuple[torch.Tensor, CallStats]:
    """The method's next-token logits before and after each of ``fed_ids``: [len(fed_ids) + 1, vocab] fp32
    (row 0: the first token's, from the method's prefill of the prompt; row i: after ``fed_ids[:i]``,
    computed in full as one more chunk over the method's prompt KV), and the prefill's stats."""
    options = GenerateOptions(SamplingConfig(max_new_tokens=max(len(fed_ids), 1)), learn=False)
    seq = engine.start(call, method, options)
    rows = [seq.first_logits.float()[None]]  # [1, vocab]
    if fed_ids:
        ids = torch.tensor(call.prompt_ids + list(fed_ids), dtype=torch.long)
        rows.append(engine.lm.model.prefill(ids, seq.cache, SuffixSchedule(len(call.prompt_ids)),
                                            all_logits=True).logits.float())  # [len(fed_ids), vocab]
    seq.cancel()
    seq.cache = None
    return torch.cat(rows), seq.stats


@dataclass(frozen=True)
class PathReference:
    """``full``'s greedy continuation of one call and its logits along it (the rows a method is held to)."""

    fed_ids: list[int]  # the continuation's tokens a method is fed
    logits: torch.Tensor  # [num_positions, vocab]: full's next-token logits at each scored position
    stop_ids: frozenset[int] = frozenset()  # with a stopped continuation: any of these ends it, as decoding does

    @property
    def num_positions(self) -> int:
        return int(self.logits.shape[0])


def path_reference(engine: Engine, call: CallInput, num_tokens: int) -> PathReference:
    """``full``'s first ``num_tokens`` greedy tokens (fewer where the context ends first); when it stops before
    them, the position that predicts its stop token is scored too (a method must stop there as well)."""
    # a calibration call near the context's end is scored on the continuation that fits (at least its first token)
    num_tokens = max(1, min(num_tokens, engine.lm.config.max_position_embeddings - len(call.prompt_ids)))
    out = engine.generate(call, "full", GenerateOptions(SamplingConfig(max_new_tokens=num_tokens)))
    fed = list(out.output_ids[:num_tokens])
    logits, _ = forced_logits(engine, call, "full", fed)
    num_positions = len(fed) + 1 if out.stop_reason == "stop" else len(fed)
    stop_ids = frozenset(engine.lm.tokenizer.stop_ids) if out.stop_reason == "stop" else frozenset()
    return PathReference(fed, logits[:max(num_positions, 1)], stop_ids)


@dataclass(frozen=True)
class PathScore:
    """One method on one call, along full's continuation."""

    first_kl: float  # KL(full || method) of the first token
    path_kl: float  # mean KL(full || method) over the scored positions
    greedy_match: bool  # top-1 agrees at every scored position: the method's greedy tokens equal full's
    reuse: float  # the method's reused share of the prompt's token-layers


def score_path(engine: Engine, call: CallInput, method: str | ReuseMethod, ref: PathReference) -> PathScore:
    """One method on one call, held to ``full``'s continuation ``ref``."""
    logits, stats = forced_logits(engine, call, method, ref.fed_ids)
    logits = logits[:ref.num_positions]
    kls = [kl_first_token(ref.logits[i], logits[i]) for i in range(ref.num_positions)]
    top_ids = logits.argmax(-1).tolist()
    # held to the tokens full emitted (not its forced logits' argmax), and at a stop row to any stop id
    agree = top_ids[:len(ref.fed_ids)] == ref.fed_ids[:len(top_ids)] and (
        ref.num_positions <= len(ref.fed_ids) or top_ids[len(ref.fed_ids)] in ref.stop_ids)
    return PathScore(kls[0], sum(kls) / len(kls), agree, stats.reuse_rate)
