"""Cross-call anchors for span tokens: how similar tokens in the same role moved in earlier dense prefills.

A span token relayed into a new prompt keeps the K/V it had where it was stored; in the new context its true K/V differ
by a *move* (fresh - stored, keys with RoPE undone). Within one call the tokens a method recomputes say little about the
others' moves; across calls of the same pipeline the moves repeat: a token in the same role (the agent reading it, the
span's place in that agent's prompt) whose stored key looks alike moved alike (``research/relay_anchor_study.py``:
over 40 GSM8K train calls of SmolLM2, the moves of the 8 nearest tokens of the other problems explain 44% of the key
move and 32% of the value move at their best scale, against 5.5% and 2.5% for the mean move of the call's own top 5% of
span tokens by value deviation, the ones relay would recompute). ``MovePool`` keeps, per role, the stored keys at one
match layer and the true moves at every layer of the span tokens of the dense prefills it was shown, and estimates a new
token's move as the softmax-weighted mean of the moves of its ``top_k`` nearest index rows (cosine of all KV heads'
keys at the match layer; the same weights at every layer and head, so matching costs one [tokens x rows] product per
span).

More pooled calls match better (``research/relay_anchor_index.py``), but a bigger
pool costs more to search and to hold. So a role's pool is searched through an *index* (``MoveIndex``): the features
centered and projected on their top ``dim`` principal directions, and the tokens grouped into at most
``num_centroids`` spherical k-means clusters in that space, each carrying its members' mean move. ``freeze`` builds
a role's index once its learning is over and frees the raw tokens; ``dim=0`` and ``num_centroids=0`` search the raw
pool (unit-norm keys, every token).

Each index row also keeps how far its tokens' moves spread about its own (a cluster's members about their mean; 0 for
a single token), so an estimate knows what it is likely to miss: the mixed rows' tokens spread about the estimate by
sum_i w_i (spread_i + |move_i - estimate|^2) (``estimate_with_residual``). The tokens with the largest such residual
are the ones worth recomputing (``relay_anchors``' ``anchor_select``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KMEANS_ITERS = 12  # Lloyd steps; the clusters' share explained settles by then
KMEANS_CHUNK = 4096  # rows per step of the assignment and of the move sums (bounds their temporaries)


@dataclass
class MoveIndex:
    """What a role's estimates search: match keys and the moves they stand for. With ``basis`` (and ``mean``), a
    feature is matched by its centered projection on the basis; without, as it is."""

    keys: torch.Tensor  # [C, d] unit-norm match keys, float32
    moves: torch.Tensor  # [C, 2 * L * Hkv * hd] moves (a token's, or a cluster's mean), fp16
    mean: torch.Tensor | None = None  # [Hkv * hd] the features' mean, subtracted before projecting
    basis: torch.Tensor | None = None  # [Hkv * hd, d] their top principal directions
    # [C] float32: per row, its members' mean squared distance from its move (0 for a row of one token)
    spread: torch.Tensor | None = None
    move_sq: torch.Tensor | None = None  # [C] float32: per row, its move's squared norm

    def __post_init__(self) -> None:
        if self.spread is None:
            self.spread = torch.zeros(self.keys.shape[0], device=self.keys.device)
        if self.move_sq is None:
            self.move_sq = torch.cat([m.float().pow(2).sum(1) for m in self.moves.split(KMEANS_CHUNK)]) \
                if self.moves.shape[0] else torch.zeros(0, device=self.keys.device)

    def match(self, feat: torch.Tensor) -> torch.Tensor:
        """[n, d] unit-norm match keys of unit-norm features [n, Hkv * hd]."""
        if self.basis is None or self.mean is None:
            return feat
        return torch.nn.functional.normalize((feat - self.mean) @ self.basis, dim=-1)  # [n, F] -> [n, d]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.keys, self.moves, self.mean, self.basis, self.spread, self.move_sq)
                   if t is not None)


@dataclass
class _RolePool:
    feat: torch.Tensor  # [P, Hkv * hd] unit-norm match features, fp16
    moves: torch.Tensor  # [P, 2 * L * Hkv * hd]: each token's K then V moves at every layer, fp16
    call_lens: list[int] = field(default_factory=list)  # tokens per dense call kept, oldest first
    num_calls: int = 0  # dense calls seen, those dropped included
    index: MoveIndex | None = None  # built from feat and moves when first searched; reset by add
    frozen: bool = False  # the index is final and feat/moves are gone
    side: torch.Tensor | None = None  # [P, S] fp16: per token, what a caller keeps beside it (``add``'s ``side``)


def _group_sums(values: torch.Tensor, group: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the sum of its rows of ``values`` [P, d] and its row count: ([G, d], [G]). Summed in a fixed order
    (sorted rows, a float64 running sum) on every device: CUDA's ``index_add_`` adds in whatever order its atomics
    land, and k-means' assignments would then differ from run to run."""
    counts = torch.bincount(group, minlength=num_groups)  # [G]
    running = torch.cumsum(values[torch.argsort(group, stable=True)].double(), 0)  # [P, d], rows grouped
    running = torch.cat([running.new_zeros(1, values.shape[1]), running])  # [P + 1, d]
    ends = counts.cumsum(0)
    return (running[ends] - running[ends - counts]).float(), counts


