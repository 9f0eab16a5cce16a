"""research/relay_oracle_shift.py: the moves given to the span tokens an oracle selection leaves, on toy shapes."""

import pytest
import torch
from relay_oracle_shift import MEAN_SCALES, corrections


def _moves() -> tuple[torch.Tensor, torch.Tensor]:
    # [L=2, Hkv=1, m=5, hd=1]: token i moves by i + 1 (x 10 at layer 1); values move by minus that
    dk = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0]])[:, None, :, None]
    return dk, -dk


def test_each_correction_moves_the_left_tokens_as_its_name_says():
    dk, dv = _moves()
    chosen = torch.tensor([True, False, False, True, False])
    span_of = torch.tensor([0, 0, 1, 1, 2])  # span 2 has no recomputed token
    out = corrections(dk, dv, chosen, span_of)
    left_k = lambda name: out[name][0][0, 0, :, 0].tolist()  # noqa: E731 (layer 0's key moves of the left tokens)
    assert left_k("exact") == [2.0, 3.0, 5.0]
    assert left_k("span mean") == [1.5, 3.5, 5.0]  # its span's tokens, the recomputed ones included
    scale = MEAN_SCALES[0]
    assert left_k(f"recomputed mean x{scale}") == pytest.approx([scale * 2.5] * 3)  # tokens 0 and 3
    # its span's recomputed token; span 2 has none: all the recomputed tokens' mean
    assert left_k(f"recomputed span mean x{scale}") == pytest.approx([scale * 1.0, scale * 4.0, scale * 2.5])
    assert torch.equal(out["exact"][1], -out["exact"][0])  # values ride along with their own moves
    assert torch.equal(out["span mean"][0][1], 10 * out["span mean"][0][0])  # per layer, not pooled over layers


def test_nothing_recomputed_leaves_only_the_moves_that_need_no_recomputed_token():
    dk, dv = _moves()
    out = corrections(dk, dv, torch.zeros(5, dtype=torch.bool), torch.tensor([0, 0, 1, 1, 2]))
    assert set(out) == {"exact", "span mean"}
    assert out["span mean"][0][0, 0, :, 0].tolist() == [1.5, 1.5, 3.5, 3.5, 5.0]
