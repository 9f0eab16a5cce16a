"""A prefill's state between layers: its active set (``ActiveSet``), how far its forward has run (``LayerForward``)
and, for a layer run in chunks of its rows, how far that layer has run (``PartialLayer``).

A schedule that selects tokens as it goes (CacheBlend's and RelayCaching's band, RKSC's exit) needs every token's
state at its selecting layer, so its prefill cannot run as pieces of tokens through all layers. It runs as pieces of
layers: the forward stops after any layer and resumes at the next with the same active set, hidden states and
schedule, so the pieces run the very operations of one forward, in the same order (``Transformer.prefill_layers``).

A layer too costly for one piece runs as chunks of its ROWS (``kvrelay.model.row_chunks``): the active set is sorted
by position, so under causal attention rows [a, b) need the layer's K/V of positions up to the chunk's last only,
which are either inactive tokens (their K/V already in the cache) or rows of earlier chunks (written by them). A
selecting layer first projects its rows chunk by chunk, selects once every row's Q/K/V is in, then runs the kept rows'
attention and MLP chunk by chunk. The results equal one forward's up to float rounding (a matmul over fewer rows may
round differently), where pieces of whole layers are bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from kvrelay.errors import ScheduleError
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.schedule import Entry, Schedule

if TYPE_CHECKING:
    from kvrelay.cache.kv import SequenceKV


def drops(kept: torch.Tensor | None, num_active: int) -> bool:
    """Whether a schedule's kept rows leave out some of the ``num_active`` tokens (from their shape: no GPU wait)."""
    if kept is None:
        return False
    if kept.dtype == torch.bool:  # a mask's length says nothing of what it keeps
        raise ScheduleError("a schedule returned a keep mask where the kept rows belong (schedule.rows_of)")
    return kept.numel() != num_active


def num_scores(num_rows: int, num_keys: int) -> int:
    """The attention scores a chunk of ``num_rows`` rows computes against ``num_keys`` keys, where causality is a
    mask: every one of them (a mask hides scores, it does not skip their work: on CPU, rows spread over positions
    0..n cost what as many rows at the end do). What a layer's, or a chunk's, attention costs, for pricing it."""
    return num_rows * num_keys


def projection_share(config) -> float:
    """What a row's Q/K/V projection costs as a share of a whole layer's row (its projections, output projection and
    MLP: the weights a row multiplies through, from ``config``'s shapes). A selecting layer's rows are projected before
    it chooses, and a dropped one costs only that; the kept ones then cost the rest."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = hidden * (config.num_heads + 2 * config.num_kv_heads) * head_dim
    return qkv / (qkv + config.num_heads * head_dim * hidden + 3 * hidden * config.intermediate_size)


def keep_rows(kept: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows ``kept`` ([m] int64, ascending) of each tensor (dim 0): ``index_select`` is several times faster on
    CPU than indexing by a mask."""
    return tuple(t.index_select(0, kept) for t in tensors)


