"""A band's selection in row chunks: the attention mass its choice reads (relay's influence, over the new tokens'
queries) is summed chunk by chunk as the rows are projected, so no piece computes it whole; it equals one forward's
up to float rounding; and a projected row is priced at its projection's share of a layer, its chunk's mass rows by
the scores they compute."""

from __future__ import annotations

import pytest
import torch

from kvrelay.model import selecting
from kvrelay.model.prefill_state import PartialLayer, projection_share
from kvrelay.model.schedule import LayerView
from tests.helpers import relayed_call
from tests.model.test_row_chunks import ATOL, _planned

# relay's admission (its span tokens chosen before they enter at 1) and its selector (they enter at 1, chosen at 2),
# the paper's thresholds and the budget, each reading the new tokens' influence
READS_MASS = ["relay[band=1:1:3]", "relay[band=1:2:3]", "relay[band=1:1:3,keep_share=0.5]",
              "relay[band=1:2:3,keep_share=0.5]"]
CHUNK_ROWS = 3


@pytest.fixture(scope="module", params=["llama3", "gemma3"])
def setup(request):
    return relayed_call(request.param)


def _masses_read(monkeypatch, lm, store, call, method: str, chunk_rows: int | None):
    """The masses the choice read [(layer, rows, mass)] and the query rows of every attention-probability call the
    selection made, of one forward (``chunk_rows`` None) or of every layer in row chunks of ``chunk_rows``."""
    read, prob_rows = [], []
    original_mass, original_probs = LayerView.attention_mass, selecting.attention_probs

    def mass(view, rows):
        out = original_mass(view, rows)
        read.append((view.layer, rows.clone(), out.clone()))
        return out

    def probs(q, k, mask):
        prob_rows.append(q.shape[1])
        return original_probs(q, k, mask)

    monkeypatch.setattr(LayerView, "attention_mass", mass)
    monkeypatch.setattr(selecting, "attention_probs", probs)
    plan, cache = _planned(lm, store, call, method)
    ids = torch.tensor(call.prompt_ids)
    if chunk_rows is None:
        lm.model.prefill(ids, cache, plan.schedule)
    else:
        forward = lm.model.begin_prefill(ids, cache, plan.schedule)
        while not forward.done:
            lm.model.prefill_rows(forward, chunk_rows)
    monkeypatch.undo()
    return read, prob_rows


@pytest.mark.parametrize("method", READS_MASS)
def test_the_mass_a_choice_reads_is_summed_by_chunks_as_one_forward_sums_it(setup, monkeypatch, method):
    lm, store, call = setup
    whole, whole_probs = _masses_read(monkeypatch, lm, store, call, method, None)
    chunked, chunked_probs = _masses_read(monkeypatch, lm, store, call, method, CHUNK_ROWS)
    assert len(whole) == len(chunked) == 1  # the choice read it once, at its layer
    (layer, rows, mass), (chunk_layer, chunk_rows, chunk_mass) = whole[0], chunked[0]
    assert layer == chunk_layer and torch.equal(rows, chunk_rows) and rows.numel() > CHUNK_ROWS
    assert float(mass.sum()) > 0
    torch.testing.assert_close(chunk_mass, mass, atol=ATOL, rtol=0)
    # one forward computes every query row's probabilities at once; row chunks never more rows than a chunk
    assert whole_probs == [rows.numel()]
    assert chunked_probs and max(chunked_probs) <= CHUNK_ROWS


def test_a_projected_row_is_priced_at_its_projection_and_its_chunks_mass_scores(setup):
    """An admission's rows (relay's, at layer 1) are projected only: each costs the projection's share of a layer's
    row (from the weights it multiplies through), and the new tokens among a chunk's rows attend to every key up to
    the chunk's last position; the layer after it follows."""
    lm, store, call = setup
    layer = lm.model.model.layers[1]
    weights = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    sizes = [w.weight.numel() for w in weights]
    share = sum(sizes[:3]) / sum(sizes)
    assert projection_share(lm.config) == pytest.approx(share)
    plan, cache = _planned(lm, store, call, "relay[band=1:1:3]")
    model, n = lm.model, len(call.prompt_ids)
    forward = model.begin_prefill(torch.tensor(call.prompt_ids), cache, plan.schedule)
    model.prefill_rows(forward)  # layer 0
    num_active, num_entering = forward.act.idx.numel(), forward.entries[1].token_idx.numel()
    mass_rows = plan.schedule.mass_rows(1, forward.act.idx).tolist()
    assert 0 < len(mass_rows) <= num_active
    # not begun: the admission's projections and mass, then the layer over every token
    num = num_active + num_entering
    assert forward.upcoming() == pytest.approx((num + num_active * share, num * n + len(mass_rows) * n))
    model.start_layer(forward)
    part = forward.partial
    assert part.admitting and forward.next_rows() == (forward.act.idx.tolist(), False)
    positions = part.positions
    for num_rows in (1, 4, num_active):
        num_mass = sum(row < num_rows for row in mass_rows)
        assert part.cost(num_rows) == pytest.approx((num_rows * share, num_mass * (positions[num_rows - 1] + 1)))
    tokens, scores = part.cost(num_active)
    assert part.upcoming() == pytest.approx((tokens + num, scores + num * n))


def test_a_phase_prices_its_rows_chunk_by_chunk():
    """Rows at positions 2, 5, 7, 9, of which the 2nd and 4th are mass rows, projection share 1/4: projecting, a chunk
    costs a quarter token a row and its mass rows' scores against the keys to its last position; then a kept row the
    other three quarters and its scores against the same keys."""
    rows = torch.tensor([2, 5, 7, 9])
    empty = torch.zeros(4, 1)
    part = PartialLayer(0, True, rows, empty, empty, empty, None, mass_rows=torch.tensor([1, 3]), projection_share=0.25)
    assert [part.cost(num) for num in (0, 1, 2, 3, 4)] == [(0.0, 0), (0.25, 0), (0.5, 6), (0.75, 8), (1.0, 20)]
    assert part.upcoming() == (1.0 + 4 * 0.75, 20 + 4 * 10)
    part.num_done = 2
    assert part.cost(1) == (0.25, 0) and part.cost(2) == (0.5, 10) and part.upcoming() == (0.5 + 3.0, 10 + 40)
    part.projecting, part.num_done = False, 1  # the kept rows attend
    assert part.cost(2) == (1.5, 16) and part.upcoming() == (2.25, 30)
    plain = PartialLayer(0, False, rows, empty, empty, empty, None, projection_share=0.25)
    assert plain.cost(3) == (3, 24) and plain.upcoming() == (4, 40)
