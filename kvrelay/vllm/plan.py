"""What a vLLM request loads from kvrelay's spans: the prefix of uncomputed prompt tokens the connector claims.

Pure Python, no torch: it runs in vLLM's scheduler for every new request.

vLLM's connector API lets a connector claim only a *prefix* of the tokens vLLM has not computed itself:
``get_num_new_matched_tokens`` answers N, and vLLM then treats prompt tokens ``[num_computed, num_computed + N)``
as computed and prefills the rest. kvrelay's matcher finds reusable runs anywhere in the prompt, so the claim is
built from the runs that start at or after ``num_computed``: the claim covers the runs up to some end ``E``, and
every claimed token that no run covers (a gap between two runs: chat framing, a changed word) or that the repair
method recomputes (EPIC's first tokens of each moved run) is computed by the connector itself, in the worker,
with vLLM's own weights. ``E`` is the run end that saves the most: tokens loaded minus tokens the connector
computes (a run past a long gap does not pay for the gap). The last prompt token is never claimed: vLLM needs
one token to compute for the first output's logits.

A run that sits at its span's own positions with the same tokens before it (the stored call's exact prefix) is
exact: same tokens, same positions, same context; it is never recomputed. Every other run is moved or in a new
context: the method decides which of its tokens are recomputed (``naive``: none, ``epic``: the first ``k``).

``cacheblend`` and ``relay`` choose which span tokens to recompute, layer by layer, from what the new tokens' attention
and the fresh values show (``SCHEDULED_METHODS``): their choice needs every prompt token's state, so the connector runs
the method's whole scheduled prefill over the prompt (``worker``, ``methods``) and claims every token but the last:
vLLM then computes only the last, on top of the K/V the method wrote. The claim is all or nothing: it is made only
when the span tokens loaded outnumber the tokens the connector computes at every layer (gaps and the new tail),
else vLLM prefills the prompt itself. Their ``recompute`` lists the tokens computed at
every layer (gaps and new tokens); the span tokens the method repairs inside its band are counted by the load
(``LoadResult.num_token_layers``), as they are chosen only there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.errors import ConfigError

STATIC_METHODS = ("naive", "epic")  # a fixed set of positions at every layer: the fast forward (``forward``)
SCHEDULED_METHODS = ("cacheblend", "relay")  # the method's own schedule over the whole prompt (``methods``)
CONNECTOR_METHODS = STATIC_METHODS + SCHEDULED_METHODS


def method_name(spec: str) -> str:
    """The name of a method spec (``relay[keep_share=0.2]`` -> ``relay``)."""
    return spec.split("[", 1)[0].strip()


@dataclass(frozen=True)
class Piece:
    """Prompt positions [dst_start, dst_start + num_tokens) hold tokens [src_start, ...) of a stored span."""

    span_id: str
    src_start: int
    dst_start: int
    num_tokens: int
    exact: bool  # same positions and same tokens before: the stored K/V is what a full prefill computes

    @property
    def dst_end(self) -> int:
        return self.dst_start + self.num_tokens


@dataclass
class LoadPlan:
    """Prompt tokens [num_computed, end) written by the connector: the pieces loaded, the rest computed."""

    num_computed: int  # tokens vLLM has already (its own prefix cache)
    end: int
    pieces: list[Piece] = field(default_factory=list)
    # prompt positions in [num_computed, end) the connector computes (gaps and repaired tokens), ascending
    recompute: list[int] = field(default_factory=list)
    # prompt tokens the connector's forward runs over: ``end``, or the whole prompt for a scheduled method (it needs
    # the last tokens' attention to choose; their K/V past ``end`` are vLLM's to write)
    run_end: int = 0

    def __post_init__(self) -> None:
        self.run_end = max(self.run_end, self.end)

    @property
    def num_claimed(self) -> int:
        return self.end - self.num_computed

    @property
    def num_loaded(self) -> int:
        """Claimed tokens whose K/V come from a stored span as it is (not recomputed)."""
        return self.num_claimed - len(self.recompute)


@dataclass(frozen=True)
class Run:
    """A run the matcher found: prompt [start, end) equals tokens [src_start, ...) of ``span_id``."""

    start: int
    end: int
    span_id: str
    src_start: int


def plan_load(prompt_ids: list[int] | tuple[int, ...], num_computed: int, runs: list[Run],
              span_tokens: Callable[[str], tuple[int, ...]], method: str = "epic", epic_k: int = 16,
              min_tokens: int = 16) -> LoadPlan | None:
    """The claim for a prompt of which vLLM computed ``num_computed`` tokens, from the matcher's ``runs``
    (non-overlapping, any order); None when claiming nothing saves anything.

    ``span_tokens(span_id)`` gives a span's token ids (to tell an exact prefix from a moved run)."""
    method = method_name(method)
    if method not in CONNECTOR_METHODS:
        raise ConfigError(f"kvrelay connector: method must be one of {', '.join(CONNECTOR_METHODS)}, got {method!r}")
    limit = len(prompt_ids) - 1  # the last prompt token is vLLM's to compute
    pieces: list[Piece] = []
    for run in sorted(runs, key=lambda r: r.start):
        start, end = max(run.start, num_computed), min(run.end, limit)
        if end - start < min_tokens:
            continue
        src_start = run.src_start + (start - run.start)
        exact = run.start == run.src_start and tuple(span_tokens(run.span_id)[: run.start]) == tuple(
            prompt_ids[: run.start])
        pieces.append(Piece(run.span_id, src_start, start, end - start, exact))
    best_end, best_gain, cursor, loaded, computed = 0, 0, num_computed, 0, 0
    for piece in pieces:
        computed += piece.dst_start - cursor  # the gap before it
        # a scheduled method repairs a share of a piece's tokens in its band of layers: not tokens of every layer
        repaired = min(epic_k, piece.num_tokens) if method == "epic" and not piece.exact else 0
        computed += repaired
        loaded += piece.num_tokens - repaired
        cursor = piece.dst_end
        if loaded - computed > best_gain:
            best_end, best_gain = cursor, loaded - computed
    if best_gain <= 0:
        return None
    if method in SCHEDULED_METHODS:
        plan = _scheduled(prompt_ids, num_computed, pieces)
        # all or nothing: the connector's forward computes every gap and the whole new tail at every layer (the
        # prompt's last token too, ``run_end``), in one synchronous pass outside vLLM's chunked prefill; it pays only
        # when it loads more than that
        return plan if plan.num_loaded > len(plan.recompute) + plan.run_end - plan.end else None
    chosen = [p for p in pieces if p.dst_end <= best_end]
    plan = LoadPlan(num_computed, best_end, chosen)
    cursor = num_computed
    for piece in chosen:
        plan.recompute.extend(range(cursor, piece.dst_start))
        if not piece.exact and method == "epic":
            plan.recompute.extend(range(piece.dst_start, piece.dst_start + min(epic_k, piece.num_tokens)))
        cursor = piece.dst_end
    return plan


def _scheduled(prompt_ids: list[int] | tuple[int, ...], num_computed: int, pieces: list[Piece]) -> LoadPlan:
    """A scheduled method's claim: every token but the last, its forward over the whole prompt. Every piece is taken:
    the tokens between them are computed by the connector's forward anyway, as new tokens the method attends from;
    the caller weighs the whole claim (loaded against computed, tail included)."""
    limit = len(prompt_ids) - 1
    plan = LoadPlan(num_computed, limit, list(pieces), run_end=len(prompt_ids))
    cursor = num_computed
    for piece in pieces:
        plan.recompute.extend(range(cursor, piece.dst_start))
        cursor = piece.dst_end
    plan.recompute.extend(range(cursor, limit))
    return plan