class ActiveSet:
    """A prefill's active tokens (prompt indices [n_act] ascending, hidden states [n_act, hidden]) and, per (rope,
    window), what attention needs of the set: [causal, mask (built on first use), cos, sin], rebuilt only when the
    set changes."""

    def __init__(self, n: int, tables: dict, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.n, self.tables = n, tables  # tables: rope -> its cos, sin of positions 0..n-1
        self.idx = torch.empty(0, dtype=torch.long, device=device)
        self.h = torch.empty(0, hidden_size, dtype=dtype, device=device)
        self._views: dict = {}

    def _changed(self) -> None:
        self._views = {}

    def join(self, idx: torch.Tensor, new_h: torch.Tensor) -> None:
        self.idx, order = torch.sort(torch.cat([self.idx, idx]))
        self.h = torch.cat([self.h, new_h.to(self.h.device, self.h.dtype)]).index_select(0, order)
        self._changed()

    def update(self, idx: torch.Tensor, h: torch.Tensor, changed: bool) -> None:
        self.idx, self.h = idx, h
        if changed:
            self._changed()

    def keep(self, kept: torch.Tensor | None) -> None:
        """Keep the rows a schedule hook returned (None: all)."""
        if drops(kept, self.idx.numel()):
            self.idx, self.h = keep_rows(kept, self.idx, self.h)
            self._changed()

    def holds_last(self) -> bool:
        """Whether the prompt's last token is active (the one whose logits a prefill gives)."""
        return self.idx.numel() > 0 and int(self.idx[-1]) == self.n - 1

    def view(self, rope: RotaryEmbedding, window: int | None) -> list:
        if (rope, window) not in self._views:
            n, n_act = self.n, self.idx.numel()
            # rows 0..n-1 against keys 0..n-1: SDPA's own causal mask; any other mask is built on first use (a
            # selecting layer that drops tokens needs one for the kept tokens only)
            self._views[rope, window] = [n_act == n and (window is None or n <= window), None,
                                         self.tables[rope][0].index_select(0, self.idx),
                                         self.tables[rope][1].index_select(0, self.idx)]
        return self._views[rope, window]


@dataclass
class LayerForward:
    """A prefill stopped between two layers: ``Transformer.begin_prefill`` makes it, ``prefill_layers`` runs it on
    (a range of layers at a time), ``finish_prefill`` gives its result."""

    token_ids: torch.Tensor  # [n] on the model's device
    cache: SequenceKV
    schedule: Schedule
    all_logits: bool
    entries: dict[int, Entry]  # layer -> the tokens joining there
    act: ActiveSet
    num_layers: int
    next_layer: int = 0  # the first layer not run yet (or the one ``partial`` is running)
    num_computed: int = 0  # sum over the layers run of the active-set size
    exit_layer: int | None = None  # where the schedule's exit test stopped it
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    partial: PartialLayer | None = None  # layer ``next_layer`` begun as row chunks, not finished
    projection_share: float = 1.0  # a row's Q/K/V projection over a whole layer's row (``projection_share``)

    @property
    def done(self) -> bool:
        return self.exit_layer is not None or self.next_layer >= self.num_layers

    def upcoming(self) -> tuple[int, int]:
        """(tokens, attention scores computed: ``num_scores``) of the rest of the next layer: the active set with the
        tokens entering there (at most: an admission may refuse some), or the rows a layer begun in row chunks has
        left, as one chunk (a selecting one still projecting: those rows, then at most every row attending); (0, 0)
        once done. What the rest of the next layer costs, for sizing a piece."""
        if self.done:
            return 0, 0
        if self.partial is not None:
            return self.partial.upcoming()
        entry = self.entries.get(self.next_layer)
        num_active, n = self.act.idx.numel(), self.act.n
        num = num_active + (entry.token_idx.numel() if entry is not None else 0)
        tokens, scores = num, num * (num + 1) // 2 if num == n else num * n
        li, schedule = self.next_layer, self.schedule
        admits = schedule.has_layer_hook and schedule.admits_at(li)
        if num_active and (admits or schedule.has_layer_hook and schedule.selects_before_attention(li)):
            # an admission projects the active tokens first; either choice may read their attention mass, each over
            # the active set it chooses in: an admission's is the set before the tokens entering here join, a
            # selecting layer's the set they joined (``Schedule.mass_rows``: a band counts its span rows among them)
            choosing_idx = self.act.idx
            if not admits and entry is not None and entry.token_idx.numel():
                choosing_idx = torch.sort(torch.cat([self.act.idx, entry.token_idx.to(self.act.idx.device)])).values
            mass_rows = schedule.mass_rows(li, choosing_idx)
            tokens += num_active * self.projection_share if admits else 0
            scores += num_scores(mass_rows.numel(), n) if mass_rows is not None else 0
        return tokens, scores

    def next_rows(self) -> tuple[list[int], bool] | None:
        """Of a layer begun in row chunks: the positions of the rows its current phase has left (ascending) and
        whether they attend (False: rows projected only, a selecting layer's or an admission's); None when no layer
        is begun."""
        if self.partial is None:
            return None
        part = self.partial
        return part.positions[part.num_done :], not part.projecting


@dataclass
class PartialLayer:
    """A layer begun as chunks of its rows, stopped between two of them (``kvrelay.model.row_chunks``).

    A plain layer runs in one phase: each chunk of rows projects its Q/K/V, writes its K/V, attends and runs the MLP.
    A selecting layer (``Schedule.selects_before_attention``) runs in two: first every row's Q/K/V (written to the
    cache, kept), then, once the schedule selected from all of them, the kept rows' attention and MLP. An admission
    (``admitting``: a phase of its own, before the layer's tokens join) projects the active rows as the first phase
    does. A projecting phase sums, chunk by chunk, the attention mass of the rows ``Schedule.mass_rows`` names (its
    choice reads it): each chunk's rows attend to every key up to its last, all written by then (causal)."""

    layer: int
    selects: bool
    rows: torch.Tensor  # [m] prompt positions the current phase runs over, ascending
    h: torch.Tensor  # [m, hidden] their input hidden states
    cos: torch.Tensor  # [m, hd] their rotary tables (the plain layer's and the projecting phase's)
    sin: torch.Tensor
    prev_kv: tuple[torch.Tensor, torch.Tensor] | None  # the cached K/V of the layer's rows before it wrote them
    admitting: bool = False  # an admission's projection of the active rows, before the layer's tokens join
    mass_rows: torch.Tensor | None = None  # [r] rows (indices into ``rows``) whose attention mass the choice reads
    projection_share: float = 1.0  # a row's projection over a whole layer's row (pricing)
    rest: tuple[float, int] = (0.0, 0)  # an admission's: (tokens, scores) of the layer after it, at most
    positions: list[int] = field(default_factory=list)  # ``rows`` on the host (pricing, each chunk's key count)
    projecting: bool = False  # a selecting layer's first phase (or the admission)
    q: torch.Tensor | None = None  # a selecting layer's kept rows' queries [H, m, hd] (second phase)
    mass: torch.Tensor | None = None  # [n] fp32: the attention mass of ``mass_rows`` run so far
    changed: bool = False  # the selection dropped rows: the active set becomes ``rows`` at the end
    num_done: int = 0  # rows of the phase run
    outputs: list[torch.Tensor] = field(default_factory=list)  # per chunk: output hidden states [r, hidden]
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per chunk, if kept
    num_mass_before: list[int] = field(default_factory=list)  # [m + 1]: of ``mass_rows``, how many precede row i

    def __post_init__(self) -> None:
        self.projecting = self.selects or self.admitting
        self.positions = self.rows.tolist()
        self.num_mass_before = [0] * (len(self.positions) + 1)
        if self.mass_rows is not None and self.projecting:
            for row in self.mass_rows.tolist():
                self.num_mass_before[row + 1] += 1
            self.num_mass_before = list(accumulate(self.num_mass_before))

    @property
    def num_left(self) -> int:
        return len(self.positions) - self.num_done

    @property
    def share_done(self) -> float:
        """How much of the layer ran, in [0, 1): the share of its rows (a selecting layer: half per phase)."""
        if self.admitting:
            return 0.0
        share = self.num_done / max(1, len(self.positions))
        if not self.selects:
            return share
        return share / 2 if self.projecting else 0.5 + share / 2

    def mass_rows_in(self, start: int, end: int) -> torch.Tensor | None:
        """Of ``mass_rows``, those among rows [start, end) of the phase (indices into ``rows``); None: none."""
        lo, hi = self.num_mass_before[start], self.num_mass_before[end]
        return self.mass_rows[lo:hi] if self.projecting and hi > lo else None

    def cost(self, num: int) -> tuple[float, int]:
        """(tokens, attention scores) of the phase's next ``num`` rows as one chunk: a projected row costs
        ``projection_share`` of a token, and its chunk's mass rows attend to every key up to the chunk's last
        position; a kept row of a selecting layer the rest of a token; a plain row a token. Each attending row
        computes a score for every key up to the chunk's last position (``num_scores``)."""
        if num <= 0:
            return 0.0, 0
        start, end = self.num_done, self.num_done + num
        num_keys = self.positions[end - 1] + 1
        if self.projecting:
            num_mass = self.num_mass_before[end] - self.num_mass_before[start]
            return num * self.projection_share, num_scores(num_mass, num_keys)
        return num * (1 - self.projection_share) if self.selects else num, num_scores(num, num_keys)

    def upcoming(self) -> tuple[float, int]:
        tokens, scores = self.cost(self.num_left)
        if self.admitting:  # then the layer
            return tokens + self.rest[0], scores + self.rest[1]
        if self.projecting:  # then at most every row attends
            num, num_keys = len(self.positions), self.positions[-1] + 1
            tokens, scores = tokens + num * (1 - self.projection_share), scores + num_scores(num, num_keys)
        return tokens, scores
