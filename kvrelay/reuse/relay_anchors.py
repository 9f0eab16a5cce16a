"""``relay_anchors`` (ours): relay whose span tokens first move by cross-call anchors, then relay repairs the rest.

Relay recomputes a few span tokens and leaves the others' K/V as stored; those K/V are off by how the new context
moves them. That move repeats across calls of the same pipeline (``move_pool``): a token the same agent reads in the
same place, whose stored key looks alike, moved alike. So each call of a role first runs as a dense prefill
(counted as a fallback) until the role has ``anchor_calls`` of them; ``observe`` records every span token's true
move in those. From then on a call loads its spans as relay does, adds ``anchor_scale`` x each span token's
estimated move (the ``anchor_k`` nearest index rows' moves, by their stored keys at ``anchor_layer``) to the loaded
K/V (a ``KVPatch``), and runs relay's band on top: its detection reads the deviation left after the anchors, and
the tokens it recomputes overwrite their anchored K/V. ``relay_anchors[l_start=L,l_det=L,l_end=L]`` (L the number
of layers: the empty band) computes no span token at all: naive plus anchors.

With ``anchor_select`` (budget form: ``top_r``), relay's score also ranks the span tokens by the squared move their
anchors are expected to miss (``MovePool.estimate_with_residual``: how far the tokens behind the mixed index rows
spread about the estimate). With ``selector=priors`` and ``l_det == l_start`` that is the only ranking, read before
the band runs: ``relay_anchors[l_start=2,l_det=2,l_end=T,top_r=0.02,l_pre=0,l_suf=0,selector=priors,anchor_select=1]``
(T the top layer) recomputes the 2% of span tokens the anchors estimate worst and costs no detection layer
(``research/relay_anchor_select.py``). With ``anchor_tau`` the band's size is set per
call instead: as many tokens as the anchors expect to miss more than ``anchor_tau`` (squared move), so a call whose
spans the anchors know well recomputes few and one they know badly recomputes more.

With ``anchor_blend`` = b > 0 the estimate is (1 - b) x the anchors' plus b x a ridge readout of the token's
stored K/V at a few layers and its place in its span (``move_readout``), fitted per role on the same learning calls
when the role's learning ends; its [tokens x features] by [features x moves] product suits spans prepared at
publish (``anchor_rank`` = r > 0 cuts it to r output directions: F x r + r x D a token). The tokens the band
recomputes are still ranked by the anchors' expected miss.

The anchors of a span depend only on it and on the role reading it, so they are made when the span is published
(``on_publish``, outside any call's TTFT) for the roles done learning that read spans of its kind, and kept for the
last ``anchor_prepare`` (span, role) pairs (``anchor_prep``): a call then loads such a span with its anchors already
added, as naive loads the stored one. A span published elsewhere (a shared tier's), or dropped from that set, gets
its anchors on the call, as with ``anchor_prepare=0``.

A role is the agent (its system prompt's ``CallInput.role``, else its name) and the placeholder the span fills
(``SpanRef.name``; the span's index among the call's approximate spans where the ref has no name, as for spans the
server finds by matching token runs). A call with any role still learning runs dense as a whole (and teaches only
the roles still learning). Learning stops once a role has its ``anchor_calls``: its pool (at most
``anchor_max_tokens`` tokens, the oldest calls dropped first; (1 + 2 L) x Hkv x hd x 2 bytes a token, and with
``anchor_blend`` (2 F Hkv hd + 2) x 2 more for the readout's features) is then frozen
into an index of at most ``anchor_centroids`` rows matched in ``anchor_dim`` dimensions (``MovePool.freeze``), built
after that last learning call rather than on a served one. Every relay knob works as in ``relay`` (the profile's
selector and band when none is given).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import expired_keys, key_namespace, namespace_of, scoped_key, unscoped_key
from kvrelay.errors import ConfigError
from kvrelay.model.lm import LoadedModel
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.reuse.anchor_prep import PreparedSpan, PreparedSpans, PrepareStats, anchored_span
from kvrelay.reuse.base import CallInput, KVPatch, Plan, SpanLoad
from kvrelay.reuse.move_pool import MovePool
from kvrelay.reuse.move_readout import MoveReadout, readout_features, readout_layers
from kvrelay.reuse.prefix import PrefixMethod
from kvrelay.reuse.relay import RelayMethod
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.devices import sync_device


@dataclass
class _Learn:
    """A dense prefill planned to teach the pool: the call's approximate spans and their roles."""

    approx: list[SpanLoad]
    roles: list[str]


