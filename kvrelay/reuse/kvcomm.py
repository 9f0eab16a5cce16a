"""``kvcomm`` (KVCOMM, NeurIPS'25, arXiv 2510.12872): reuse shared spans, add anchor-estimated offsets.

A prompt is template segments and placeholders (a task input, an upstream agent's output). For each
placeholder the method keeps an online anchor pool per agent (anchors.py), and per namespace: the
pools and templates one tenant's calls build serve that tenant's calls only (``cache.tenancy``). A
call is planned all-or-nothing:

- every placeholder needs ``warmup`` anchors at least as long as it, and the gate's softmax over
  their value distances must be decisive: normalized entropy <= ``gamma``; otherwise the call runs
  a dense prefill (after the store's exact prefix, as ``prefix`` does), counted as a fallback, and
  ``observe`` turns that prefill into one new anchor per placeholder (pools bounded by
  ``max_anchors``). The gate weighs anchors by softmax(-L2 norm of the whole value difference), as
  KVCOMM's public code does;
- the offsets are mixed with one softmax(-relative value distance / ``MIX_TEMPERATURE``) weight per
  anchor;
- ``short_anchors=true``: an anchor shorter than the placeholder still counts, for the tokens it has
  offsets for (the others' weights are renormalized past its end); placeholder tokens past every
  anchor are computed. Off, as published, only anchors at least as long as the placeholder count;
- when it passes, no span token is computed: each placeholder's stored KV is re-rotated to its
  new position and the weighted anchor offsets are added; the template segments (constant per
  agent) are taken from the agent's first dense prefill plus the offsets the anchors of the
  placeholder before them recorded. Only tokens in neither, and the last ``tail_tokens`` prompt
  tokens (default 1: the last one), are computed.

Key offsets are kept position-free (both sides rotated back to position 0) and re-rotated to the
new positions when applied, so an anchor learned at one position serves a placeholder at any other.
Layer 0 offsets are zero (K/V there depend on token and position only). Placeholders come from the
call's refs; when the gate passes, the store's exact prefix is not needed (the first template segment
covers it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import expired_keys, namespace_of, scoped_key, unscoped_key
from kvrelay.errors import ConfigError
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.schedule import StaticSchedule
from kvrelay.reuse.anchors import Anchor, AnchorPool, Distances, mix, normalized_entropy
from kvrelay.reuse.base import CallInput, KVPatch, Plan, ReuseMethod, SpanLoad, SpanRef, check_ref
from kvrelay.reuse.learned_budget import MAX_LEARNED_BYTES, LearnedBudget
from kvrelay.reuse.prefix import PrefixMethod


@dataclass
class TemplateSegment:
    """A template segment's KV from an agent's first dense prefill; keys rotated back to position 0."""

    token_ids: tuple[int, ...]
    k_rel: torch.Tensor  # [L, Hkv, m, hd]
    v: torch.Tensor  # [L, Hkv, m, hd]


@dataclass
class _Layout:
    """A call cut into template segments and placeholders: segs[j] precedes refs[j]; segs[-1] is the tail."""

    refs: list[SpanRef]
    segs: list[tuple[int, int]]  # [start, end) per template segment, len(refs) + 1 of them

    @classmethod
    def of(cls, call: CallInput) -> _Layout:
        refs = sorted(call.refs, key=lambda r: r.start)
        bounds = [0] + [x for r in refs for x in (r.start, r.end)] + [len(call.prompt_ids)]
        return cls(refs, list(zip(bounds[::2], bounds[1::2], strict=True)))


@dataclass
class _Decision:
    key: str
    anchors: list[Anchor]
    weights: torch.Tensor  # [A, 1, 1, n|1]: one per anchor (anchors.Distances.weights; n: a short anchor)
    seg_weights: torch.Tensor  # [A, 1, 1, 1]: for the template segment after the placeholder
    num_covered: int  # the placeholder's first tokens that some anchor has offsets for (the rest are computed)


# softmax(-relative value distance / MIX_TEMPERATURE) mixes the anchors' offsets. The distance is |v_new - v_anchor| /
# |v_new|, free of the model's scale: between different texts it clusters at 1.2-1.4 (~sqrt 2: near-orthogonal values)
# with a spread of ~0.1, so 0.01 makes a gap of a few hundredths decisive; 0.05 leaves most weight vectors near flat.
MIX_TEMPERATURE = 0.01
# A full pool evicts the least used of its this-many oldest anchors (KVCOMM's rule): a new anchor survives long enough
# to be used before it can go.
EVICT_WINDOW = 5


def _fallback_how(exact: Plan) -> str:
    """How a fallback prefills: the exact stored prefix is loaded as any method loads it (and counted as reused),
    only the rest is a dense prefill."""
    num_exact = sum(load.num_tokens for load in exact.loads)
    return f"exact prefix of {num_exact} tokens reused, the rest a dense prefill" if num_exact else "dense prefill"


@dataclass
class KVCommMethod(ReuseMethod):
    gamma: float = field(default=0.3, metadata={
        "help": "reuse only when the gate weights' entropy / log(#anchors) is at most this (0: one anchor takes all)"})
    # A placeholder with fewer eligible anchors forces a dense prefill. 2 as in the public code, which
    # makes any placeholder with at most one anchor of its length a new anchor.
    warmup: int = field(default=2, metadata={
        "help": "eligible anchors a placeholder needs before it is reused (fewer: a dense prefill that adds one)"})
    max_anchors: int = field(default=20, metadata={"help": "anchors kept per placeholder pool (KVCOMM's 20)"})
    # The last this-many prompt tokens are computed, whatever covers them (1: only the last, as KVCOMM does).
    # Estimated, the template's closing text right before the answer is in effect another problem's KV of
    # that text; 32 covers it on the fc3 workloads, at about half the speedup.
    tail_tokens: int = field(default=1, metadata={
        "help": "the prompt's last this-many tokens are computed, whatever covers them"})
    # Anchors shorter than the placeholder count for the tokens they cover; the tokens past every anchor are
    # computed. Off: a placeholder longer than all but warmup-1 anchors falls back, as in the public code.
    short_anchors: bool = field(default=False, metadata={
        "help": "anchors shorter than the placeholder count for the tokens they cover (the rest computed)"})
    max_learned_bytes: int = field(default=MAX_LEARNED_BYTES, metadata={
        "help": "bytes of templates and anchors kept over all agents; the least recently used agent of the tenant "
                "holding the most starts over (learned_budget.py)"})
    name = "kvcomm"
    stateful = True  # anchor pools fill as calls fall back
    pools: dict[str, AnchorPool] = field(default_factory=dict, init=False, repr=False)
    templates: dict[str, list[TemplateSegment]] = field(default_factory=dict, init=False, repr=False)
    # template key -> the pool keys of that agent; the bytes of both, per agent (``learned_budget``)
    agent_pools: dict[str, set[str]] = field(default_factory=dict, init=False, repr=False)
    budget: LearnedBudget = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ConfigError(f"kvcomm: need gamma >= 0, got {self.gamma}")
        if self.tail_tokens < 1:
            raise ConfigError(f"kvcomm: tail_tokens must be >= 1 (the last prompt token is computed), "
                              f"got {self.tail_tokens}")
        if self.warmup < 1 or self.max_anchors < self.warmup:
            raise ConfigError(f"kvcomm: need 1 <= warmup <= max_anchors, got warmup={self.warmup}, "
                              f"max_anchors={self.max_anchors}")
        self.budget = LearnedBudget(self.max_learned_bytes)

    @staticmethod
    def pool_key(call: CallInput, ref: SpanRef, namespace: str = "") -> str:
        """The pool of ``ref``'s placeholder in ``call``'s agent, in the namespace of the store the call runs on: a
        tenant's calls never read another's anchors or templates (``cache.tenancy.scoped_key``)."""
        return scoped_key(namespace, f"{call.name}/{ref.name or ref.span_id}")

    @staticmethod
    def template_key(call: CallInput, namespace: str = "") -> str:
        return scoped_key(namespace, call.name)

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())

    @property
    def learned_bytes(self) -> int:
        """Bytes of templates and anchors kept now, over all agents (at most ``max_learned_bytes``)."""
        return self.budget.num_bytes

    def reset(self) -> None:
        """Forget every template and anchor (e.g. a library loop over unrelated tasks): later calls fall back and
        learn again, as the first calls did."""
        self.pools.clear()
        self.templates.clear()
        self.agent_pools.clear()
        self.budget = LearnedBudget(self.max_learned_bytes)

    # ------------------------------------------------------------------ planning
    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        self.budget.touch(self.template_key(call, namespace_of(store)))
        layout = _Layout.of(call)
        decisions, reason = self._gate(call, layout, store)
        if reason is not None:  # the exact prefix is exact KV, so the anchors learned from it are too
            exact = PrefixMethod().plan(call, store, lm)
            return Plan(exact.schedule, exact.loads, state=layout,
                        fallback=f"kvcomm: {reason}; {_fallback_how(exact)} (+1 anchor per placeholder)")
        n, rope = len(call.prompt_ids), lm.model.rope
        computed_from = max(n - self.tail_tokens, 0)  # the prompt's tail is always computed
        loads, patches = [], []
        covered = torch.zeros(n, dtype=torch.bool)
        for ref, d in zip(layout.refs, decisions, strict=True):
            m = min(ref.end, computed_from, ref.start + d.num_covered) - ref.start  # tokens past it are computed
            if m <= 0:
                continue
            loads.append(SpanLoad(ref.span_id, ref.src_start, ref.src_start + m, ref.start))
            dk = rope.shift_keys(mix(d.weights, [a.dk for a in d.anchors], m), ref.start)
            patches.append(KVPatch(ref.start, dk, mix(d.weights, [a.dv for a in d.anchors], m), add=True))
            covered[ref.start : ref.start + m] = True
        for patch in self._template_patches(call, layout, decisions, rope, computed_from, namespace_of(store)):
            patches.append(patch)
            covered[patch.dst_start : patch.dst_start + patch.num_tokens] = True
        active = (~covered).nonzero().flatten()
        return Plan(StaticSchedule(active), loads, patches, state=decisions)

    def _gate(self, call: CallInput, layout: _Layout, store: KVStore | None
              ) -> tuple[list[_Decision], str | None]:
        """One decision per placeholder, or why the call falls back: every failing placeholder's reason,
        joined by "; " (a call can miss on several at once; the bench counts each reason)."""
        if not layout.refs:
            return [], "no placeholder to reuse"
        decisions, reasons, namespace = [], [], namespace_of(store)
        for ref in layout.refs:
            key = self.pool_key(call, ref, namespace)
            shown = unscoped_key(key)  # the reasons go to the namespace's own client: its keys, without the namespace
            if store is None or ref.span_id not in store:
                reasons.append(f"span {ref.span_id!r} of placeholder {shown!r} is not in the store")
                continue
            span = store.get(ref.span_id)
            check_ref(ref, call.prompt_ids, span.token_ids)
            pool = self.pools.get(key)
            anchors = (pool.anchors if self.short_anchors else pool.eligible(ref.num_tokens)) if pool else []
            if len(anchors) < self.warmup:
                num_pooled = len(pool.anchors) if pool else 0
                longer = "" if self.short_anchors else f" >= {ref.num_tokens} tokens"
                reasons.append(f"placeholder {shown!r} has {len(anchors)} of {self.warmup} anchors{longer} "
                               f"({num_pooled} pooled)")
                continue
            base_v = span.v[:, :, ref.src_start : ref.src_start + ref.num_tokens]
            dist = Distances.of(base_v, anchors)  # one pass over the pool
            weights = dist.weights(MIX_TEMPERATURE)  # [A, 1, 1, n|1]: n where a short anchor ends early
            # the gate: softmax(-L2) at temperature 1, as KVCOMM's public code gates (its predict_as_anchor); the norm
            # grows with the span, so the weights are near one-hot unless two anchors tie (e.g. the same text twice).
            # The reason names the gate's entropy, never distances to the pool's values: a server returns it to clients
            entropy = normalized_entropy(torch.softmax(-dist.l2(), dim=0))  # over [A]
            if entropy > self.gamma:
                reasons.append(f"placeholder {shown!r} anchor entropy {entropy:.2f} > gamma {self.gamma} "
                               f"({len(anchors)} anchors)")
                continue
            seg_weights = weights  # one weight per anchor for the template segment after the placeholder
            if weights.shape[-1] > 1:  # a short anchor weighs nothing past its end: the segment takes the plain mix
                seg_weights = torch.softmax(-dist.value_distances() / MIX_TEMPERATURE, dim=0)[:, None, None, None]
            num_covered = min(ref.num_tokens, max(a.num_tokens for a in anchors))
            decisions.append(_Decision(key, anchors, weights, seg_weights, num_covered))
        return (decisions, None) if not reasons else ([], "; ".join(reasons))

    def _template_patches(self, call: CallInput, layout: _Layout, decisions: list[_Decision],
                          rope: RotaryEmbedding, computed_from: int, namespace: str) -> list[KVPatch]:
        template = self.templates.get(self.template_key(call, namespace))
        if template is None or len(template) != len(layout.segs):
            return []
        patches = []
        for j, (start, end) in enumerate(layout.segs):
            base = template[j]
            m = min(end, computed_from) - start
            if m <= 0 or tuple(call.prompt_ids[start:end]) != base.token_ids:
                continue
            k_rel, v = base.k_rel[:, :, :m], base.v[:, :, :m]
            if j > 0:  # a segment after a placeholder moved with it: add its anchors' segment offsets
                d = decisions[j - 1]
                have = [i for i, a in enumerate(d.anchors) if a.seg_ids == base.token_ids and a.seg_dk is not None]
                if not have:
                    continue
                w = d.seg_weights[have] / d.seg_weights[have].sum(dim=0)
                seg_dk = mix(w, [d.anchors[i].seg_dk for i in have], m)
                seg_dv = mix(w, [d.anchors[i].seg_dv for i in have], m)
                k_rel, v = k_rel + seg_dk, v + seg_dv
                k = rope.shift_keys(k_rel, start)
            else:  # the first segment: same tokens, same positions, nothing before it -> exact
                k = rope.shift_keys(k_rel, start)
            patches.append(KVPatch(start, k, v, add=False))
        return patches

    # ------------------------------------------------------------------ learning
    def dense_plan(self, call: CallInput) -> Plan | None:
        """The plan of the call's fallback as ``plan`` records it (its ``_Layout``), so ``observe`` adds one anchor
        per placeholder from any dense prefill of the call (the quality guard's shadow ``full`` reference); a call
        without placeholders has nothing to learn from."""
        if not call.refs:
            return None
        return Plan(StaticSchedule(torch.arange(len(call.prompt_ids))), state=_Layout.of(call),
                    fallback="kvcomm: learning from a dense prefill of the call")

    def observe(self, call: CallInput, plan: Plan, cache: SequenceKV, store: KVStore | None, lm) -> None:
        self._forget_expired(store)
        if isinstance(plan.state, list):  # a reuse: credit the anchors with the weight they had
            for d in plan.state:
                per_anchor = d.weights.reshape(len(d.anchors), -1).mean(dim=1)
                for a, w in zip(d.anchors, per_anchor.tolist(), strict=True):
                    a.usage += w
            return
        if not isinstance(plan.state, _Layout):  # not planned here (e.g. turned into a full prefill upstream)
            return
        layout = plan.state  # a dense prefill: one new anchor per placeholder
        rope, namespace = lm.model.rope, namespace_of(store)
        template_key = self.template_key(call, namespace)
        if template_key not in self.templates:  # the agent's first dense prefill is its template base
            self.templates[template_key] = [
                TemplateSegment(tuple(call.prompt_ids[s:e]), rope.shift_keys(cache.k[:, :, s:e], -s).clone(),
                                cache.v[:, :, s:e].clone()) for s, e in layout.segs]
        template = self.templates[template_key]
        for j, ref in enumerate(layout.refs):
            if store is None or ref.span_id not in store:
                continue
            span = store.get(ref.span_id)
            check_ref(ref, call.prompt_ids, span.token_ids)
            src = slice(ref.src_start, ref.src_start + ref.num_tokens)
            dk, dv = self._offsets(rope, cache, ref.start, ref.end, span.k[:, :, src], span.v[:, :, src],
                                   span.start_pos + ref.src_start)
            anchor = Anchor(span.v[:, :, src].clone(), dk, dv)
            s, e = layout.segs[j + 1]
            seg_ids = tuple(call.prompt_ids[s:e])
            if e > s and len(template) == len(layout.segs) and template[j + 1].token_ids == seg_ids:
                base = template[j + 1]
                anchor.seg_ids = seg_ids
                anchor.seg_dk, anchor.seg_dv = self._offsets(rope, cache, s, e, base.k_rel, base.v, 0)
            pool_key = self.pool_key(call, ref, namespace)
            pool = self.pools.setdefault(pool_key, AnchorPool(self.max_anchors, min(EVICT_WINDOW, self.max_anchors)))
            pool.add(anchor)
            self.agent_pools.setdefault(template_key, set()).add(pool_key)
        self._account(template_key)

    def _account(self, template_key: str) -> None:
        """Count the agent's bytes in the budget; forget the agents it puts out."""
        num_bytes = sum(seg.k_rel.nbytes + seg.v.nbytes for seg in self.templates[template_key])
        num_bytes += sum(self.pools[key].nbytes for key in self.agent_pools.get(template_key, ()))
        for victim in self.budget.set(template_key, num_bytes):
            self.templates.pop(victim, None)
            for key in self.agent_pools.pop(victim, ()):
                self.pools.pop(key, None)

    def _forget_expired(self, store: KVStore | None) -> None:
        """Drop the pools and templates of namespaces the store no longer holds (``cache.tenancy.expired_keys``)."""
        for key in expired_keys(self.pools, store):
            del self.pools[key]
        for key in expired_keys(self.templates, store):
            del self.templates[key]
            self.agent_pools.pop(key, None)
            self.budget.forget(key)

    def _offsets(self, rope: RotaryEmbedding, cache: SequenceKV, start: int, end: int, base_k: torch.Tensor,
                 base_v: torch.Tensor, base_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets (real - base) of prompt positions [start, end) against base K/V rotated for base_pos; keys
        position-free (both rotated back to position 0)."""
        real_k, real_v = cache.k[:, :, start:end], cache.v[:, :, start:end]
        dk = rope.shift_keys(real_k, -start) - rope.shift_keys(base_k, -base_pos)
        dv = real_v - base_v
        dk[0] = 0  # layer 0: K/V depend on the token and its position only; any offset is float noise
        dv[0] = 0
        return dk.contiguous(), dv.contiguous()
