"""A linear readout of a span token's move from what its stored K/V say, per role: ``relay_anchors``' second estimate.

The anchors (``move_pool``) estimate a token's move from the moves of tokens whose stored key at one layer looked
alike. A ridge regression from the token's stored keys (RoPE undone) and values at a few layers (``readout_layers``)
and its place in its span, fitted per role on the same learning calls, explains about as much of the move, and partly
other parts of it: half of each explains 0.04-0.05 more of the key move and 0.03-0.04 more of the value move than
the anchors alone on held-out GSM8K calls (``research/relay_anchor_estimators.py``).
Its readout is a [tokens x features] by [features x moves] product (2,306 by 11,520 on SmolLM2: about 0.5 ms a
token on one CPU thread), affordable where a span's anchors are made at publish rather than on the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

READOUT_CHUNK = 4096  # pooled rows per step of the fit (bounds the float32 copies of fp16 rows)


def readout_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose stored K/V the readout reads: 2, 4, 8, the middle, three quarters and the top (SmolLM2's
    30 layers: 2, 4, 8, 15, 22, 29, the study's); on a smaller model those past its top become the top, once."""
    top = num_layers - 1
    picks = (2, 4, 8, num_layers // 2, (num_layers // 2 + top) // 2, top)
    return tuple(sorted({min(layer, top) for layer in picks}))


def place_features(first: int, num_tokens: int, span_len: int) -> torch.Tensor:
    """[n, 2]: log(1 + tokens before) and log(1 + tokens after) in its span of ``span_len`` tokens, for the
    ``num_tokens`` tokens from the span's ``first``: a token's place in the span, whatever part of it a call reads."""
    before = torch.arange(first, first + num_tokens, dtype=torch.float32)
    return torch.stack([torch.log1p(before), torch.log1p(span_len - 1 - before)], 1)


def readout_features(keys_free: torch.Tensor, values: torch.Tensor, first: int, span_len: int) -> torch.Tensor:
    """Per token, what the readout reads [n, 2 F Hkv hd + 2] (float32): its stored keys (RoPE undone) and values at
    the F readout layers, [F, Hkv, n, hd] each, every layer's unit-normed over heads and channels, then its place."""
    def per_layer(t: torch.Tensor) -> torch.Tensor:  # [F, Hkv, n, hd] -> [n, F, Hkv * hd] -> [n, F * Hkv * hd]
        return torch.nn.functional.normalize(t.float().permute(2, 0, 1, 3).flatten(2), dim=-1).flatten(1)

    place = place_features(first, keys_free.shape[2], span_len).to(keys_free.device)
    return torch.cat([per_layer(keys_free), per_layer(values), place], 1)


@dataclass
class Readout:
    """moves = (features - x_mean) @ weight + y_mean, the weight whole or as a product of two."""

    x_mean: torch.Tensor  # [F]
    weight: torch.Tensor  # [F, D], or [F, r] where ``out`` is set
    y_mean: torch.Tensor  # [D]
    out: torch.Tensor | None = None  # [r, D]: the output directions of a rank-r weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self.weight.device, torch.float32) - self.x_mean  # [n, F]
        if self.out is None:
            return torch.addmm(self.y_mean, xc, self.weight)
        return torch.addmm(self.y_mean, xc @ self.weight, self.out)  # [n, F] @ [F, r] @ [r, D]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.x_mean, self.weight, self.y_mean, self.out) if t is not None)


def fit_readout(x: torch.Tensor, y: torch.Tensor, lam: float, rank: int = 0) -> Readout:
    """Ridge regression with an intercept of moves ``y`` [P, D] on features ``x`` [P, F] (either may be fp16; read
    in row chunks), on their device; the normal equations in float64, since with few rows and a small penalty they
    are too ill-conditioned for float32 (the fit then hangs on the CPU's rounding); the readout is float32. The
    penalty is ``lam`` x the mean diagonal of the centered Gram matrix, a strength that does not depend on the
    features' scale. ``rank`` > 0: the weight is then cut to the
    ``rank`` output directions that carry most of its predictions' variance on ``x`` (the top right singular
    vectors of C^1/2 W, C the features' covariance), a readout of F x r + r x D products a token (0: whole)."""
    if x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ValueError(f"fit_readout: need as many feature rows as move rows, at least 1; got {x.shape[0]} and "
                         f"{y.shape[0]}")
    num_rows = x.shape[0]
    x_mean = sum(part.double().sum(0) for part in x.split(READOUT_CHUNK)) / num_rows  # [F]
    y_mean = sum(part.double().sum(0) for part in y.split(READOUT_CHUNK)) / num_rows  # [D]
    gram = x.new_zeros(x.shape[1], x.shape[1], dtype=torch.float64)  # [F, F]
    xty = x.new_zeros(x.shape[1], y.shape[1], dtype=torch.float64)  # [F, D]
    for xs, ys in zip(x.split(READOUT_CHUNK), y.split(READOUT_CHUNK), strict=True):
        xc = xs.double() - x_mean  # [c, F]
        gram.addmm_(xc.T, xc)
        xty.addmm_(xc.T, ys.double() - y_mean)
    ridge = lam * gram.diagonal().mean().clamp_min(1e-12)
    weight = torch.linalg.solve(gram + ridge * torch.eye(gram.shape[0], device=gram.device, dtype=gram.dtype),
                                xty)  # [F, D]
    x_mean32, y_mean32 = x_mean.float(), y_mean.float()
    if not 0 < rank < min(weight.shape):
        return Readout(x_mean32, weight.float(), y_mean32)
    values, vectors = torch.linalg.eigh(gram / num_rows)  # the features' covariance: [F], [F, F]
    cov_sqrt = (vectors * values.clamp_min(0).sqrt()) @ vectors.T  # [F, F]: C^1/2
    out = torch.linalg.svd(cov_sqrt @ weight, full_matrices=False)[2][:rank].contiguous()  # [r, D]
    return Readout(x_mean32, (weight @ out.T).float(), y_mean32, out.float())  # [F, D] @ [D, r] -> [F, r]


class MoveReadout:
    """Per role, a ``Readout`` from ``readout_features`` to the moves in ``MovePool``'s row layout (K then V at
    every layer), fitted once when the role's learning ends."""

    def __init__(self, lam: float, rank: int = 0) -> None:
        if lam <= 0 or rank < 0:
            raise ValueError(f"MoveReadout: need a ridge penalty > 0 and a rank >= 0, got {lam}, {rank}")
        self.lam, self.rank = lam, rank
        self._roles: dict[str, Readout] = {}

    def fit(self, role: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Fit ``role``'s readout from features ``x`` [P, F] and moves ``y`` [P, D] (``fit_readout``)."""
        self._roles[role] = fit_readout(x, y, self.lam, self.rank)

    def predict(self, role: str, x: torch.Tensor) -> torch.Tensor | None:
        """[n, D] float32 moves of tokens with features ``x`` [n, F]; None: ``role`` was never fitted."""
        readout = self._roles.get(role)
        return None if readout is None else readout(x)

    @property
    def num_roles(self) -> int:
        return len(self._roles)

    def roles(self) -> list[str]:
        return list(self._roles)

    def drop(self, role: str) -> None:
        """Forget ``role``'s readout (its namespace is gone)."""
        self._roles.pop(role, None)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._roles.values())
