"""Learning from the shadow references: a finished shadow ``full`` prefill teaches the role's learning rungs.

A learning method (``ReuseMethod.stateful``: kvcomm's anchor pools) learns from its own dense prefills, the calls
it could not yet reuse on. In a server no warm-up flag feeds it, and a role the quality guard holds at a safe rung
never runs it at all, so it would stay cold. But the guard already runs a dense prefill of sampled calls: the shadow
``full`` reference, on the very same prompt ids. Its KV is what the method's own dense prefill of the call would
have computed, so the teacher hands it to every learning rung of the ladder as that rung's own dense call: the plan
the method records for a dense prefill of the call (``ReuseMethod.dense_plan``; kvcomm's layout of placeholders and
template segments), then ``observe`` with the shadow's cache. A role starts safe and its learning rungs earn
anchors from its shadows; when the guard tries such a rung it is warm.

Isolation: the method objects are the engine's (one per spec, as live calls run them); what they learn is keyed by
the namespace of the store they observe through, and the teacher observes through the shadow's own namespace view,
so one tenant's shadows never teach another's state. A rung the live call itself ran is skipped: it observed its own
prefill already, and the same call twice would make two tied anchors (kvcomm's gate refuses ties).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine import Engine
from kvrelay.reuse import CallInput, ReuseMethod

log = logging.getLogger("kvrelay.server")


class ShadowTeacher:
    """Teaches the learning rungs of a ladder from shadow references. ``view(namespace)``: the store as that
    namespace sees it (the catalog's ``view``)."""

    def __init__(self, engine: Engine, rung_specs: Iterable[str | ReuseMethod], view: Callable[[str], Any]) -> None:
        self.engine, self.view = engine, view
        methods: list[ReuseMethod] = []
        for spec in rung_specs:
            method = engine.method(spec)  # the object live calls of that rung run
            if method.stateful and all(method is not m for m in methods):
                methods.append(method)
        self.methods = tuple(methods)
        self.num_taught = 0  # (shadow, method) lessons given
        self.num_failed = 0  # lessons that raised (the shadow is measured all the same)
        self.teach_ms = 0.0  # their time, also counted in each shadow's cost_ms

    def teach_safely(self, namespace: str, call: CallInput, cache: SequenceKV,
                     live_method: ReuseMethod | None) -> float:
        """``teach``, where a lesson that raises is logged and counted, never a reason to lose the shadow's
        measurement: the guard's samples of a role must not depend on a learning rung coping with its calls."""
        start_s = time.perf_counter()
        try:
            return self.teach(namespace, call, cache, live_method)
        except Exception:
            log.exception("a learning rung's lesson from a shadow reference failed; the shadow is still measured")
            self.num_failed += 1
            return (time.perf_counter() - start_s) * 1e3

    def teach(self, namespace: str, call: CallInput, cache: SequenceKV, live_method: ReuseMethod | None) -> float:
        """Hand the shadow's dense ``cache`` of ``call`` (every prompt token's K/V) to each learning rung but the
        live call's own, in ``namespace``; returns the time it took, in ms. An error propagates (``teach_safely``
        catches and counts it)."""
        if not self.methods:
            return 0.0
        start_s = time.perf_counter()
        store = self.view(namespace)
        for method in self.methods:
            if method is live_method:
                continue
            plan = method.dense_plan(call)
            if plan is None:
                continue
            method.observe(call, plan, cache, store, self.engine.lm)
            self.num_taught += 1
        elapsed_ms = (time.perf_counter() - start_s) * 1e3
        self.teach_ms += elapsed_ms
        return elapsed_ms
