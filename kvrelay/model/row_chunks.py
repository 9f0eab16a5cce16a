"""One layer of a scheduled prefill run as chunks of its rows, between which the forward may stop.

A piece of a prefill that selects tokens as it goes is at least one layer (``kvrelay.model.prefill_state``); one layer
over the 8K active tokens of a long reused prompt costs more than a turn's budget, so that layer alone would stall
every running stream. Causal attention lets a layer run as chunks of its rows instead, exactly: the active set is
sorted by position, so rows [a, b) need this layer's K/V of positions up to ``rows[b - 1]`` only, and each of those
is an inactive token's (already in the cache) or a row of this chunk or an earlier one (written before they attend).
Per chunk: Q/K/V and RoPE of its rows, their K/V written, attention over keys up to its last position (masked
causally, and by the sliding window where there is one), output projection, MLP, residual.

A selecting layer (``Schedule.selects_before_attention``: a band's detection, pruning and top layers) needs every
active token's Q/K/V before it chooses. It runs in two phases: its rows' Q/K/V chunk by chunk (written to the cache
and kept), the schedule's choice once all are in (``kvrelay.model.selecting``, as one forward makes it), then the kept
rows' attention and MLP chunk by chunk (every key of this layer is written by then). An admission (relay's band
choosing its span tokens before they enter) is a projecting phase of its own, over the active rows before they join.
A choice that reads attention mass (relay's influence: the new tokens' attention, over every key) names its query rows
(``Schedule.mass_rows``); a projecting phase sums their mass chunk by chunk as it projects them, each chunk's over
the keys up to its last position (causal: all written by then, by it, an earlier chunk or the reused cache), so the
choice reads the sum and costs no attention of its own, and the piece that ends the phase is no longer one layer's
attention over the new tokens. A schedule whose ``after_layer`` reads the layer's view gets the whole layer's,
assembled from the chunks, once the last one ran.

The results equal one forward's up to float rounding: a matmul over fewer rows, or attention over fewer keys, may
round differently. A layer run whole (``Transformer._layer``) stays bit for bit one forward's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrelay.model import selecting
from kvrelay.model.layers import visible_mask
from kvrelay.model.prefill_state import LayerForward, PartialLayer, drops, num_scores
from kvrelay.model.schedule import LayerView

if TYPE_CHECKING:
    from kvrelay.model.transformer import Transformer


def begin(model: Transformer, forward: LayerForward) -> None:
    """Begin ``forward``'s next layer as row chunks: its entering tokens join (admitted where the schedule admits:
    first the admission's own phase, which projects the active rows chunk by chunk), its capture is taken, the cached
    K/V its schedule compares with are read; a layer with no active token is done at once. Nothing where a layer is
    begun already or the forward is done."""
    if forward.partial is not None or forward.done:
        return
    li, act, schedule = forward.next_layer, forward.act, forward.schedule
    entry = forward.entries.get(li)
    if (schedule.has_layer_hook and schedule.admits_at(li) and entry is not None and entry.token_idx.numel()
            and act.idx.numel()):
        _, _, cos, sin = act.view(model.rope_of(li), model.config.window_at(li))
        num_rows = act.idx.numel() + entry.token_idx.numel()  # the layer after: at most every one of them
        forward.partial = PartialLayer(li, False, act.idx, act.h, cos, sin, None, admitting=True,
                                       mass_rows=schedule.mass_rows(li, act.idx),
                                       projection_share=forward.projection_share,
                                       rest=(num_rows, num_scores(num_rows, act.n)))
        return
    _begin_layer(model, forward, None)


def _begin_layer(model: Transformer, forward: LayerForward, admission: selecting.Admission | None) -> None:
    """The layer's tokens join (``admission``: what its admission phase computed), its rows' phase begins."""
    li, act, schedule = forward.next_layer, forward.act, forward.schedule
    if not model._begin_layer(forward, admission):
        forward.next_layer = li + 1
        return
    _, _, cos, sin = act.view(model.rope_of(li), model.config.window_at(li))
    prev_kv = forward.cache.gather(li, act.idx) if schedule.has_layer_hook and schedule.needs_prev_kv(li) else None
    selects = schedule.has_layer_hook and schedule.selects_before_attention(li)
    forward.partial = PartialLayer(li, selects, act.idx, act.h, cos, sin, prev_kv,
                                   mass_rows=schedule.mass_rows(li, act.idx) if selects else None,
                                   projection_share=forward.projection_share)


def run(model: Transformer, forward: LayerForward, num_rows: int | None) -> int:
    """Run ``num_rows`` more rows of the current phase of ``forward``'s next layer (at most what the phase has left;
    a phase ends with its last row: a selecting layer selects there), beginning the layer first; None: the rest of
    the layer, whole where it is not begun (``Transformer._layer``). The rows run."""
    if forward.done:
        return 0
    if num_rows is None and forward.partial is None:
        model._layer(forward)
        return 0
    begin(model, forward)
    num_run = 0
    while forward.partial is not None and (num_rows is None or num_run < num_rows):
        part = forward.partial
        num = part.num_left if num_rows is None else min(num_rows - num_run, part.num_left)
        if num:
            _chunk(model, forward, part, num)
            num_run += num
        if not part.num_left:
            _end_phase(model, forward, part)
            if num_rows is not None:  # the next phase's rows cost otherwise: the caller prices them
                break
    return num_run


def _chunk(model: Transformer, forward: LayerForward, part: PartialLayer, num: int) -> None:
    """Rows [num_done, num_done + num) of the phase."""
    start, end = part.num_done, part.num_done + num
    li, cache, layer = part.layer, forward.cache, model.model.layers[part.layer]
    rows, h = part.rows[start:end], part.h[start:end]
    if part.q is None:  # the rows' own Q/K/V, their K/V written before anything attends to them
        q, k, v = layer.project(h, part.cos[start:end], part.sin[start:end])
        cache.write(li, rows, k, v)
        if part.projecting or forward.schedule.has_layer_hook:
            part.qkv.append((q, k, v))
        mass_rows = part.mass_rows_in(start, end)
        if mass_rows is not None:  # their share of the choice's attention mass: every key they see is written
            chunk = selecting.chunk_mass(model, q.index_select(1, mass_rows - start), part.rows.index_select(
                0, mass_rows), cache, li, part.positions[end - 1] + 1, forward.act.n)
            part.mass = chunk if part.mass is None else part.mass + chunk
    else:  # a selecting layer's kept rows: their Q/K/V came with the projecting phase
        q = part.q[:, start:end]
    if not part.projecting:
        num_keys = part.positions[end - 1] + 1  # causal: no row of the chunk sees a later position
        mask = visible_mask(rows, num_keys, model.config.window_at(li))
        part.outputs.append(layer.finish(h, cache.attend(li, q, mask, False, num_keys)))
    part.num_done = end


def _end_phase(model: Transformer, forward: LayerForward, part: PartialLayer) -> None:
    """A phase's last row ran: a selecting layer selects (then its kept rows attend), any other layer ends."""
    if part.projecting:
        act = forward.act
        q, k, v = (torch.cat([chunk[i] for chunk in part.qkv], dim=1) for i in range(3))  # [heads, m, hd] each
        mass = (part.mass_rows, part.mass) if part.mass is not None else None
        if part.admitting:
            forward.partial = None
            _begin_layer(model, forward, ((q, k, v), mass))
            return
        prev_k, prev_v = part.prev_kv if part.prev_kv is not None else (None, None)
        kept = selecting.select(model, part.layer, act, forward.cache, forward.schedule, q, k, v, prev_k, prev_v,
                                mass)
        part.changed = drops(kept, act.idx.numel())
        if part.changed:
            part.rows, part.h, q = act.idx.index_select(0, kept), act.h.index_select(0, kept), q.index_select(1, kept)
            part.positions = part.rows.tolist()
        part.q, part.qkv, part.projecting, part.num_done = q, [], False, 0
        if part.num_left:
            return
    _end_layer(model, forward, part)


def _end_layer(model: Transformer, forward: LayerForward, part: PartialLayer) -> None:
    """Every row of the layer ran: the active set takes their outputs, the schedule's hooks and exit test run."""
    act, schedule, li = forward.act, forward.schedule, part.layer
    h = torch.cat(part.outputs) if part.outputs else part.h[:0]
    forward.partial = None
    if part.selects:  # as one forward: the kept rows' output, and a view of them alone
        act.update(part.rows, h, part.changed)
        act.keep(schedule.after_layer(LayerView(li, act.idx, act.h, None, None, None, None, None)))
    else:
        act.update(part.rows, h, False)
        if schedule.has_layer_hook:
            q, k, v = (torch.cat([chunk[i] for chunk in part.qkv], dim=1) for i in range(3))
            prev_k, prev_v = part.prev_kv if part.prev_kv is not None else (None, None)
            act.keep(schedule.after_layer(LayerView(li, act.idx, h, q, k, v, prev_k, prev_v, _attention_probs=(
                selecting.probs_fn(model, q, forward.cache, li, act.idx, act.n)))))
    model._end_layer(forward)
