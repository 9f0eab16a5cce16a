"""research/gpu_anchors.py's exact part on the CPU: it passes, and its bar fails when the key moves are misrotated."""

import gpu_anchors
import pytest
import torch

from kvrelay.model.rope import RotaryEmbedding


def test_exact_case_passes_on_cpu():
    row = gpu_anchors._exact_one("qwen2", torch.float32, "cpu", 0)
    assert row["ok"] and row["selecting"]["ok"] and row["prepared"]["ok"]
    assert row["priors_recomputed_token_layers"] == 0 and row["selecting"]["recomputed_token_layers"] == 12


@pytest.mark.parametrize("bug", ["unrotated", "rotated twice"])
def test_exact_bar_catches_misrotated_key_moves(monkeypatch, bug):
    add = RotaryEmbedding.add_keys_at

    def planted(self, keys_free, start, out):
        if bug == "unrotated":
            out += keys_free.to(out.dtype)
        else:
            add(self, self.shift_keys(keys_free, torch.arange(start, start + keys_free.shape[-2])), start, out)

    monkeypatch.setattr(RotaryEmbedding, "add_keys_at", planted)
    monkeypatch.setattr(gpu_anchors, "_selecting", lambda *args: {"ok": True})
    monkeypatch.setattr(gpu_anchors, "_prepared", lambda *args: {"ok": True})
    row = gpu_anchors._exact_one("qwen2", torch.bfloat16, "cpu", 6)
    # the first token hardly reads the toy's span keys: the KL alone would pass; the span keys' bar does not
    assert row["kl_anchors"] < row["kl_naive"] / 5
    assert not row["ok"]


def test_prepared_bar_catches_a_prepared_span_misrotated(monkeypatch):
    """The prepared case's bar fails when the anchored span's key moves are rotated for the wrong positions."""
    from kvrelay.reuse import anchor_prep

    anchored = anchor_prep.anchored_span

    def planted(span, k_move, v_move, rope):
        return anchored(span, rope.shift_keys(k_move, 3), v_move, rope)

    monkeypatch.setattr(anchor_prep, "anchored_span", planted)
    monkeypatch.setattr("kvrelay.reuse.relay_anchors.anchored_span", planted)
    monkeypatch.setattr(gpu_anchors, "_selecting", lambda *args: {"ok": True})
    row = gpu_anchors._exact_one("qwen2", torch.float32, "cpu", 0)
    assert not row["prepared"]["ok"]