def _positions(start: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + num_tokens, device=device)


def stored_keys_free(rope: RotaryEmbedding, span: StoredSpan, load: SpanLoad, device: torch.device,
                     layer: int | None = None) -> torch.Tensor:
    """The loaded tokens' stored keys with RoPE undone at the positions they were stored at, float32 on ``device``:
    [L, Hkv, n, hd], or one ``layer``'s [Hkv, n, hd] (float32 first: a bf16 span's keys would round twice)."""
    keys = span.k[:, :, load.src_start : load.src_end] if layer is None else \
        span.k[layer, :, load.src_start : load.src_end]
    src_pos = _positions(span.start_pos + load.src_start, load.num_tokens, device)
    return rope.shift_keys(keys.to(device, torch.float32), -src_pos, layer=layer)


@dataclass
class RelayAnchorsMethod(RelayMethod):
    anchor_calls: int = field(default=128, metadata={
        "help": "dense calls per role before its anchors are used (they teach the pool)"})
    anchor_max_tokens: int = field(default=32768, metadata={
        "help": "most pool tokens kept per role while it learns (the oldest calls' go first)"})
    anchor_k: int = field(default=8, metadata={"help": "nearest index rows mixed per span token"})
    anchor_temp: float = field(default=0.05, metadata={
        "help": "softmax temperature over the nearest rows' cosine similarities"})
    anchor_dim: int = field(default=32, metadata={
        "help": "match keys' dimensions: the features' top principal directions (0: the features)"})
    anchor_centroids: int = field(default=4096, metadata={
        "help": "most index rows per role: k-means clusters of its tokens (0: every token)"})
    anchor_layer: int | None = field(default=None, metadata={
        "help": "layer whose stored keys match tokens (None: the middle layer)"})
    anchor_scale: float = field(default=1.0, metadata={"help": "share of the estimated move added"})
    # budget form (needs top_r): add anchor_select x the mean-normalized move the anchors expect to miss
    # (``MovePool.estimate_with_residual``) to the score, so relay's band recomputes the tokens they estimate worst
    anchor_select: float | None = field(default=None, metadata={
        "help": "budget form (needs top_r): add this x the move the anchors expect to miss to the score"})
    # threshold form of the band's size (needs anchor_select): a call recomputes as many span tokens as its anchors
    # expect to miss more than this squared move (top_r's count replaced per call; the ranking stays the score's;
    # besides those always kept, l_pre and l_suf; a span whose role has no anchors expects to miss 0 and adds none)
    anchor_tau: float | None = field(default=None, metadata={
        "help": "recompute per call the span tokens the anchors expect to miss by more than this (with anchor_select)"})
    # the most (span, role) pairs kept with their anchors added when the span was published (``anchor_prep``: the
    # call then loads them as naive does); 0: every call computes its anchors itself
    anchor_prepare: int = field(default=16, metadata={
        "help": "most (span, role) pairs kept with their anchors added at publish (0: each call adds them)"})
    # share of the estimate from the ridge readout of the stored K/V (``move_readout``; 0: the anchors alone)
    anchor_blend: float = field(default=0.0, metadata={
        "help": "share of the estimate from the ridge readout of the stored K/V (0: the anchors alone)"})
    anchor_ridge: float = field(default=0.1, metadata={"help": "the readout's penalty, x its features' mean variance"})
    anchor_rank: int = field(default=0, metadata={"help": "the readout cut to this many output directions (0: whole)"})
    pool: MovePool | None = field(default=None, init=False, repr=False)
    readout: MoveReadout | None = field(default=None, init=False, repr=False)
    prepared: PreparedSpans | None = field(default=None, init=False, repr=False)
    # what preparing at publish cost and how the calls' spans were served; the bench's JSON reports it (``settings``)
    prepare_stats: PrepareStats = field(default_factory=PrepareStats, init=False, repr=False)
    name = "relay_anchors"
    stateful = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anchor_calls < 1 or self.anchor_max_tokens < 1 or self.anchor_k < 1:
            raise ConfigError("relay_anchors: anchor_calls, anchor_max_tokens and anchor_k must be >= 1")
        if self.anchor_dim < 0 or self.anchor_centroids < 0:
            raise ConfigError(f"relay_anchors: anchor_dim and anchor_centroids must be >= 0, got {self.anchor_dim}, "
                              f"{self.anchor_centroids}")
        if self.anchor_temp <= 0:
            raise ConfigError(f"relay_anchors: anchor_temp must be > 0, got {self.anchor_temp}")
        if not 0 <= self.anchor_scale <= 2:
            raise ConfigError(f"relay_anchors: anchor_scale must be in [0, 2], got {self.anchor_scale}")
        if self.anchor_select is not None and self.anchor_select < 0:
            raise ConfigError(f"relay_anchors: anchor_select must be >= 0, got {self.anchor_select}")
        if self.anchor_select and self.top_r is None:
            raise ConfigError("relay_anchors: anchor_select needs top_r (it adds to the budget form's score)")
        if self.anchor_select and self.anchor_k == 1 and self.anchor_centroids == 0:
            # one raw row per token and one row mixed: every estimate is a single token's move, expected to miss nothing
            raise ConfigError("relay_anchors: anchor_select ranks by how far the mixed rows' tokens spread, which is 0 "
                              "with anchor_k=1 over the raw pool (anchor_centroids=0): raise anchor_k or use clusters")
        if self.anchor_tau is not None and (not self.anchor_select or not self.anchor_tau > 0):
            raise ConfigError(f"relay_anchors: anchor_tau must be > 0 and needs anchor_select (it counts the tokens "
                              f"whose expected miss passes it), got anchor_tau={self.anchor_tau}")
        if self.anchor_prepare < 0:
            raise ConfigError(f"relay_anchors: anchor_prepare must be >= 0, got {self.anchor_prepare}")
        self.prepared = PreparedSpans(self.anchor_prepare)
        if not 0 <= self.anchor_blend <= 1:
            raise ConfigError(f"relay_anchors: anchor_blend must be in [0, 1], got {self.anchor_blend}")
        if not math.isfinite(self.anchor_ridge) or self.anchor_ridge <= 0 or self.anchor_rank < 0:
            raise ConfigError(f"relay_anchors: anchor_ridge must be > 0 and anchor_rank >= 0, got {self.anchor_ridge}, "
                              f"{self.anchor_rank}")
        if self.anchor_rank and not self.anchor_blend:
            raise ConfigError("relay_anchors: anchor_rank cuts the readout, which only anchor_blend > 0 uses")
        self.readout = MoveReadout(self.anchor_ridge, self.anchor_rank) if self.anchor_blend else None
        if self.anchor_layer is not None and self.anchor_layer < 0:
            raise ConfigError(f"relay_anchors: anchor_layer must be >= 0, got {self.anchor_layer}")

    def has_own_prior(self) -> bool:
        return bool(self.anchor_select)

    def _pool(self, lm) -> MovePool:
        if self.pool is None:
            layer = lm.config.num_layers // 2 if self.anchor_layer is None else self.anchor_layer
            if layer >= lm.config.num_layers:
                raise ConfigError(f"relay_anchors: anchor_layer {layer} >= the model's {lm.config.num_layers} layers")
            self.pool = MovePool(layer, self.anchor_max_tokens, self.anchor_k, self.anchor_temp, lm.model.device,
                                 self.anchor_dim, self.anchor_centroids)
        return self.pool

    def settings(self, lm) -> dict:
        out = super().settings(lm) | {"anchor_layer": self._pool(lm).match_layer}
        if self.prepare_stats.num_spans or self.prepare_stats.num_loads_prepared:
            out["prepared_at_publish"] = self.prepare_stats.summary()  # the anchors' time moved to publishing
        if self.readout is not None and self.readout.num_roles:
            out["readout"] = {"num_roles": self.readout.num_roles, "nbytes": self.readout.nbytes}
        return out

    @staticmethod
    def roles(call: CallInput, approx: list[SpanLoad]) -> list[str]:
        """Per approximate span: '<agent role or name>/<the placeholder it fills>', or '.../#<its index among the
        call's approximate spans>' where its ref has no name."""
        agent, out = call.role or call.name, []
        for i, load in enumerate(approx):
            ref = next((r for r in call.refs if r.start <= load.dst_start < r.end), None)
            out.append(f"{agent}/{ref.name}" if ref is not None and ref.name else f"{agent}/#{i}")
        return out

    def _estimate(self, role: str, span: StoredSpan, load: SpanLoad, lm
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The anchors' (K, V) moves [L, Hkv, n, hd] (keys without RoPE; layer 0 zero) of ``load``'s tokens of
        ``span`` as ``role`` reads them, scaled, and the squared move each is expected to miss [n] (where
        ``anchor_select`` reads it, else None). None: the role has no pool."""
        pool = self._pool(lm)
        # a tier's spans are on the CPU: the pool's device decides
        keys_free = stored_keys_free(lm.model.rope, span, load, pool.device, pool.match_layer)  # [Hkv, n, hd]
        estimate = pool.estimate_moves(role, keys_free, lm.config.num_layers, with_residual=bool(self.anchor_select))
        if estimate is None:
            return None
        k_move, v_move, residual = estimate  # [L, Hkv, n, hd] twice, [n] or None
        if self.readout is not None:
            k_move, v_move = self._blend(role, span, load, lm, k_move, v_move)
        if self.anchor_scale != 1:
            # a scaled estimate also misses (1 - scale) of itself (of the blended estimate where anchor_blend is set)
            if residual is not None:
                residual = residual + (1 - self.anchor_scale) ** 2 * (
                    torch.linalg.vector_norm(k_move, dim=(0, 1, 3)).square()
                    + torch.linalg.vector_norm(v_move, dim=(0, 1, 3)).square())
            k_move, v_move = self.anchor_scale * k_move, self.anchor_scale * v_move
        k_move[0], v_move[0] = 0, 0  # layer 0's K/V depend on token and position only
        return k_move, v_move, residual

    def _readout_features(self, span: StoredSpan, load: SpanLoad, lm, device: torch.device,
                          keys_free: torch.Tensor | None = None) -> torch.Tensor:
        """``readout_features`` of ``load``'s tokens of ``span`` [n, F], on ``device``. ``keys_free``: those tokens'
        stored keys without RoPE at every layer [L, Hkv, n, hd], where the caller has them (else undone here)."""
        rope, layers = lm.model.rope, readout_layers(lm.config.num_layers)
        keys = keys_free[list(layers)] if keys_free is not None else \
            torch.stack([stored_keys_free(rope, span, load, device, layer) for layer in layers])  # [F, Hkv, n, hd]
        values = span.v[list(layers), :, load.src_start : load.src_end].to(device)  # [F, Hkv, n, hd]
        return readout_features(keys, values, load.src_start, len(span))

    def _blend(self, role: str, span: StoredSpan, load: SpanLoad, lm, k_move: torch.Tensor, v_move: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 - anchor_blend) x the anchors' moves plus anchor_blend x the readout's, [L, Hkv, n, hd] each (the
        anchors' alone where the role has no readout)."""
        moves = self.readout.predict(role, self._readout_features(span, load, lm, self.pool.device))
        if moves is None:
            return k_move, v_move
        num_layers, hkv, hd = k_move.shape[0], k_move.shape[1], k_move.shape[3]
        both = moves.view(-1, 2 * num_layers, hkv, hd).permute(1, 2, 0, 3)  # [n, 2L Hkv hd] -> [2L, Hkv, n, hd]
        b = self.anchor_blend
        return (1 - b) * k_move + b * both[:num_layers], (1 - b) * v_move + b * both[num_layers:]

    def _forget_expired(self, store: KVStore | None) -> None:
        """Drop the pools, readouts and prepared spans of namespaces the store no longer holds (the roles of an
        expired tenant; ``cache.tenancy.expired_keys``)."""
        for role in expired_keys(self.pool.roles() if self.pool is not None else (), store):
            self.pool.drop(role)
            self.prepared.drop(role)
            if self.readout is not None:
                self.readout.drop(role)

    def _ready(self, role: str) -> bool:
        return self.pool is not None and self.pool.num_calls(role) >= self.anchor_calls

    def on_publish(self, span_id: str, span: StoredSpan, store: KVStore, lm: LoadedModel) -> None:
        """Prepare ``span`` with its anchors added for every role done learning that read spans of its kind
        (``anchor_prep``): its calls then load it as naive loads the stored span."""
        if not self.anchor_prepare or self.pool is None or not lm.model.rope.can_shift:
            return  # (a RoPE that cannot shift: the calls fall back to full prefill whatever is prepared)
        sync_device(self.pool.device)  # the time is the work's, not what was queued before it
        t0, num_role_tokens = time.perf_counter(), 0
        whole, namespace = SpanLoad(span_id, 0, len(span), span.start_pos), namespace_of(store)
        for role in self.prepared.roles_reading(span):
            if key_namespace(role) != namespace:  # another tenant's role: its anchors never touch this span
                continue
            if self._ready(role) and (estimate := self._estimate(role, span, whole, lm)) is not None:
                k_move, v_move, residual = estimate
                self.prepared.put(span_id, role, PreparedSpan(span, anchored_span(span, k_move, v_move, lm.model.rope),
                                                              residual))
                num_role_tokens += len(span)
        if num_role_tokens:
            sync_device(self.pool.device)
            self.prepare_stats.add_span(num_role_tokens, (time.perf_counter() - t0) * 1e3)

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        pool = self._pool(lm)
        reuse = collect_reuse(call, store, lm.fingerprint)
        namespace = namespace_of(store)  # a tenant's calls learn and read its own roles only
        roles = [scoped_key(namespace, role) for role in self.roles(call, reuse.approx)]
        learning = [r for r in roles if not self._ready(r)]
        if learning:
            plan = PrefixMethod().plan(call, store, lm)
            plan.fallback = (f"relay_anchors: role {unscoped_key(learning[0])!r} has {pool.num_calls(learning[0])} "
                             f"of its {self.anchor_calls} dense calls (anchor_calls); this one teaches it")
            plan.state = _Learn(reuse.approx, roles)
            return plan
        patches, derived, renamed = [], {}, {}
        # [num prompt tokens]: by prompt position, the squared move each span token's anchors are expected to miss
        missed = torch.zeros(len(call.prompt_ids), device=pool.device) if self.anchor_select else None
        for load, role in zip(reuse.approx, roles, strict=True):
            span = store.get(load.span_id)
            dst = slice(load.dst_start, load.dst_start + load.num_tokens)
            prepared = self.prepared.get(load.span_id, role, span)
            self.prepare_stats.count_load(prepared is not None)
            if prepared is not None:  # its anchors were added when it was published: load that span instead
                span_id = f"{load.span_id}@anchors:{unscoped_key(role)}"
                derived[span_id] = prepared.span
                renamed[load] = SpanLoad(span_id, load.src_start, load.src_end, load.dst_start)
                if missed is not None:
                    missed[dst] = prepared.residual[load.src_start : load.src_end].to(missed.device)
                continue
            estimate = self._estimate(role, span, load, lm)
            if estimate is None:
                continue
            k_move, v_move, residual = estimate
            # float32 and without RoPE: the cache rotates the key moves for their positions as it adds them (and
            # rounds once, to its own dtype)
            patches.append(KVPatch(load.dst_start, k_move, v_move, add=True, keys_without_rope=True))
            if missed is not None:
                missed[dst] = residual
        priors = {"anchor": (missed, self.anchor_select)} if missed is not None else None
        count_over = ("anchor", self.anchor_tau) if self.anchor_tau is not None and priors else None
        plan = self.plan_reuse(call, store, lm, reuse, priors, count_over)
        plan.patches.extend(patches)
        plan.loads = [renamed.get(load, load) for load in plan.loads]
        plan.derived.update(derived)
        return plan

    def observe(self, call: CallInput, plan: Plan, cache: SequenceKV, store: KVStore | None, lm) -> None:
        self._forget_expired(store)
        if not isinstance(plan.state, _Learn) or store is None:
            return
        pool, rope = self._pool(lm), lm.model.rope
        for load, role in zip(plan.state.approx, plan.state.roles, strict=True):
            if load.span_id not in store or pool.num_calls(role) >= self.anchor_calls:
                continue  # an evicted span teaches nothing; a role done learning has its index
            span = store.get(load.span_id)
            self.prepared.note_read(role, span)
            src = slice(load.src_start, load.src_end)
            dst = slice(load.dst_start, load.dst_start + load.num_tokens)
            device = pool.device  # float32 before RoPE is undone: a bf16 cache's keys would round twice
            stored_free = stored_keys_free(rope, span, load, device)  # [L, Hkv, n, hd]
            fresh_k = cache.k[:, :, dst].to(device, torch.float32)
            fresh_free = rope.shift_keys(fresh_k, -_positions(load.dst_start, load.num_tokens, device))
            v_move = cache.v[:, :, dst].to(device, torch.float32) - span.v[:, :, src].to(device, torch.float32)
            side = None if self.readout is None else self._readout_features(span, load, lm, device, stored_free)
            pool.add(role, stored_free[pool.match_layer], fresh_free - stored_free, v_move, side)
            if pool.num_calls(role) >= self.anchor_calls:
                if self.readout is not None:  # before freeze, which frees the rows it reads
                    self.readout.fit(role, *pool.rows(role))
                pool.freeze(role)  # its index is built here, after a learning call, not on a served one
