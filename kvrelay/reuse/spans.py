"""What a call can reuse: the exact stored prefix, then every known span (refs) after it.

Shared by every method that reuses more than the prefix: they differ only in how they repair the
approximate spans (the refs), never in what they load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.cache.store import KVStore
from kvrelay.reuse.base import CallInput, SpanLoad, check_ref


@dataclass
class ReusePlan:
    loads: list[SpanLoad] = field(default_factory=list)
    prefix_len: int = 0  # tokens [0, prefix_len) are exact (same tokens, same positions, same context)
    approx: list[SpanLoad] = field(default_factory=list)  # the other loads: moved and/or in a new context
    missing: list[str] = field(default_factory=list)  # span ids of refs the store does not hold (computed instead)

    @property
    def note(self) -> str | None:
        """What the stats should say of the missing spans: without it a ref to an evicted or mistyped span id reads
        the same as a call with nothing to reuse."""
        if not self.missing:
            return None
        names = ", ".join(repr(span_id) for span_id in dict.fromkeys(self.missing))
        return f"span {names} not in the store (never published, or evicted): its tokens were computed"

    def new_idx(self, num_tokens: int) -> torch.Tensor:
        """Prompt indices with no reused KV (computed at every layer); the last token is always here."""
        new = torch.ones(num_tokens, dtype=torch.bool)
        for load in self.loads:
            new[load.dst_start : load.dst_start + load.num_tokens] = False
        return new.nonzero().flatten()

    def approx_idx(self) -> torch.Tensor:
        ranges = [torch.arange(ld.dst_start, ld.dst_start + ld.num_tokens) for ld in self.approx]
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.long)


def collect_reuse(call: CallInput, store: KVStore | None, fingerprint: str, use_prefix: bool = True) -> ReusePlan:
    n = len(call.prompt_ids)
    plan = ReusePlan()
    if store is None:
        plan.missing = [ref.span_id for ref in call.refs]
        return plan
    if use_prefix:
        match = store.match_prefix(fingerprint, call.prompt_ids)
        if match is not None and min(match.num_tokens, n - 1) > 0:
            plan.prefix_len = min(match.num_tokens, n - 1)
            plan.loads.append(SpanLoad(match.span_id, 0, plan.prefix_len, 0))
    loaded_end = plan.prefix_len  # positions below it are loaded already
    for ref in sorted(call.refs, key=lambda r: r.start):
        if ref.span_id not in store:  # evicted or never published: its tokens are simply new
            plan.missing.append(ref.span_id)
            continue
        check_ref(ref, call.prompt_ids, store.get(ref.span_id).token_ids)
        # refs that overlap: each position loads once, from the first; a ref cut short (here or by the exact
        # prefix) is a span of its own from its first loaded token, which is its opening for relay and epic
        start = max(ref.start, loaded_end)
        end = min(ref.end, n - 1)  # the last token is always computed
        if start >= end:
            continue
        load = SpanLoad(ref.span_id, ref.src_start + (start - ref.start), ref.src_start + (end - ref.start), start)
        plan.loads.append(load)
        plan.approx.append(load)
        loaded_end = end
    return plan
