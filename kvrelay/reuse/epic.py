"""``epic`` (EPIC, ICML'25): recompute the first k tokens of each reused span at every layer.

A span moved into a new context misses the attention-sink behaviour of its first tokens; EPIC's
fix is to recompute those k tokens fully and reuse the rest as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.schedule import StaticSchedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod
from kvrelay.reuse.spans import collect_reuse


@dataclass
class EpicMethod(ReuseMethod):
    k: int = field(default=16, metadata={"help": "tokens recomputed at every layer at the start of each reused span"})
    name = "epic"

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"epic: k must be >= 0, got {self.k}")

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        reuse = collect_reuse(call, store, lm.fingerprint)
        heads = [torch.arange(ld.dst_start, ld.dst_start + min(self.k, ld.num_tokens)) for ld in reuse.approx]
        active = torch.cat([reuse.new_idx(len(call.prompt_ids)), *heads]).unique()  # sorted
        return Plan(StaticSchedule(active), reuse.loads, note=reuse.note)
