"""``cacheblend`` (CacheBlend, EuroSys'25): recompute the most deviating reused tokens.

All reused (moved) tokens are recomputed from layer 0 through the check layer; there, the
tokens whose fresh V deviates most from the reused V (top r, by L2 distance) stay recomputed for
every later layer, the rest read the reused KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.model.schedule import Entry, LayerView
from kvrelay.reuse.band import BandSchedule, Kept
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod
from kvrelay.reuse.spans import collect_reuse


def value_l2_deviation(view: LayerView, rows: torch.Tensor) -> torch.Tensor:
    """||v_fresh - v_reused|| per row, over all KV heads: [len(rows)]."""
    diff = (view.v.index_select(1, rows) - view.prev_v.index_select(1, rows)).float()  # [Hkv, n, hd]
    return diff.pow(2).sum(dim=(0, 2)).sqrt()


@dataclass
class CacheBlendMethod(ReuseMethod):
    check_layer: int = field(default=1, metadata={
        "help": "layer where the reused tokens' value deviation is read; every reused token is computed up to it"})
    ratio: float = field(default=0.15, metadata={
        "help": "share of reused tokens kept recomputed above the check layer: the most deviating there"})
    name = "cacheblend"

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ConfigError(f"cacheblend: ratio must be in [0, 1], got {self.ratio}")
        if self.check_layer < 0:
            raise ConfigError(f"cacheblend: check_layer must be >= 0, got {self.check_layer}")

    def settings(self, lm) -> dict:
        """The check layer and share it runs (the bench JSON records them); a check layer past the model's last
        layer is refused, not moved to it."""
        if self.check_layer >= lm.config.num_layers:
            raise ConfigError(f"cacheblend: check_layer must be in [0, {lm.config.num_layers - 1}] for "
                              f"{lm.name!r} ({lm.config.num_layers} layers), got {self.check_layer}")
        return {"check_layer": self.check_layer, "ratio": self.ratio}

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        check = self.settings(lm)["check_layer"]
        reuse = collect_reuse(call, store, lm.fingerprint)
        num_layers = lm.config.num_layers

        def top_r(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> Kept:
            dev = value_l2_deviation(view, span_rows)
            keep = torch.zeros(span_rows.numel(), dtype=torch.bool, device=dev.device)
            num_keep = round(self.ratio * span_rows.numel())
            if num_keep:
                keep[dev.topk(num_keep).indices] = True
            return Kept(keep, num_keep)

        schedule = BandSchedule(reuse.new_idx(len(call.prompt_ids)), {0: Entry(reuse.approx_idx())}, check,
                                num_layers - 1, top_r)
        return Plan(schedule, reuse.loads, note=reuse.note)
