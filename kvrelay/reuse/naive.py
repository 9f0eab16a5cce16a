"""``naive``: reuse every known span, only re-rotated to its new position, no repair.

The lower bound of quality: spans computed in another context are taken as they are.
"""

from __future__ import annotations

from kvrelay.cache.store import KVStore
from kvrelay.model.schedule import StaticSchedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod
from kvrelay.reuse.spans import collect_reuse


class NaiveMethod(ReuseMethod):
    name = "naive"

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        reuse = collect_reuse(call, store, lm.fingerprint)
        return Plan(StaticSchedule(reuse.new_idx(len(call.prompt_ids))), reuse.loads, note=reuse.note)
