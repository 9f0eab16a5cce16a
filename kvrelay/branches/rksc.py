"""``rksc`` (RKSC, arXiv 2606.09937): shared branch prefixes, a confidence-gated verifier, a block cache.

The method plans single calls of a multi-branch problem (branches/runner.py runs the problem):

- ASKS: when the branch runner has computed the problem's shared root (the prompt prefix every
  branch and every verification starts with), a call whose prompt starts with it reads those
  positions from the root's cache by reference (the plan supplies a ``SharedPrefixKV`` as the
  call's cache, ``Plan.make_cache``): no branch holds a copy,
  and only its own tokens are computed.
- CGEE (b), the layer exit (off unless ``exit_entropy_nats`` > 0): while ``exiting`` (the verifier
  pass), after each layer of the last sixth of the model the final norm + LM head run on the last
  token; the forward stops once the next-token entropy is below ``exit_entropy_nats`` and moved less
  than ``EXIT_EPS_NATS`` since the previous layer.
- CGEE (a), the verifier skip, is ``decisive()``: the runner skips verification when the top
  branch confidence is >= ``skip_top`` and leads the next by >= ``skip_gap``.
- RSBCM is the runner's block cache (branches/blocks.py, ``block_budget_mb`` here); this file's
  schedule measures what it ranks blocks by: the attention mass the last prompt token gives every
  position (mean over heads and computed layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvrelay.branches.shared_kv import SharedPrefixKV
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.schedule import LayerView, SuffixSchedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod


@dataclass
class SharedRoot:
    """The problem's shared prompt prefix, computed once: its ids and the cache that holds their K/V."""

    token_ids: tuple[int, ...]
    cache: SequenceKV


def entropy(logits: torch.Tensor) -> float:
    """Entropy (nats) of softmax(logits); logits [vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


def decisive(confidences: list[float], top: float, gap: float) -> bool:
    """CGEE's verifier skip: the most confident branch has >= ``top`` and leads the next by >= ``gap``."""
    if not confidences:
        return False
    ranked = sorted(confidences, reverse=True)
    second = ranked[1] if len(ranked) > 1 else 0.0
    return ranked[0] >= top and ranked[0] - second >= gap


class RKSCSchedule(SuffixSchedule):
    """Tokens [start, n) computed at every layer, with an optional layer exit and attention probe."""

    def __init__(self, start: int, logits_fn=None, theta: float = 0.0, eps: float = 0.0, min_layer: int = 0,
                 probe_attention: bool = False) -> None:
        super().__init__(start)
        self.logits_fn, self.theta, self.eps, self.min_layer = logits_fn, theta, eps, min_layer
        self.exit_enabled = logits_fn is not None and theta > 0
        self.has_exit_test = self.exit_enabled
        self.has_layer_hook = probe_attention
        self.entropies: dict[int, float] = {}  # layer -> next-token entropy where it was evaluated
        self.attention_mass: torch.Tensor | None = None  # [n] summed over probed layers
        self.num_probed_layers = 0

    def exit_after(self, layer: int, last_hidden: torch.Tensor) -> bool:
        if not self.exit_enabled or layer < self.min_layer:
            return False
        h = entropy(self.logits_fn(last_hidden))
        prev = self.entropies.get(layer - 1)
        self.entropies[layer] = h
        return prev is not None and h < self.theta and abs(h - prev) < self.eps

    def after_layer(self, view: LayerView) -> None:
        last = torch.tensor([view.active_idx.numel() - 1])
        probs = view.attention_probs(last)[:, 0].float().mean(0)  # [num_keys]
        self.attention_mass = probs if self.attention_mass is None else self.attention_mass + probs
        self.num_probed_layers += 1
        return None

    def position_mass(self) -> torch.Tensor | None:
        """Mean over probed layers of the last token's attention to each position: [n]."""
        if self.attention_mass is None:
            return None
        return self.attention_mass / self.num_probed_layers


# The layer exit's second condition: the entropy moved less than this since the previous layer (RKSC's epsilon; with
# the threshold below, research/calibrate_cgee.py's setting on GSM8K train verifications).
EXIT_EPS_NATS = 0.05


