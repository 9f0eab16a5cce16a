"""How many prompt tokens the next prefill chunk gets: a cost budget per turn, learned online.

A chunk of prefill runs between two decode steps, so its time is the stall every running stream (and every
request waiting for its first token) sees. A fixed token count gives chunks whose time grows along a long
prompt: each token attends to every key before it, so a chunk late in an 8K prompt costs several times the
first. ``ChunkBudget`` sizes chunks by cost instead. It models a piece's time as

    ms = fixed + per_token * num_tokens + per_key * num_attended_keys

(``num_attended_keys``: the keys each computed token attends to, summed: the attention term), fitted by least
squares over the most recent pieces the worker actually ran, each coefficient >= 0. The budget of a turn is what
``max_tokens`` tokens cost at the start of a prompt (so ``--prefill-chunk-tokens`` keeps its meaning there), and a
chunk gets the most tokens whose predicted time fits it: fewer as the context grows, never fewer than
``min_tokens`` (a bad fit cannot crawl a prompt) and never more than ``max_tokens``. The budget is a ratio of
the model's own predictions, so it needs no per-model or per-machine constant: a machine that slows down evenly
keeps its chunk sizes. Before any measurement the model has no attention term (chunks of ``max_tokens``); one
outlier moves the fit at most by a bounded factor and leaves it with the window. Pure Python and numpy, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

WINDOW_PIECES = 64  # the pieces the fit reads: enough for a few long prompts, few enough to follow a change of load
MIN_FIT_PIECES = 4  # before this many, an observation is taken as measured (no clipping against the fit)
OUTLIER_RATIO = 3.0  # an observation counts at most this factor away from the fit's prediction
# (fixed, per_token, per_key) subsets tried by the fit, in order of preference on a tie: simplest first
_TERMS = ((1,), (0, 1), (1, 2), (0, 1, 2))


@dataclass(frozen=True)
class PieceCost:
    """One prefill piece as run: its tokens, the keys they attended to (summed) and its time. A piece of layers, or
    of a layer's rows, counts the tokens of a whole forward with its work (token-layers over the model's layers): not
    whole; its keys are the attention scores it computed (each row against every key up to its chunk's last
    position: a mask does not skip work), which for a piece of consecutive tokens deep in a prompt is about the
    same count."""

    num_tokens: float
    num_attended_keys: float
    ms: float


def attended_keys(positions: list[int]) -> int:
    """Keys attended to by tokens at these prompt positions (causal: position p attends to p + 1 keys)."""
    return sum(positions) + len(positions)


class ChunkBudget:
    """The chunk-size rule of the engine worker: ``observe`` what pieces cost, ask ``num_tokens`` for the next."""

    def __init__(self, max_tokens: int, min_tokens: int | None = None, window_pieces: int = WINDOW_PIECES) -> None:
        """``max_tokens``: a chunk at the start of a prompt (and at most); ``min_tokens`` (default an eighth of it):
        the least a chunk gets, whatever the fit says."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.min_tokens = max(1, max_tokens // 8) if min_tokens is None else min_tokens
        if not 1 <= self.min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [1, {max_tokens}], got {self.min_tokens}")
        if window_pieces < MIN_FIT_PIECES:
            raise ValueError(f"window_pieces must be >= {MIN_FIT_PIECES}, got {window_pieces}")
        self._pieces: deque[PieceCost] = deque(maxlen=window_pieces)
        self.coef_ms = (0.0, 1.0, 0.0)  # (fixed, per token, per attended key): the prior, linear in tokens

    @property
    def num_observed(self) -> int:
        return len(self._pieces)

    def predict_ms(self, num_tokens: float, num_attended_keys: float) -> float:
        fixed, per_token, per_key = self.coef_ms
        return fixed + per_token * num_tokens + per_key * num_attended_keys

    @property
    def turn_ms(self) -> float:
        """A turn's budget: what ``max_tokens`` tokens cost at the start of a prompt (positions 0..max-1)."""
        return self.predict_ms(self.max_tokens, attended_keys(list(range(self.max_tokens))))

    def observe(self, piece: PieceCost) -> None:
        """Learn from one piece the worker ran (an empty or untimed one is ignored)."""
        if piece.num_tokens < 1 or not piece.ms > 0:
            return
        ms = piece.ms
        if len(self._pieces) >= MIN_FIT_PIECES:  # one stall of the machine moves the fit a bounded step
            predicted = self.predict_ms(piece.num_tokens, piece.num_attended_keys)
            ms = min(max(ms, predicted / OUTLIER_RATIO), predicted * OUTLIER_RATIO)
        self._pieces.append(PieceCost(piece.num_tokens, piece.num_attended_keys, ms))
        self.coef_ms = _fit(list(self._pieces), self.coef_ms)

    def num_tokens(self, positions: list[int], budget_ms: float | None = None, least_tokens: int | None = None) -> int:
        """Tokens for the next piece, whose tokens would sit at ``positions`` (ascending, the next ones the prompt
        computes): the most whose predicted time fits ``budget_ms`` (default: a whole turn's), within
        [``least_tokens`` (default ``min_tokens``), ``max_tokens``] and never more than ``positions`` holds."""
        budget_ms = self.turn_ms if budget_ms is None else budget_ms
        least_tokens = self.min_tokens if least_tokens is None else least_tokens
        positions = positions[: self.max_tokens]
        keys = list(accumulate(p + 1 for p in positions))  # keys[n - 1]: keys attended by the first n tokens
        lo, hi = 0, len(positions)  # the most that fit lies in [lo, hi]; cost grows with n, so bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict_ms(mid, keys[mid - 1]) <= budget_ms:
                lo = mid
            else:
                hi = mid - 1
        return min(max(lo, least_tokens), len(positions))


def _fit(pieces: list[PieceCost], prior: tuple[float, float, float]) -> tuple[float, float, float]:
    """Non-negative least squares of relative error over ``pieces``: each subset of terms whose columns are
    independent on these pieces, the feasible one that fits best (the simplest on a tie); ``prior`` if none."""
    design = np.array([[1.0, p.num_tokens, p.num_attended_keys] for p in pieces])  # [m, 3]
    ms = np.array([p.ms for p in pieces])  # [m]
    rows = design / ms[:, None]  # relative error: a 10 ms piece counts as much as a 5 s one
    best, best_err = None, np.inf
    for terms in _TERMS:
        cols = rows[:, terms]  # [m, len(terms)]
        scale = np.abs(cols).max(axis=0)
        if np.any(scale == 0) or np.linalg.matrix_rank(cols / scale) < len(terms):
            continue
        sol, *_ = np.linalg.lstsq(cols / scale, np.ones(len(pieces)), rcond=None)
        sol = sol / scale
        if np.any(sol < 0) or sol[terms.index(1)] <= 0:
            continue
        err = float(np.sum((cols @ sol - 1.0) ** 2))
        if err < best_err * (1 - 1e-9):  # a later (richer) subset must fit strictly better
            coef = [0.0, 0.0, 0.0]
            for term, value in zip(terms, sol, strict=True):
                coef[term] = float(value)
            best, best_err = tuple(coef), err
    return best if best is not None else prior
