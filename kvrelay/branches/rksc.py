"""``rksc`` (RKSC, arXiv 2606.09937): shared branch prefixes and confidence-gated early exit.

The method plans single calls of a multi-branch problem (branches/runner.py runs the problem):

- ASKS: when the branch runner has computed the problem's shared root (the prompt prefix every
  branch and every verification starts with), a call whose prompt starts with it reads those
  positions from the root's cache by reference (the plan supplies a ``SharedPrefixKV`` as the
  call's cache, ``Plan.make_cache``): no branch holds a copy,
  and only its own tokens are computed.
- CGEE (b), the layer exit: while ``exiting`` (the verifier pass), after each layer from
  ``exit_min_layer`` the final norm + LM head run on the last token; the forward stops once the
  next-token entropy is below ``exit_theta`` nats and moved less than ``exit_eps`` since the
  previous layer. ``exit_theta = 0`` never exits (an entropy is never negative).
- CGEE (a), the verifier skip, is ``decisive()``: the runner skips verification when the top
  branch confidence is >= ``skip_top`` and leads the next by >= ``skip_gap``.
- RSBCM is the runner's block cache (branches/blocks.py, ``policy`` and ``block_budget_mb`` here);
  this file's schedule measures what it ranks blocks by: the attention mass the last prompt token
  gives every position (mean over heads and computed layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvrelay.branches.blocks import POLICIES
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
                 probe_attention: bool = False, record_hidden: bool = False) -> None:
        super().__init__(start)
        self.logits_fn, self.theta, self.eps, self.min_layer = logits_fn, theta, eps, min_layer
        self.exit_enabled = logits_fn is not None and theta > 0
        self.record_hidden = record_hidden
        self.has_exit_test = self.exit_enabled or record_hidden
        self.has_layer_hook = probe_attention
        self.hidden: list[torch.Tensor] = []  # with record_hidden: the last token's output of each layer
        self.entropies: dict[int, float] = {}  # layer -> next-token entropy where it was evaluated
        self.attention_mass: torch.Tensor | None = None  # [n] summed over probed layers
        self.num_probed_layers = 0

    def exit_after(self, layer: int, last_hidden: torch.Tensor) -> bool:
        if self.record_hidden:
            self.hidden.append(last_hidden.detach().clone())  # [hidden]; ASKS's gate compares these
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


@dataclass
class RKSCMethod(ReuseMethod):
    name: ClassVar[str] = "rksc"
    share_prefix: bool = field(default=True, metadata={
        "help": "ASKS: read the shared root by reference (false: compute every prompt)"})
    # decode the B branches in one batch over the shared root (false: one branch after another)
    batch_decode: bool = field(default=True, metadata={
        "help": "decode the branches in one batch over the shared root (false: one after another)"})
    skip_top: float = field(default=0.70, metadata={
        "help": "CGEE: skip the verifier when the top branch's confidence is >= this"})
    skip_gap: float = field(default=0.06, metadata={"help": "CGEE: ... and it leads the second branch by >= this"})
    # CGEE (b) defaults from research/calibrate_cgee.py on 8 GSM8K *train* problems (64 verifier calls):
    # on SmolLM2-135M no intermediate layer's yes/no verdict is reliable, so the only setting with a
    # per-call error <= 1% there is one that (almost) never exits; the study prints bolder ones.
    exit_theta: float = field(default=0.25, metadata={
        "help": "CGEE early exit once next-token entropy < this, in nats (0: never exit)"})
    exit_eps: float = field(default=0.05, metadata={
        "help": "... and it moved < this many nats since the previous layer"})
    exit_min_layer: int = field(default=25, metadata={
        "help": "no exit test below this layer (each test costs an LM head)"})
    block_budget_mb: float = field(default=64.0, metadata={
        "help": "RSBCM byte budget of the runner's block cache, in MB"})
    policy: str = field(default="rsbcm", metadata={"help": "block cache eviction: rsbcm or lru"})
    block_half_life_ops: float = field(default=0.0, metadata={
        "help": "RSBCM importance half-life in cache operations (0: none, as in RKSC)"})
    block_len: int = field(default=16, metadata={"help": "tokens per cached block"})
    probe_attention: bool = field(default=True, metadata={
        "help": "measure block importance (attention mass) for RSBCM"})
    # ASKS, approximate part (opt-in): a verification reuses its branch's decode K/V for the output
    # when the hidden states entering the output agree (mean cosine over layers >= asks_tau)
    asks_approx: bool = field(default=False, metadata={
        "help": "a verification reuses its branch's decode K/V when the hidden states entering the output agree"})
    asks_tau: float = field(default=0.8, metadata={
        "help": "mean cosine over layers the hidden states need for asks_approx"})
    # set by the branch runner while it runs a problem
    root: SharedRoot | None = field(default=None, init=False, repr=False)
    exiting: bool = field(default=False, init=False, repr=False)
    last_schedule: RKSCSchedule | None = field(default=None, init=False, repr=False)  # its probe, entropies
    record_hidden: bool = field(default=False, init=False, repr=False)  # branches record the boundary state

    def __post_init__(self) -> None:
        for key in ("skip_top", "skip_gap"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"rksc: {key} must be in [0, 1], got {getattr(self, key)}")
        if self.exit_theta < 0 or self.exit_eps < 0:
            raise ConfigError(f"rksc: exit_theta and exit_eps must be >= 0, got {self.exit_theta}, {self.exit_eps}")
        if self.exit_min_layer < 1:
            raise ConfigError(f"rksc: exit_min_layer must be >= 1 (the exit compares two layers), "
                              f"got {self.exit_min_layer}")
        if self.policy not in POLICIES:
            raise ConfigError(f"rksc: policy must be one of {POLICIES}, got {self.policy!r}")
        if not -1 <= self.asks_tau <= 1:
            raise ConfigError(f"rksc: asks_tau is a cosine, in [-1, 1], got {self.asks_tau}")
        if self.block_half_life_ops < 0:
            raise ConfigError(f"rksc: block_half_life_ops must be >= 0, got {self.block_half_life_ops}")
        if self.block_budget_mb <= 0 or self.block_len < 1:
            raise ConfigError("rksc: block_budget_mb and block_len must be positive")

    @property
    def block_budget_bytes(self) -> int:
        return int(self.block_budget_mb * (1 << 20))

    def shared_len(self, prompt_ids: list[int]) -> int:
        """Positions this prompt reads from the root (0 when it does not start with it)."""
        root = self.root
        if not self.share_prefix or root is None:
            return 0
        n = len(root.token_ids)
        if tuple(prompt_ids[:n]) != root.token_ids:
            return 0
        return min(n, len(prompt_ids) - 1)  # the last prompt token is always computed

    def schedule(self, start: int, lm, record_hidden: bool = False, final: bool = True) -> RKSCSchedule:
        """Tokens [start, n) computed; the layer exit while ``exiting``; the attention probe if asked.
        ``final=False``: a chunk before the prompt's end (ASKS's verifier prefix): no exit, no probe."""
        theta = self.exit_theta if self.exiting and final else 0.0
        schedule = RKSCSchedule(start, lm.model.logits_from_hidden, theta, self.exit_eps, self.exit_min_layer,
                                self.probe_attention and final, record_hidden)
        self.last_schedule = schedule
        return schedule

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        shared = self.shared_len(call.prompt_ids)
        schedule = self.schedule(shared, lm, self.record_hidden)
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