def exit_min_layer(num_layers: int) -> int:
    """The first layer the exit is tested at: the last sixth of the model (25 of SmolLM2's 30, where
    research/calibrate_cgee.py found the earlier layers' yes/no verdicts unreliable; each test costs an LM head),
    and at least two layers, since the rule compares a layer with the one before."""
    return max(1, num_layers - max(2, num_layers // 6))


@dataclass
class RKSCMethod(ReuseMethod):
    name: ClassVar[str] = "rksc"
    # decode the B branches in one batch over the shared root (false: one branch after another)
    batch_decode: bool = field(default=True, metadata={
        "help": "decode the branches in one batch over the shared root (false: one after another)"})
    skip_top: float = field(default=0.70, metadata={
        "help": "CGEE: skip the verifier when the top branch's confidence is >= this"})
    skip_gap: float = field(default=0.06, metadata={"help": "CGEE: ... and it leads the second branch by >= this"})
    # Off by default: on SmolLM2-135M no intermediate layer's yes/no verdict is reliable (research/calibrate_cgee.py,
    # GSM8K train), and its calibrated threshold (0.25 nats) exited on none of 360 test verifications while each
    # tested layer cost an LM head.
    exit_entropy_nats: float = field(default=0.0, metadata={
        "help": "CGEE layer exit: stop the verifier's forward once next-token entropy is below this (0: never)"})
    block_budget_mb: float = field(default=64.0, metadata={
        "help": "RSBCM byte budget of the runner's block cache, in MB"})
    # research/calibrate_cgee.py and rksc_verifier_overhead.py change these on an instance; a user never needs to
    exit_eps_nats: float = field(default=EXIT_EPS_NATS, init=False, repr=False)
    exit_from_layer: int | None = field(default=None, init=False, repr=False)  # None: exit_min_layer(the model's)
    probe_attention: bool = field(default=True, init=False, repr=False)  # RSBCM's importance (attention mass)
    # set by the branch runner while it runs a problem
    root: SharedRoot | None = field(default=None, init=False, repr=False)
    exiting: bool = field(default=False, init=False, repr=False)
    last_schedule: RKSCSchedule | None = field(default=None, init=False, repr=False)  # its probe, entropies

    def __post_init__(self) -> None:
        for key in ("skip_top", "skip_gap"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"rksc: {key} must be in [0, 1], got {getattr(self, key)}")
        if self.exit_entropy_nats < 0:
            raise ConfigError(f"rksc: exit_entropy_nats must be >= 0, got {self.exit_entropy_nats}")
        if self.block_budget_mb <= 0:
            raise ConfigError(f"rksc: block_budget_mb must be positive, got {self.block_budget_mb}")

    @property
    def block_budget_bytes(self) -> int:
        return int(self.block_budget_mb * (1 << 20))

    def shared_len(self, prompt_ids: list[int]) -> int:
        """Positions this prompt reads from the root (0 when it does not start with it)."""
        root = self.root
        if root is None:
            return 0
        n = len(root.token_ids)
        if tuple(prompt_ids[:n]) != root.token_ids:
            return 0
        return min(n, len(prompt_ids) - 1)  # the last prompt token is always computed

    def schedule(self, start: int, lm) -> RKSCSchedule:
        """Tokens [start, n) computed; the layer exit while ``exiting``; the attention probe."""
        theta = self.exit_entropy_nats if self.exiting else 0.0
        min_layer = self.exit_from_layer if self.exit_from_layer is not None else exit_min_layer(lm.config.num_layers)
        schedule = RKSCSchedule(start, lm.model.logits_from_hidden, theta, self.exit_eps_nats, min_layer,
                                self.probe_attention)
        self.last_schedule = schedule
        return schedule

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        shared = self.shared_len(call.prompt_ids)
        schedule = self.schedule(shared, lm)
        if not shared:
            return Plan(schedule, state=schedule)
        root = self.root.cache

        def make_cache(capacity: int) -> SharedPrefixKV:
            return SharedPrefixKV(root, shared, capacity=capacity - shared)

        return Plan(schedule, make_cache=make_cache, num_preloaded=shared, state=schedule)


def yes_score(logits: torch.Tensor, yes_id: int, no_id: int) -> float:
    """P(yes) / (P(yes) + P(no)) of a verifier's next-token logits ([vocab])."""
    p = torch.softmax(logits.float(), dim=-1)
    p_yes, p_no = float(p[yes_id]), float(p[no_id])
    return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.5


def pick(scores: list[float] | None, confidences: list[float]) -> int:
    """The branch with the largest score x sqrt(confidence); by confidence alone when unverified."""
    if scores is None:
        return max(range(len(confidences)), key=lambda b: confidences[b])
    return max(range(len(confidences)), key=lambda b: scores[b] * math.sqrt(confidences[b]))