def _kmeans(keys: torch.Tensor, num_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means of unit-norm ``keys`` [P, d] from ``num_clusters`` evenly spaced members, deterministic: an
    empty cluster is seeded again with the key its cluster fits worst (repeated tokens make duplicate seeds), so
    clusters stay empty only when fewer distinct keys exist. Returns (centroids [C, d] unit-norm, each key's cluster
    [P])."""
    pick = torch.linspace(0, keys.shape[0] - 1, num_clusters, device=keys.device).round().long()
    cent = keys[pick].clone()

    def assign() -> tuple[torch.Tensor, torch.Tensor]:  # each key's cluster and its cosine to it, [P] each
        best = [(chunk @ cent.T).max(-1) for chunk in keys.split(KMEANS_CHUNK)]
        return torch.cat([b.indices for b in best]), torch.cat([b.values for b in best])

    for _ in range(KMEANS_ITERS):
        assignment, fit = assign()
        sums, counts = _group_sums(keys, assignment, num_clusters)
        filled = counts > 0
        cent[filled] = torch.nn.functional.normalize(sums[filled], dim=-1)
        empty = (~filled).nonzero().squeeze(1)
        if empty.numel():
            worst = torch.sort(fit, stable=True).indices[: empty.numel()]  # the keys their clusters fit worst
            cent[empty[: worst.numel()]] = keys[worst]
    return cent, assign()[0]


class MovePool:
    """Per role, span tokens' stored keys at ``match_layer`` and their true K/V moves, on ``device``; at most
    ``max_tokens`` per role (the oldest calls' tokens go first; a single call larger than that is kept whole).
    Each pooled token takes (Hkv + 2 x L x Hkv) x hd x 2 bytes, plus its side row's S x 2, until ``freeze``; a
    frozen role keeps its index (``num_centroids`` rows at most). ``dim``: the match keys' dimensions (0: the
    features themselves); ``num_centroids``: the most index rows (0: one per token)."""

    def __init__(self, match_layer: int, max_tokens: int, top_k: int, temperature: float,
                 device: torch.device | str = "cpu", dim: int = 0, num_centroids: int = 0) -> None:
        if max_tokens < 1 or top_k < 1 or temperature <= 0 or dim < 0 or num_centroids < 0:
            raise ValueError(f"MovePool: need max_tokens >= 1, top_k >= 1, temperature > 0, dim >= 0, "
                             f"num_centroids >= 0; got {max_tokens}, {top_k}, {temperature}, {dim}, {num_centroids}")
        self.match_layer, self.max_tokens, self.top_k, self.temperature = match_layer, max_tokens, top_k, temperature
        self.dim, self.num_centroids = dim, num_centroids
        self.device = torch.device(device)
        self._roles: dict[str, _RolePool] = {}

    def roles(self) -> list[str]:
        return list(self._roles)

    def drop(self, role: str) -> None:
        """Forget ``role``'s pool and index (its namespace is gone)."""
        self._roles.pop(role, None)

    def num_calls(self, role: str) -> int:
        """How many dense calls taught ``role`` (counted even when their tokens have since been dropped)."""
        pool = self._roles.get(role)
        return pool.num_calls if pool else 0

    def num_tokens(self, role: str) -> int:
        """How many span tokens ``role``'s pool holds now (0 once frozen)."""
        pool = self._roles.get(role)
        return pool.feat.shape[0] if pool else 0

    def num_entries(self, role: str) -> int:
        """How many rows ``role``'s index has (its tokens, or its clusters); 0 before it is built."""
        pool = self._roles.get(role)
        return pool.index.keys.shape[0] if pool and pool.index else 0

    @property
    def nbytes(self) -> int:
        total = 0
        for p in self._roles.values():
            total += p.feat.nbytes + p.moves.nbytes + (p.side.nbytes if p.side is not None else 0)
            if p.index is not None:
                total += p.index.nbytes - (p.index.moves.nbytes if p.index.moves is p.moves else 0)
        return total

    def features(self, keys_free: torch.Tensor) -> torch.Tensor:
        """[n, Hkv * hd] unit-norm match features from position-free keys at the match layer, [Hkv, n, hd]."""
        feat = keys_free.to(self.device, torch.float32).transpose(0, 1).flatten(1)  # [Hkv, n, hd] -> [n, Hkv * hd]
        return torch.nn.functional.normalize(feat, dim=-1)

    def add(self, role: str, keys_free: torch.Tensor, k_move: torch.Tensor, v_move: torch.Tensor,
            side: torch.Tensor | None = None) -> None:
        """One dense call's span of ``role``: its stored keys without RoPE at the match layer [Hkv, n, hd] and its
        true moves at every layer, [L, Hkv, n, hd] each (keys without RoPE). ``side`` [n, S]: what the caller keeps
        per token beside them (kept and dropped with the token, read back by ``rows``; every call of a role gives it
        or none does)."""
        num_tokens = k_move.shape[2]
        both = torch.cat([k_move, v_move]).to(self.device).permute(2, 0, 1, 3)  # [2L, Hkv, n, hd] -> [n, 2L, Hkv, hd]
        feat, moves = self.features(keys_free).half(), both.reshape(num_tokens, -1).half()  # -> [n, 2 * L * Hkv * hd]
        side = None if side is None else side.to(self.device, torch.float16)
        if side is not None and side.shape[0] != num_tokens:
            raise ValueError(f"MovePool: side has {side.shape[0]} rows for {num_tokens} tokens")
        pool = self._roles.get(role)
        if pool is None:
            pool = self._roles[role] = _RolePool(feat, moves, side=side)
        else:
            if pool.frozen:
                raise ValueError(f"MovePool: role {role!r} is frozen (its learning is over)")
            if moves.shape[1] != pool.moves.shape[1]:
                raise ValueError(f"MovePool: role {role!r} holds moves of {pool.moves.shape[1]} values per token, "
                                 f"got {moves.shape[1]} (another model?)")
            if (side is None) != (pool.side is None) or (side is not None and side.shape[1] != pool.side.shape[1]):
                raise ValueError(f"MovePool: role {role!r}'s calls must all give side rows of one width, or none")
            pool.feat, pool.moves = torch.cat([pool.feat, feat]), torch.cat([pool.moves, moves])
            if side is not None:
                pool.side = torch.cat([pool.side, side])
        pool.call_lens.append(num_tokens)
        pool.num_calls += 1
        pool.index = None
        while pool.feat.shape[0] > self.max_tokens and len(pool.call_lens) > 1:
            drop = pool.call_lens.pop(0)
            pool.feat, pool.moves = pool.feat[drop:].clone(), pool.moves[drop:].clone()
            if pool.side is not None:
                pool.side = pool.side[drop:].clone()

    def rows(self, role: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``role``'s pooled tokens before ``freeze``: their side rows [P, S] (None if its calls gave none) and
        moves [P, 2 * L * Hkv * hd], fp16, row for row."""
        pool = self._roles[role]
        if pool.frozen:
            raise ValueError(f"MovePool: role {role!r} is frozen: its rows are gone")
        return pool.side, pool.moves

    def freeze(self, role: str) -> None:
        """End ``role``'s learning: build its index now (not on a served call) and free the raw tokens."""
        pool = self._roles[role]
        if pool.frozen:
            return
        self.index(role)
        pool.feat, pool.moves = pool.feat.new_empty(0, pool.feat.shape[1]), pool.moves.new_empty(0, pool.moves.shape[1])
        pool.side, pool.frozen = None, True

    def index(self, role: str) -> MoveIndex | None:
        """``role``'s index (built now if its pool changed since); None: no pool. Building it holds, besides the pool,
        float32 copies of the features [P, F] and the cluster sums of the moves [C, 2 L Hkv hd] (1 GB on an 8B
        Llama at 4,096 clusters)."""
        pool = self._roles.get(role)
        if pool is None:
            return None
        if pool.index is not None:
            return pool.index
        feat = pool.feat.float()  # [P, F]
        # at most P - 1 directions carry the centered features' spread; at dim >= F the features are matched as they
        # are (the projection would only rotate them)
        dim = min(self.dim, feat.shape[0] - 1)
        mean = basis = None
        if self.dim and 0 < dim < feat.shape[1]:
            mean = feat.mean(0)
            centered = feat - mean
            _, vectors = torch.linalg.eigh(centered.T @ centered)  # ascending eigenvalues; vectors [F, F]
            basis = vectors[:, -dim:].contiguous()  # [F, d]: the top d directions
            keys = torch.nn.functional.normalize(centered @ basis, dim=-1)  # [P, d]
        else:
            keys = feat
        if not self.num_centroids or keys.shape[0] <= self.num_centroids:
            index = MoveIndex(keys, pool.moves, mean, basis)
        else:
            cent, assignment = _kmeans(keys, self.num_centroids)
            sums = torch.zeros(self.num_centroids, pool.moves.shape[1], device=self.device)  # [C, 2 L Hkv hd]
            for rows, moves in zip(assignment.split(KMEANS_CHUNK), pool.moves.split(KMEANS_CHUNK), strict=True):
                sums.index_add_(0, rows, moves.float())
            counts = torch.bincount(assignment, minlength=self.num_centroids)
            filled = counts > 0
            means = (sums[filled] / counts[filled, None]).half()  # [C', 2 L Hkv hd]: each cluster's mean move
            row_of = torch.cumsum(filled.long(), 0) - 1  # a cluster's row among the filled ones
            row = row_of[assignment]  # [P]
            dist_sq = torch.cat([(moves.float() - means[rows].float()).pow(2).sum(1)  # [P]: from its cluster's mean
                                 for rows, moves in zip(row.split(KMEANS_CHUNK), pool.moves.split(KMEANS_CHUNK),
                                                        strict=True)])
            spread, _ = _group_sums(dist_sq.unsqueeze(1), row, means.shape[0])  # [C', 1]
            index = MoveIndex(cent[filled], means, mean, basis, spread.squeeze(1) / counts[filled])
        pool.index = index
        return index

    def estimate(self, role: str, keys_free: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The estimated (K, V) moves [L, Hkv, n, hd] (float32 on the pool's device, keys without RoPE) of a span of
        ``role`` whose stored keys without RoPE at the match layer are ``keys_free`` [Hkv, n, hd]: per token, the
        softmax(cos / temperature)-weighted mean of its ``top_k`` nearest index rows' moves. None: no pool."""
        out = self.estimate_moves(role, keys_free, num_layers, with_residual=False)
        return None if out is None else out[:2]

    def estimate_with_residual(self, role: str, keys_free: torch.Tensor, num_layers: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``estimate``'s (K, V) moves and, per token, the squared move the estimate is expected to miss [n] (float32):
        the tokens behind its rows, weighted as the rows are, spread about the estimate by
        sum_i w_i (spread_i + |move_i|^2) - |estimate|^2 (a mixture's variance). The tokens it misses most are the
        ones worth recomputing (``relay_anchors``' ``anchor_select``)."""
        return self.estimate_moves(role, keys_free, num_layers, with_residual=True)

    def estimate_moves(self, role: str, keys_free: torch.Tensor, num_layers: int, with_residual: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``estimate``'s (K, V) moves and ``estimate_with_residual``'s residual where ``with_residual`` asks for it
        (else None: its norms cost about as much as the match). None: no pool."""
        index = self.index(role)
        if index is None:
            return None
        hkv, hd = keys_free.shape[0], keys_free.shape[2]
        if index.moves.shape[1] != 2 * num_layers * hkv * hd:
            raise ValueError(f"MovePool: role {role!r} holds moves of {index.moves.shape[1]} values per token, not "
                             f"2 x {num_layers} layers x {hkv} heads x {hd}")
        sim = index.match(self.features(keys_free)) @ index.keys.T  # [n, C]
        top = sim.topk(min(self.top_k, index.keys.shape[0]), dim=-1)
        weight = torch.softmax(top.values / self.temperature, dim=-1)  # [n, k]
        mixed = torch.nn.functional.embedding_bag(top.indices, index.moves, per_sample_weights=weight.half(),
                                                  mode="sum").float()  # [n, 2 * L * Hkv * hd]
        residual = None
        if with_residual:
            expected_sq = (weight * (index.spread[top.indices] + index.move_sq[top.indices])).sum(-1)  # [n]
            residual = (expected_sq - torch.linalg.vector_norm(mixed, dim=1).square()).clamp(min=0)
        both = mixed.view(-1, 2 * num_layers, hkv, hd).permute(1, 2, 0, 3)  # -> [2L, Hkv, n, hd]
        return both[:num_layers], both[num_layers:], residual
