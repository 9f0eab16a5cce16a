"""Fidelity of a method's call against ``full`` on the same prompt ids."""

from __future__ import annotations

import torch


def kl_first_token(full_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """KL(full || method) of the first-token distributions, in nats."""
    # float64: in fp32 the log-softmax's own rounding leaves a floor near 1e-8, above what exact reuse differs by
    log_p = torch.log_softmax(full_logits.double(), -1)
    log_q = torch.log_softmax(method_logits.double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))


def first_token_margin(logits: torch.Tensor) -> float:
    """Probability of the top-1 token minus that of the top-2 (logits [vocab]); 1.0 with one token."""
    probs = torch.softmax(logits.float(), -1)
    if probs.numel() < 2:
        return 1.0
    top = probs.topk(2).values
    return float(top[0] - top[1])


def first_token_agrees(full_logits: torch.Tensor, method_logits: torch.Tensor) -> bool:
    return int(full_logits.argmax()) == int(method_logits.argmax())


def greedy_match(full_ids: list[int], method_ids: list[int], num_tokens: int = 32) -> bool:
    """The first ``num_tokens`` greedy tokens are equal (a shorter output must match as a whole)."""
    return full_ids[:num_tokens] == method_ids[:num_tokens]
