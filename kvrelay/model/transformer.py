"""A compact Llama-family decoder: a scheduled prefill and a batched decode over one layer forward.

Batch size is 1 in prefill (a sequence is a flat [n, hidden] tensor); a decode step takes B
sequences, one token each, whose caches may differ in length and kind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvrelay.errors import ContextLengthError, ScheduleError
from kvrelay.model import packed, row_chunks, selecting
from kvrelay.model.config import ModelConfig
from kvrelay.model.int4 import Int4Blocks, decode_steps
from kvrelay.model.layers import (
    DecoderLayer,
    RMSNorm,
    attention,
    attention_backends,
    linear,
    visible_mask,
)
from kvrelay.model.prefill_state import ActiveSet, LayerForward, drops, projection_share
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.schedule import Entry, LayerView, Schedule

if TYPE_CHECKING:
    from kvrelay.cache.kv import SequenceKV


def _with_attention_backends(forward: Callable) -> Callable:
    """Runs a forward under the attention kernels its device may use (``layers.attention_backends``)."""
    @functools.wraps(forward)
    def run(self: Transformer, *args, **kwargs):
        with attention_backends(self.device):
            return forward(self, *args, **kwargs)

    return run


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.traits.norm_offset)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] for the last prompt token, or [n_out, vocab] with all_logits
    num_computed_token_layers: int  # sum over layers of the active-set size
    exit_layer: int | None = None  # set when the schedule's exit test stopped the forward
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # layer -> (prompt indices [m], input hidden states [m, hidden]) for capture layers


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: RotaryEmbedding | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def rope(self) -> RotaryEmbedding:
        device = self.lm_head.weight.device
        if self._rope is None or self._rope.device != device:
            self._rope = RotaryEmbedding(self.config, device)
        return self._rope

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def ropes(self) -> list[RotaryEmbedding]:
        return [self.rope] if self.rope.local is None else [self.rope, self.rope.local]

    def rope_of(self, layer: int) -> RotaryEmbedding:
        local = self.rope.local
        return local if local is not None and self.config.is_local(layer) else self.rope

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(token_ids)
        # scaled by sqrt(hidden), that scalar rounded to the model dtype (as transformers does)
        return h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype) if self.config.traits.embed_scale else h

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(h)
        rows = x.reshape(-1, x.shape[-1])  # [n, hidden]: one row or many
        return linear(rows, self.lm_head.weight, self.lm_head.bias).reshape(*x.shape[:-1], -1).float()

    def matmul_weights(self) -> list[torch.Tensor]:
        """Every weight a forward multiplies by, as it multiplies (q/k/v and gate/up fused)."""
        weights = [self.lm_head.weight]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [attn.fused_qkv()[0], attn.o_proj.weight, mlp.fused_gate_up(), mlp.down_proj.weight]
        return weights

    def pack_weights(self) -> int:
        """Pack every matmul weight for oneDNN now (``kvrelay.model.packed``), so no call pays for it on first
        use; returns how many were packed (0 where packing does not apply)."""
        return packed.pack(self.matmul_weights())

    @property
    def matmuls(self) -> str:
        """What runs the matmuls now: "oneDNN packed (121 weights)", or "F.linear" where none is packed."""
        num = packed.num_packed(self.matmul_weights())
        return f"oneDNN packed ({num} weights)" if num else "F.linear"

    def attach_int4(self, blocks: Int4Blocks) -> tuple[int, int]:
        """Run decode steps on the 4-bit ``blocks`` of the layer weights that have them (``kvrelay.model.int4``):
        (weights that got a 4-bit stand-in, weights in all), counting fused q/k/v and gate/up as one each."""
        stand_ins = []
        for li, layer in enumerate(self.model.layers):
            stand_ins += layer.self_attn.attach_int4(blocks, f"model.layers.{li}.self_attn.")
            stand_ins += layer.mlp.attach_int4(blocks, f"model.layers.{li}.mlp.")
        return sum(w is not None for w in stand_ins), len(stand_ins)

    def check_length(self, num_positions: int) -> None:
        limit = self.config.max_position_embeddings
        if num_positions > limit:
            raise ContextLengthError(
                f"{num_positions} positions do not fit the model's context length of {limit} tokens"
            )

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    @_with_attention_backends
    def prefill(self, token_ids: torch.Tensor, cache: SequenceKV, schedule: Schedule | None = None,
                all_logits: bool = False) -> PrefillResult:
        """Scheduled prefill of a whole prompt into ``cache`` (slot = position, 0..n-1).

        token_ids: [n]. Tokens the schedule never activates at a layer must already be in the cache. The loop:
        tokens join the active set where they enter, each layer runs for the active set, the schedule may drop
        some after it, and its exit test may stop the forward.
        """
        forward = self.begin_prefill(token_ids, cache, schedule, all_logits)
        while not forward.done:
            self._layer(forward)
        return self.finish_prefill(forward)

    @torch.inference_mode()
    def begin_prefill(self, token_ids: torch.Tensor, cache: SequenceKV, schedule: Schedule | None = None,
                      all_logits: bool = False) -> LayerForward:
        """``prefill`` stopped before its first layer: ``prefill_layers`` runs it on, ``finish_prefill`` ends it."""
        schedule = schedule or Schedule()
        n = int(token_ids.shape[0])
        self.check_length(n)
        cache.ensure_capacity(n)
        tables = {r: r.cos_sin(torch.arange(n, device=self.device), self.dtype, n) for r in self.ropes}
        entries = schedule.entries(n)
        if any(layer > 0 and e.hidden is None for layer, e in entries.items()):
            raise ScheduleError("a token entering above layer 0 needs its carried hidden state")
        act = ActiveSet(n, tables, self.config.hidden_size, self.dtype, self.device)
        return LayerForward(token_ids.to(self.device), cache, schedule, all_logits, entries, act,
                            len(self.model.layers), projection_share=projection_share(self.config))

    @torch.inference_mode()
    @_with_attention_backends
    def prefill_layers(self, forward: LayerForward, go_on: Callable[[], bool] | None = None) -> int:
        """Run ``forward`` on from the layer where it stopped: that layer whatever ``go_on`` says, each next one
        while it says so (asked before every layer, the first included; None: to the end). The layers run: the
        same operations, in the same order, as ``prefill``'s (``kvrelay.model.prefill_state``); a layer begun in
        row chunks runs its rows left (``prefill_rows``)."""
        num = 0
        while not forward.done and ((go_on is None or go_on()) or num == 0):
            row_chunks.run(self, forward, None)
            num += 1
        return num

    @torch.inference_mode()
    @_with_attention_backends
    def prefill_rows(self, forward: LayerForward, num_rows: int | None = None) -> int:
        """Run ``forward`` on by ``num_rows`` rows of its next layer's current phase (``kvrelay.model.row_chunks``;
        None: the rest of that layer, whole where it is not begun); the rows run. Equal to one forward up to float
        rounding."""
        return row_chunks.run(self, forward, num_rows)

    @torch.inference_mode()
    def start_layer(self, forward: LayerForward) -> None:
        """Begin ``forward``'s next layer as row chunks (its tokens enter: ``forward.next_rows()`` says its rows)."""
        row_chunks.begin(self, forward)

    def _layer(self, forward: LayerForward) -> None:
        """Layer ``forward.next_layer``, whole: its entering tokens join, then it runs for the active set."""
        li = forward.next_layer
        if self._begin_layer(forward):
            self._run_layer(self.model.layers[li], li, forward.act, forward.cache, forward.schedule)
            self._end_layer(forward)
        else:
            forward.next_layer = li + 1

    def _begin_layer(self, forward: LayerForward, admission: selecting.Admission | None = None) -> bool:
        """Layer ``forward.next_layer``'s entering tokens join and its capture is taken; whether any token is active.
        ``admission``: the admission's Q/K/V and mass, where row chunks computed them (``selecting.admit``)."""
        li, act, schedule, captured = forward.next_layer, forward.act, forward.schedule, forward.captured
        entry = forward.entries.get(li)
        if entry is not None and entry.token_idx.numel():
            self._enter(self.model.layers[li], li, entry, forward.token_ids, act, forward.cache, schedule, captured,
                        admission)
        if li in schedule.capture_layers and act.idx.numel() and li not in captured:
            captured[li] = (act.idx.clone(), act.h.clone())
        forward.num_computed += act.idx.numel()
        return act.idx.numel() > 0

    def _end_layer(self, forward: LayerForward) -> None:
        """Layer ``forward.next_layer`` ran: the schedule's exit test, then on to the next."""
        li, act, schedule = forward.next_layer, forward.act, forward.schedule
        forward.next_layer = li + 1
        if schedule.has_exit_test and act.holds_last() and schedule.exit_after(li, act.h[-1]):
            forward.exit_layer = li

    @torch.inference_mode()
    def finish_prefill(self, forward: LayerForward) -> PrefillResult:
        """The result of a forward run to its end (``prefill_layers`` until ``done``)."""
        if not forward.done:
            raise ScheduleError(f"the prefill stopped before layer {forward.next_layer} has no result yet")
        act, cache, n = forward.act, forward.cache, forward.act.n
        cache.length = max(cache.length, n)
        if forward.exit_layer is None:
            cache.check_filled(n)
        if not act.holds_last():
            raise ScheduleError("the last prompt token must stay active to the top layer to give logits")
        logits = self.logits_from_hidden(act.h if forward.all_logits else act.h[-1])
        return PrefillResult(logits, forward.num_computed, forward.exit_layer, forward.captured)

    def _enter(self, layer, li: int, entry: Entry, token_ids: torch.Tensor, act: ActiveSet, cache: SequenceKV,
               schedule: Schedule, captured: dict, admission: selecting.Admission | None = None) -> None:
        """Tokens entering at layer ``li`` join the active set: from their embedding, or with their carried state;
        where the schedule admits (``admits_at``), only the ones it admits."""
        idx = entry.token_idx.to(self.device)
        new_h = self.embed(token_ids.index_select(0, idx)) if entry.hidden is None else entry.hidden
        if schedule.has_layer_hook and schedule.admits_at(li) and act.idx.numel():
            if li in schedule.capture_layers:  # a refused token's input here is its entry state
                union, order = torch.sort(torch.cat([act.idx, idx]))
                captured[li] = (union, torch.cat([act.h, new_h.to(self.device, self.dtype)]).index_select(0, order))
            kept = selecting.admit(self, layer, li, act.h, act.idx, act.tables[self.rope_of(li)], cache, schedule, idx,
                                   act.n, admission)
            if drops(kept, idx.numel()):
                idx, new_h = idx.index_select(0, kept), new_h.index_select(0, kept.to(new_h.device))
        act.join(idx, new_h)

    def _run_layer(self, layer, li: int, act: ActiveSet, cache: SequenceKV, schedule: Schedule) -> None:
        """Layer ``li`` for the active set (its K/V written to the cache), then the schedule's hooks there."""
        n, rope, window = act.n, self.rope_of(li), self.config.window_at(li)
        view_of_set = act.view(rope, window)
        causal, _, cos, sin = view_of_set
        prev_k = prev_v = None
        if schedule.has_layer_hook and schedule.needs_prev_kv(li):
            prev_k, prev_v = cache.gather(li, act.idx)
        if schedule.has_layer_hook and schedule.selects_before_attention(li):
            self._select_then_finish(layer, li, act, cache, schedule, prev_k, prev_v)
            act.keep(schedule.after_layer(LayerView(li, act.idx, act.h, None, None, None, None, None)))
            return  # (after_layer: e.g. a band's top, whose tokens leave after it)
        active, mask = act.idx, self._mask_of(view_of_set, act.idx, n, window)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if causal:  # every position 0..n-1 active: a slice copy, not an indexed one
                cache.write_range(li, 0, k, v)
            else:
                cache.write(li, active, k, v)
            return cache.attend(li, q, mask, causal, n)

        h, q, k, v = layer(act.h, cos, sin, attend)
        act.update(active, h, False)
        if schedule.has_layer_hook:
            probs = selecting.probs_fn(self, q, cache, li, active, n)
            act.keep(schedule.after_layer(LayerView(li, active, h, q, k, v, prev_k, prev_v, _attention_probs=probs)))

    @staticmethod
    def _mask_of(view_of_set: list, active: torch.Tensor, n: int, window: int | None) -> torch.Tensor | None:
        """The attention mask of the current active set ([causal, mask, cos, sin], built on first use)."""
        if not view_of_set[0] and view_of_set[1] is None:
            view_of_set[1] = visible_mask(active, n, window)
        return view_of_set[1]

    def _select_then_finish(self, layer, li: int, act: ActiveSet, cache: SequenceKV, schedule: Schedule,
                            prev_k: torch.Tensor | None, prev_v: torch.Tensor | None) -> None:
        """A selecting layer: every active token's Q/K/V (its fresh K/V go to the cache), the schedule
        keeps some, may move the cached K/V of tokens not active here (``adjust_kv``), and only the kept
        run attention and the MLP (the active set becomes them, with their output)."""
        h, active, n, rope, window = act.h, act.idx, act.n, self.rope_of(li), self.config.window_at(li)
        view_of_set = act.view(rope, window)
        causal, _, cos, sin = view_of_set
        q, k, v = layer.project(h, cos, sin)
        cache.write(li, active, k, v)

        kept = selecting.select(self, li, act, cache, schedule, q, k, v, prev_k, prev_v)
        changed = drops(kept, active.numel())
        if changed:  # the kept tokens' own mask (the set's is not built for them)
            active, h, q = active.index_select(0, kept), h.index_select(0, kept), q.index_select(1, kept)
            causal = active.numel() == n and (window is None or n <= window)
            mask = None if causal else visible_mask(active, n, window)
        else:
            mask = self._mask_of(view_of_set, active, n, window)
        act.update(active, layer.finish(h, cache.attend(li, q, mask, causal, n)), changed)

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    @_with_attention_backends
    @decode_steps()  # the 4-bit weights, where attached, run here and never in a prefill
    def decode(self, token_ids: list[int], caches: list[SequenceKV], capture_layers: tuple[int, ...] = (),
               captured: list[dict[int, list[torch.Tensor]]] | None = None) -> torch.Tensor:
        """Feed ``token_ids[b]`` at position ``caches[b].length`` for each of B sequences; logits [B, vocab].

        Every linear layer runs once on [B, hidden]; each row attends over its own cache. With
        ``capture_layers``, appends each such layer's input hidden state ([hidden]) of row b to
        ``captured[b][layer]`` (RelayCaching carries these to the downstream agent).
        """
        if len(token_ids) != len(caches) or not caches:
            raise ScheduleError(f"a decode step needs one token per cache, got {len(token_ids)} and {len(caches)}")
        positions = [c.length for c in caches]
        for c, pos in zip(caches, positions, strict=True):
            self.check_length(pos + 1)
            c.ensure_capacity(pos + 1)
        device, dtype = self.device, self.dtype
        tables = {r: self._cos_sin(positions, r) for r in self.ropes}
        h = self.embed(torch.tensor(token_ids, device=device))  # [B, hidden]
        for li, layer in enumerate(self.model.layers):
            window = self.config.window_at(li)
            starts = [0 if window is None else max(0, pos + 1 - window) for pos in positions]
            if captured is not None and li in capture_layers:
                for b, rows in enumerate(captured):
                    rows.setdefault(li, []).append(h[b].clone())

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, li: int = li,
                       starts: list[int] = starts) -> torch.Tensor:
                out = []
                for b, cache in enumerate(caches):  # q [H, B, hd]; k, v [Hkv, B, hd]
                    cache.write_range(li, positions[b], k[:, b : b + 1], v[:, b : b + 1])
                    k_all, v_all = cache.kv(li, starts[b], positions[b] + 1)  # [Hkv, m, hd]
                    out.append(attention(q[:, b : b + 1], k_all, v_all, None, False))  # [1, H * hd]
                return torch.cat(out)  # [B, H * hd]

            cos, sin = tables[self.rope_of(li)]  # [B, hd] each
            h = layer(h, cos.to(dtype), sin.to(dtype), attend)[0]
        for c, pos in zip(caches, positions, strict=True):
            c.length = pos + 1
        return self.logits_from_hidden(h)  # [B, vocab]

    def decode_step(self, token_id: int, cache: SequenceKV) -> torch.Tensor:
        """One token for one sequence: next-token logits [vocab]."""
        return self.decode([token_id], [cache])[0]

    def _cos_sin(self, positions: list[int], rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, hd] for each row's own position (dynamic RoPE depends on each row's length)."""
        pos = torch.tensor(positions, device=self.device)
        if rope.rope_type != "dynamic":
            return rope.cos_sin(pos, self.dtype, max(positions) + 1)
        pairs = [rope.cos_sin(p[None], self.dtype, int(p) + 1) for p in pos]
        return torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])
