"""The schedule: at each layer, which prompt tokens are computed and which come from the cache.

Every reuse method is a schedule, a per-layer active set:

- ``entries()`` says which tokens join the active set at which layer, and with what hidden state
  (``None`` = from the embedding, only at layer 0; otherwise the carried input of that layer).
- After each layer, ``after_layer(view)`` may drop tokens from the active set (never add: a
  dropped token's hidden state is gone): it returns the rows of ``view.active_idx`` that stay, as
  ascending row indices (``rows_of``), so that the forward knows how many stay from a shape, without
  waiting for a GPU to count them. It sees the fresh K/V of the active tokens, the K/V the
  cache held for them before (if ``needs_prev_kv``), and can ask for attention probabilities.
- At a layer where ``selects_before_attention(layer)``, ``before_attention(view)`` runs too: right
  after the active tokens' Q/K/V (written to the cache), before attention and MLP, so that the tokens
  it drops cost only their Q/K/V projection there (``view.hidden_out`` is None). ``after_layer`` then
  sees only the kept tokens' output (its view has no Q/K/V there).
- At a layer where ``admits_at(layer)``, the tokens entering there are admitted by ``admit(view,
  entering_idx)`` first: the view holds the Q/K/V of the tokens already active (written to the cache),
  and the entering tokens' keys are whatever the cache holds for them (the reused ones). Tokens it
  refuses never join, so they cost nothing at that layer or above.
- At a layer where ``before_attention`` runs, ``adjust_kv(view)`` may then add to the cached K/V of
  tokens that are not active there (``KVShift``), before that layer's attention reads them: a method
  that corrects the reused K/V it does not recompute from what the recomputed tokens show.
- ``exit_after(layer, last_hidden)`` may stop the forward early (RKSC's layer exit).

Tokens that are not active at a layer must already have K/V there in the sequence cache: the
forward checks this once at the end and raises ``ScheduleError`` if a schedule broke it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrelay.errors import ScheduleError

# nonzero_static runs on CUDA from torch 2.6 (and on an empty mask from 2.9; ``rows_of`` never passes one)
_STATIC_ROWS_ON_CUDA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6)


def count_checks_out(mask: torch.Tensor, num: int) -> bool:
    """Whether ``mask`` holds ``num`` True entries, checked where that costs no GPU wait (the CPU); elsewhere
    assumed."""
    return mask.device.type != "cpu" or int(mask.sum()) == num


def rows_of(mask: torch.Tensor, num: int | None = None) -> torch.Tensor:
    """The indices of ``mask``'s True entries, ascending ([num], int64).

    Given ``num`` (their count, known on the host), a GPU finds them without the host waiting for it to count
    (``nonzero_static``; the CPU takes the same path). A wrong count would cut or pad the rows: the CPU checks
    it at once, CUDA asynchronously (a device-side assert). Without it, or on other devices, the count is read
    back (on a GPU: one wait)."""
    device = mask.device.type
    if num is None or not (device == "cpu" or (device == "cuda" and _STATIC_ROWS_ON_CUDA)):
        rows = mask.nonzero().flatten()
        if num is not None and rows.numel() != num:
            raise ScheduleError(f"a schedule counted {num} kept rows where its mask keeps {rows.numel()}")
        return rows
    if device == "cpu":
        if not count_checks_out(mask, num):
            raise ScheduleError(f"a schedule counted {num} kept rows where its mask keeps {int(mask.sum())}")
    else:
        torch._assert_async(mask.sum() == num, "a schedule's count of kept rows does not match its mask")
    if num == 0:
        return torch.zeros(0, dtype=torch.long, device=mask.device)
    return torch.nonzero_static(mask, size=num).flatten()


@dataclass
class Entry:
    """Tokens that join the active set at one layer."""

    token_idx: torch.Tensor  # [n] prompt indices, int64
    hidden: torch.Tensor | None = None  # [n, hidden_size] input of that layer; None = embedding


@dataclass
class LayerView:
    """What a schedule may inspect right after layer ``layer`` ran for the active tokens."""

    layer: int
    active_idx: torch.Tensor  # [n_act] prompt indices, ascending
    hidden_out: torch.Tensor | None  # [n_act, hidden_size] output of this layer (None before attention)
    # None in the after_layer view of a selecting layer:
    q: torch.Tensor | None  # [num_heads, n_act, head_dim] post-RoPE queries
    k: torch.Tensor | None  # [num_kv_heads, n_act, head_dim] fresh post-RoPE keys
    v: torch.Tensor | None  # [num_kv_heads, n_act, head_dim] fresh values
    prev_k: torch.Tensor | None  # [num_kv_heads, n_act, head_dim] cached keys before overwrite
    prev_v: torch.Tensor | None
    _attention_probs: Callable[[torch.Tensor], torch.Tensor] = field(repr=False, default=None)
    _unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(repr=False, default=None)
    # (the rows ``Schedule.mass_rows`` named, their mass) where a layer run in row chunks summed it chunk by chunk
    _mass: tuple[torch.Tensor, torch.Tensor] | None = field(repr=False, default=None)

    def attention_probs(self, query_rows: torch.Tensor) -> torch.Tensor:
        """Softmax attention of the chosen active rows over all keys: [num_heads, n_q, num_keys]."""
        return self._attention_probs(query_rows)

    def attention_mass(self, query_rows: torch.Tensor) -> torch.Tensor:
        """The attention the chosen active rows pay each key, summed over heads and rows: [num_keys] fp32
        (``attention_probs(query_rows).sum((0, 1))``; summed as the rows ran where they are ``Schedule.mass_rows``'s
        and the layer ran in row chunks)."""
        if self._mass is not None and torch.equal(self._mass[0], query_rows.to(self._mass[0].device)):
            return self._mass[1]
        return self.attention_probs(query_rows).sum(dim=(0, 1))

    def unrotate(self, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Keys [num_kv_heads, len(rows), head_dim] of active rows ``rows`` (post-RoPE, or differences of
        such keys) with their positions' rotation undone, in fp32: comparable across positions. Only in
        the view of a selecting layer (``before_attention``, ``adjust_kv``)."""
        return self._unrotate(keys, rows)


