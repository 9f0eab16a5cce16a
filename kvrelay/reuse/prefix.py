"""``prefix``: exact prefix reuse, what vLLM's and SGLang's prefix caching give.

The longest stored prefix of the same model is loaded at its own positions (no re-rotation) and
never recomputed; the rest of the prompt is computed at every layer. At least the last prompt token
is recomputed, since its hidden state (not only its KV) is needed for the first-token logits.
"""

from __future__ import annotations

from kvrelay.cache.store import KVStore
from kvrelay.model.schedule import Schedule, SuffixSchedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod, SpanLoad


class PrefixMethod(ReuseMethod):
    name = "prefix"

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        ids = call.prompt_ids
        match = store.match_prefix(lm.fingerprint, ids) if store is not None else None
        num_reused = 0 if match is None else min(match.num_tokens, len(ids) - 1)
        if num_reused <= 0:
            return Plan(Schedule())
        return Plan(SuffixSchedule(num_reused), [SpanLoad(match.span_id, 0, num_reused, 0)])
