"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama/Qwen/Mistral use).

Moving reused keys to a new position is exact for RoPE variants whose rotation depends only on
the position: ``K(p') = R(p' - p) K(p)``. Dynamic NTK scaling changes the frequencies with the
sequence length, so rotations do not compose; ``RotaryEmbedding.can_shift`` finds that out with a
round-trip self-test instead of trusting a list, and callers fall back to recompute.
"""

from __future__ import annotations

import math

import torch

from kvrelay.model.config import ModelConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., n, head_dim]; cos/sin: [n, head_dim] (broadcast over heads)."""
    return x * cos + rotate_half(x) * sin


def undo_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of ``apply_rotary`` with the same cos/sin: rotate back to position 0."""
    return x * cos - rotate_half(x) * sin


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rotate_halves_into(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """``out = keys`` rotated by the angles whose cos, sin ([hd / 2], broadcast) are given, in the
    rotate-half layout; fp32, in place, no temporaries (keys and out must not overlap)."""
    half = keys.shape[-1] // 2
    x1, x2, o1, o2 = keys[..., :half], keys[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)  # x2 cos + x1 sin

class RotaryEmbedding:
    """cos/sin tables for positions, plus exact key shifts."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", theta: float | None = None) -> None:
        self.head_dim = config.head_dim
        self.theta = theta or config.rope_theta  # ``theta``: a plain RoPE with that base (Gemma's local layers)
        self.rope_type = "default" if theta else config.rope_type
        self.params = {} if theta else dict(config.rope_scaling)
        self.max_position_embeddings = int(
            self.params.get("original_max_position_embeddings", config.max_position_embeddings)
        )
        self.device = torch.device(device)
        self.inv_freq = self._inv_freq(self.theta)
        self._table_len = 0
        self._cos = self._sin = torch.empty(0)
        self._can_shift: bool | None = None
        # Gemma 3: sliding layers rotate with their own base (``local``'s tables); a shift of every
        # layer's keys [L, Hkv, n, hd] uses each layer's frequencies ([L, 1, 1, hd / 2])
        self.local = None if theta or not config.rope_local_theta else RotaryEmbedding(
            config, device, config.rope_local_theta)
        per_layer = [self.local.inv_freq if config.is_local(i) else self.inv_freq
                     for i in range(config.num_layers)] if self.local else []
        self.layer_inv_freq = torch.stack(per_layer)[:, None, None] if per_layer else None

    def _inv_freq(self, theta: float) -> torch.Tensor:
        # fp32 throughout, as transformers computes it: the angles then agree bit for bit (an inverse
        # frequency one ulp more exact moves late positions' logits by ~1e-4 on Gemma 3)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.device) / self.head_dim
        inv_freq = 1.0 / (theta**exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / float(self.params["factor"])
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.params)
        return inv_freq.float()

    def _freqs_for_length(self, seq_len: int) -> torch.Tensor:
        if self.rope_type != "dynamic" or seq_len <= self.max_position_embeddings:
            return self.inv_freq
        # Dynamic NTK: the base grows with the sequence, so a position's angle depends on the length.
        factor = float(self.params["factor"])
        d = self.head_dim
        base = self.theta * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
        return self._inv_freq(base)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] -> cos, sin: [n, head_dim] in ``dtype``. ``seq_len``, where given, must exceed every
        position (it sizes the table without reading their maximum back from a GPU)."""
        if self.rope_type == "dynamic":
            length = int(seq_len if seq_len is not None else positions.max().item() + 1)
            freqs = positions.float()[:, None] * self._freqs_for_length(length)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(dtype), emb.sin().to(dtype)
        need = seq_len if seq_len is not None else int(positions.max().item()) + 1 if positions.numel() else 0
        if need > self._table_len:
            self._grow_table(max(need, 2 * self._table_len, 256))
        return self._cos.index_select(0, positions).to(dtype), self._sin.index_select(0, positions).to(dtype)

    def _grow_table(self, length: int) -> None:
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [length, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim]
        self._cos, self._sin, self._table_len = emb.cos(), emb.sin(), length

    def shift_keys(self, keys: torch.Tensor, delta: torch.Tensor | int, layer: int | None = None) -> torch.Tensor:
        """Rotate post-RoPE keys by a position delta (per token). keys: [..., n, head_dim]; delta: [n].

        With per-layer bases, ``keys`` are every layer's [L, Hkv, n, hd], or one ``layer``'s."""
        return self._rotate(keys, delta, self._inv_for(keys, layer))

    def shift_keys_into(self, keys: torch.Tensor, delta: int, out: torch.Tensor, layer: int | None = None) -> None:
        """``out[:] = shift_keys(keys, delta)`` for one delta, written in place with no temporaries of the
        keys' size (loading a span is a copy plus this rotation). fp32 only; other dtypes go via fp32."""
        inv = self._inv_for(keys, layer).to(keys.device)
        if keys.dtype != torch.float32 or out.dtype != torch.float32:
            out.copy_(self._rotate(keys, delta, inv))
            return
        angle = inv * float(delta)  # [hd / 2], or [L, 1, 1, hd / 2] with per-layer bases
        rotate_halves_into(keys, angle.cos(), angle.sin(), out)

    def add_keys_at(self, keys_free: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """``out += keys_free`` rotated for positions [start, start + n): keys without RoPE [..., n, hd] (every
        layer's [L, Hkv, n, hd] with per-layer bases), ``out`` the cache's rows of the same shape. fp32: in place,
        with no temporaries of the keys' size but the cos/sin of the angles ([n, hd / 2]; [L, 1, n, hd / 2] with
        per-layer bases); a rotation then an add would write two. Other dtypes: a rotated fp32 copy, added and
        rounded once to ``out``'s dtype."""
        if keys_free.dtype != torch.float32 or out.dtype != torch.float32:
            out += self.shift_keys(keys_free.float(), torch.arange(start, start + keys_free.shape[-2],
                                                                   device=keys_free.device))
            return
        inv = self._inv_for(keys_free, None).to(keys_free.device)
        pos = torch.arange(start, start + keys_free.shape[-2], device=keys_free.device, dtype=torch.float32)
        angle = pos[:, None] * inv  # [n, hd / 2], or [L, 1, n, hd / 2] with per-layer bases
        cos, sin = angle.cos(), angle.sin()
        half = keys_free.shape[-1] // 2
        x1, x2, o1, o2 = keys_free[..., :half], keys_free[..., half:], out[..., :half], out[..., half:]
        o1.addcmul_(x1, cos).addcmul_(x2, sin, value=-1)  # += x1 cos - x2 sin
        o2.addcmul_(x2, cos).addcmul_(x1, sin)  # += x2 cos + x1 sin

    def shift_factors(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of a ``delta``-position shift, for ``rotate_halves_into``: [hd / 2] each, or [L, 1, 1, hd / 2]
        with per-layer bases (index them by layer). Computed once, they serve a span's every layer."""
        inv = self.inv_freq if self.layer_inv_freq is None else self.layer_inv_freq
        angle = inv * float(delta)
        return angle.cos(), angle.sin()

    def _inv_for(self, keys: torch.Tensor, layer: int | None) -> torch.Tensor:
        inv = self.inv_freq if self.layer_inv_freq is None else (
            self.layer_inv_freq if layer is None else self.layer_inv_freq[layer, 0, 0])
        if inv.dim() > 1 and (keys.dim() != 4 or keys.shape[0] != inv.shape[0]):
            raise ValueError(f"per-layer RoPE bases: shift keys of shape [L, Hkv, n, hd] or pass layer=, "
                             f"got {tuple(keys.shape)}")
        return inv

    def _rotate(self, keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
        n = keys.shape[-2]
        delta_t = torch.as_tensor(delta, device=keys.device, dtype=torch.float32).expand(n)
        freqs = delta_t[:, None] * inv_freq.to(keys.device)  # [n, head_dim / 2] (or [L, 1, n, hd / 2])
        emb = torch.cat((freqs, freqs), dim=-1)
        return apply_rotary(keys.float(), emb.cos(), emb.sin()).to(keys.dtype)

    @property
    def can_shift(self) -> bool:
        """Round-trip self-test: rope(k, p) shifted by Δ must equal rope(k, p + Δ), and back."""
        if self._can_shift is None:
            gen = torch.Generator().manual_seed(0)
            k = torch.randn(4, self.head_dim, generator=gen).to(self.device)
            # Probe past the original context so length-dependent variants show themselves.
            p = torch.tensor([0, 5, 17, 100], device=self.device)
            q = p + self.max_position_embeddings + 1
            seq_p, seq_q = int(p.max()) + 1, int(q.max()) + 1
            at_p = apply_rotary(k, *self.cos_sin(p, torch.float32, seq_p))
            at_q = apply_rotary(k, *self.cos_sin(q, torch.float32, seq_q))
            moved = self._rotate(at_p, q - p, self.inv_freq)
            back = self._rotate(moved, p - q, self.inv_freq)
            tol = 1e-2  # fp32 angles at ~8k positions carry ~1e-3 error; a failure is O(1)
            self._can_shift = bool(
                torch.allclose(moved, at_q, atol=tol) and torch.allclose(back, at_p, atol=tol)
            )
        return self._can_shift
