"""Cross-call anchors for span tokens: how similar tokens in the same role moved in earlier dense prefills.

A span token relayed into a new prompt keeps the K/V it had where it was stored; in the new context its true K/V differ
by a *move* (fresh - stored, keys with RoPE undone). Within one call the tokens a method recomputes say little about the
others' moves; across calls of the same pipeline the moves repeat: a token in the same role (the agent reading it, the
span's place in that agent's prompt) whose stored key looks alike moved alike (``benchmarks/relay_anchor_study.py``:
over 40 GSM8K train calls of SmolLM2, the moves of the 8 nearest tokens of the other problems explain 44% of the key
move and 32% of the value move at their best scale, against 5.5% and 2.5% for the mean move of the call's own top 5% of
span tokens by value deviation, the ones relay would recompute). ``MovePool`` keeps, per role, the stored keys at one
match layer and the true moves at every layer of the span tokens of the dense prefills it was shown, and estimates a new
token's move as the softmax-weighted mean of its ``top_k`` nearest pool tokens' moves (cosine of all KV heads' keys at
the match layer; the same weights at every layer and head, so matching costs one [tokens x pool] product per span)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _RolePool:
    feat: torch.Tensor  # [P, Hkv * hd] unit-norm match features, fp16
    moves: torch.Tensor  # [P, 2 * L * Hkv * hd]: each token's K then V moves at every layer, fp16
    call_lens: list[int] = field(default_factory=list)  # tokens per dense call kept, oldest first
    num_calls: int = 0  # dense calls seen, those dropped included


class MovePool:
    """Per role, span tokens' stored keys at ``match_layer`` and their true K/V moves, on ``device``; at most
    ``max_tokens`` per role (the oldest calls' tokens go first; a single call larger than that is kept whole).
    Each pooled token takes (Hkv + 2 x L x Hkv) x hd x 2 bytes."""

    def __init__(self, match_layer: int, max_tokens: int, top_k: int, temperature: float,
                 device: torch.device | str = "cpu") -> None:
        if max_tokens < 1 or top_k < 1 or temperature <= 0:
            raise ValueError(f"MovePool: need max_tokens >= 1, top_k >= 1, temperature > 0; got {max_tokens}, "
                             f"{top_k}, {temperature}")
        self.match_layer, self.max_tokens, self.top_k, self.temperature = match_layer, max_tokens, top_k, temperature
        self.device = torch.device(device)
        self._roles: dict[str, _RolePool] = {}

    def num_calls(self, role: str) -> int:
        """How many dense calls taught ``role`` (counted even when their tokens have since been dropped)."""
        pool = self._roles.get(role)
        return pool.num_calls if pool else 0

    def num_tokens(self, role: str) -> int:
        """How many span tokens ``role``'s pool holds now."""
        pool = self._roles.get(role)
        return pool.feat.shape[0] if pool else 0

    @property
    def nbytes(self) -> int:
        return sum(p.feat.nbytes + p.moves.nbytes for p in self._roles.values())

    def features(self, keys_free: torch.Tensor) -> torch.Tensor:
        """[n, Hkv * hd] unit-norm match features from position-free keys at the match layer, [Hkv, n, hd]."""
        feat = keys_free.to(self.device, torch.float32).transpose(0, 1).flatten(1)  # [Hkv, n, hd] -> [n, Hkv * hd]
        return torch.nn.functional.normalize(feat, dim=-1)

    def add(self, role: str, keys_free: torch.Tensor, k_move: torch.Tensor, v_move: torch.Tensor) -> None:
        """One dense call's span of ``role``: its stored keys without RoPE at the match layer [Hkv, n, hd] and its
        true moves at every layer, [L, Hkv, n, hd] each (keys without RoPE)."""
        num_tokens = k_move.shape[2]
        both = torch.cat([k_move, v_move]).to(self.device).permute(2, 0, 1, 3)  # [2L, Hkv, n, hd] -> [n, 2L, Hkv, hd]
        feat, moves = self.features(keys_free).half(), both.reshape(num_tokens, -1).half()  # -> [n, 2 * L * Hkv * hd]
        pool = self._roles.get(role)
        if pool is None:
            pool = self._roles[role] = _RolePool(feat, moves)
        else:
            if moves.shape[1] != pool.moves.shape[1]:
                raise ValueError(f"MovePool: role {role!r} holds moves of {pool.moves.shape[1]} values per token, "
                                 f"got {moves.shape[1]} (another model?)")
            pool.feat, pool.moves = torch.cat([pool.feat, feat]), torch.cat([pool.moves, moves])
        pool.call_lens.append(num_tokens)
        pool.num_calls += 1
        while pool.feat.shape[0] > self.max_tokens and len(pool.call_lens) > 1:
            drop = pool.call_lens.pop(0)
            pool.feat, pool.moves = pool.feat[drop:].clone(), pool.moves[drop:].clone()

    def estimate(self, role: str, keys_free: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The estimated (K, V) moves [L, Hkv, n, hd] (float32 on the pool's device, keys without RoPE) of a span of
        ``role`` whose stored keys without RoPE at the match layer are ``keys_free`` [Hkv, n, hd]: per token, the
        softmax(cos / temperature)-weighted mean of its ``top_k`` nearest pool tokens' moves. None: no pool."""
        pool = self._roles.get(role)
        if pool is None:
            return None
        hkv, hd = keys_free.shape[0], keys_free.shape[2]
        if pool.moves.shape[1] != 2 * num_layers * hkv * hd:
            raise ValueError(f"MovePool: role {role!r} holds moves of {pool.moves.shape[1]} values per token, not "
                             f"2 x {num_layers} layers x {hkv} heads x {hd}")
        sim = self.features(keys_free) @ pool.feat.float().T  # [n, P]
        top = sim.topk(min(self.top_k, pool.feat.shape[0]), dim=-1)
        weight = torch.softmax(top.values / self.temperature, dim=-1)  # [n, k]
        mixed = torch.nn.functional.embedding_bag(top.indices, pool.moves, per_sample_weights=weight.half(),
                                                  mode="sum").float()  # [n, 2 * L * Hkv * hd]
        both = mixed.view(-1, 2 * num_layers, hkv, hd).permute(1, 2, 0, 3)  # -> [2L, Hkv, n, hd]
        return both[:num_layers], both[num_layers:]