@dataclass
class KVShift:
    """What ``Schedule.adjust_kv`` adds to the cached K/V of some positions at one layer."""

    slots: torch.Tensor  # [m] positions (not active at that layer)
    k: torch.Tensor  # [num_kv_heads, 1 or m, head_dim] before RoPE: the forward rotates it to each slot
    v: torch.Tensor  # [num_kv_heads, 1 or m, head_dim]


class Schedule:
    """Default schedule: every prompt token active from layer 0 to the top (= full prefill).

    Each hook is here because a shipped method needs it (the reason on its line); a schedule with no layer hook and
    no exit test has an active set fixed in advance, which is what lets a prefill run in chunks
    (kvrelay.engine.prefill) and the forward skip every per-layer call.
    """

    #: relay: the hidden states a span carries into a later call, captured at the layers it enters there
    capture_layers: tuple[int, ...] = ()
    #: cacheblend, relay (the band) and rksc's attention probe; False skips every per-layer hook below
    has_layer_hook: bool = False
    #: rksc: the confidence-gated layer exit
    has_exit_test: bool = False

    def entries(self, num_tokens: int) -> dict[int, Entry]:
        """Every method: which tokens join the active set at which layer, and from which hidden state."""
        return {0: Entry(torch.arange(num_tokens))}

    def needs_prev_kv(self, layer: int) -> bool:
        """cacheblend, relay: their deviation compares the fresh values with the cached ones (``view.prev_v``)."""
        return False

    def after_layer(self, view: LayerView) -> torch.Tensor | None:
        """The band's top (its tokens leave above it) and rksc's attention probe. The rows of ``view.active_idx``
        that stay ([m] int64, ascending; None keeps every token)."""
        return None

    def selects_before_attention(self, layer: int) -> bool:
        """cacheblend, relay: the tokens a band drops at its select layer cost only their Q/K/V projection there.
        Whether ``before_attention`` (not ``after_layer``) runs at ``layer``."""
        return False

    def before_attention(self, view: LayerView) -> torch.Tensor | None:
        """The rows of ``view.active_idx`` that stay, from the fresh Q/K/V (as ``after_layer``); the others skip
        attention and MLP."""
        return None

    def adjust_kv(self, view: LayerView) -> KVShift | None:
        """relay's drift: the reused K/V it does not recompute, corrected from what the recomputed tokens show. At a
        layer where ``before_attention`` ran (same view): what to add to inactive tokens' K/V."""
        return None

    def mass_rows(self, layer: int, active_idx: torch.Tensor) -> torch.Tensor | None:
        """relay's influence: the rows of ``active_idx`` (the active tokens when ``before_attention`` or ``admit`` runs
        at ``layer``) whose ``LayerView.attention_mass`` that choice reads, so that a layer run in row chunks sums it
        chunk by chunk, priced like attention, instead of in one piece; None where it reads none."""
        return None

    def admits_at(self, layer: int) -> bool:
        """relay's admission: span tokens entering with carried states are chosen before they join, so the refused
        ones cost nothing there. Whether ``admit`` decides which of the tokens entering at ``layer`` join."""
        return False

    def admit(self, view: LayerView, entering_idx: torch.Tensor) -> torch.Tensor | None:
        """The rows of ``entering_idx`` (prompt indices) that join ([m] int64, ascending), from the active tokens'
        fresh Q/K/V."""
        return None

    def exit_after(self, layer: int, last_hidden: torch.Tensor) -> bool:
        """rksc: stop the forward once the last token's state is confident (its logits read from there)."""
        return False


class StaticSchedule(Schedule):
    """The given prompt indices are computed at every layer; every other token reads the cache."""

    def __init__(self, active_idx: torch.Tensor) -> None:
        self.active_idx = active_idx

    def entries(self, num_tokens: int) -> dict[int, Entry]:
        return {0: Entry(self.active_idx)}


class SuffixSchedule(StaticSchedule):
    """Tokens ``[start, n)`` active at every layer; ``[0, start)`` read from the cache."""

    def __init__(self, start: int) -> None:
        self.start = int(start)

    def entries(self, num_tokens: int) -> dict[int, Entry]:
        return {0: Entry(torch.arange(self.start, num_tokens))}
