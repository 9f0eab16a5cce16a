"""``full``: prefill everything. The standard pipeline, and the fidelity reference."""

from __future__ import annotations

from kvrelay.cache.store import KVStore
from kvrelay.model.schedule import Schedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod


class FullMethod(ReuseMethod):
    name = "full"

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        return Plan(Schedule())
