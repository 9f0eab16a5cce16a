"""research/relay_anchor_blend.py: the rows a readout was fitted from, kept past the pool's freeze."""

import torch
from relay_anchor_blend import teach_keeping_rows

from kvrelay.cache.store import KVStore
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.move_readout import MoveReadout
from tests.helpers import generate, tiny_lm
from tests.reuse.test_relay_anchors import _downstream


def test_the_kept_rows_refit_the_methods_own_readout():
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=2,anchor_blend=0.5,l_start={n},l_det={n},l_end={n}]")
    rows = teach_keeping_rows(lambda: [generate(lm, call, method, store, SamplingConfig(max_new_tokens=1))
                                       for _ in range(2)])
    assert list(rows) == ["agent/up"]
    side, moves = rows["agent/up"]
    assert side.shape[0] == moves.shape[0] == 48 and method.pool.num_tokens("agent/up") == 0  # both calls, frozen
    again = MoveReadout(method.anchor_ridge)
    again.fit("agent/up", side, moves)
    x = torch.randn(5, side.shape[1])
    torch.testing.assert_close(again.predict("agent/up", x), method.readout.predict("agent/up", x))
