"""Blocks that repeat inside themselves (``abab...``, a repeated table row): their period, and how far it goes on.

A block of ``B`` tokens has period ``p < B`` when each token equals the one ``p`` before it. Two equal blocks of
period ``p``, one in the prompt at ``i`` and one in a span at ``off``, go on matching exactly while both go on
repeating with period ``p``: a token ``j >= B`` after the block is the one ``p`` before it, on both sides, and
those matched already. So when the span's repeats stop ``a`` tokens after its block and the prompt's ``a_q``:

- ``a < a_q``: the run ends exactly at ``i + B + a`` (the span breaks the period, the prompt does not);
- ``a > a_q``: it ends exactly where the prompt's repeats stop;
- ``a == a_q``: both break there; the run goes on only if the tokens that break it are equal.

That is the period-1 rule (a run of one repeated token ends where the shorter side's repeats stop) for any
period below a block. Per member the index keeps ``a`` and the token that breaks the period (``END``: the span
ends first); per group its block's period (every member has the same block). Pure Python, no torch.
"""

from __future__ import annotations

from kvrelay.server.index_splits import END

__all__ = ["block_periods", "smallest_period"]


def smallest_period(ids: list[int] | tuple[int, ...], start: int, block_len: int) -> int:
    """The smallest period of ``ids[start:start + block_len]`` below ``block_len``, or 0 (none): prefix function."""
    fail = [0] * block_len
    k = 0
    for j in range(1, block_len):
        t = ids[start + j]
        while k and ids[start + k] != t:
            k = fail[k - 1]
        if ids[start + k] == t:
            k += 1
        fail[j] = k
    period = block_len - fail[-1]
    return period if period < block_len else 0


def block_periods(ids: list[int] | tuple[int, ...], block_len: int) -> list[tuple[int, int, int]]:
    """Per aligned block: (period, tokens after the block that go on with it, the token that breaks it or END);
    (0, -1, END) for a block with no period below ``block_len``. Linear: aligned blocks in one stretch of a period
    share its end (their overlap is longer than the period), so each stretch is walked once."""
    out = []
    m, b = len(ids), block_len
    last_period, last_end = 0, -1
    for off in range(0, m - b + 1, b):
        p = smallest_period(ids, off, b)
        if not p:
            out.append((0, -1, END))
            continue
        if p == last_period and last_end >= off + b:
            end = last_end
        else:
            end = off + b
            while end < m and ids[end] == ids[end - p]:
                end += 1
        last_period, last_end = p, end
        out.append((p, end - off - b, ids[end] if end < m else END))
    return out
