"""research/relay_anchor_shift.py: the per-layer, per-head anchor estimate and the roles, on toy shapes."""

import torch
from relay_anchor_shift import anchor_moves, roles_of

from kvrelay.reuse.base import CallInput, SpanLoad
from kvrelay.reuse.spans import ReusePlan


def test_anchor_moves_match_by_angle_per_layer_and_head():
    # [L=2, H=1, 3 pool tokens, d=2]; layer 1's features are layer 0's swapped, so its nearest token differs
    pool_feat = torch.tensor([[[[10.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]]]).expand(2, 1, 3, 2).clone()
    pool_feat[1] = pool_feat[1].flip(-1)
    pool_dk = torch.arange(12.0).view(1, 1, 3, 4)[..., :2].expand(2, 1, 3, 2).clone()  # token j moved by (4j, 4j+1)
    pool_dv = -pool_dk
    feat = torch.tensor([[[[0.2, 1.0]]], [[[0.2, 1.0]]]])  # [L=2, H=1, 1 token, d=2]
    dk, dv = anchor_moves(feat, pool_feat, pool_dk, pool_dv, 1e-3)
    assert torch.allclose(dk[0, 0, 0], torch.tensor([4.0, 5.0]), atol=1e-4)  # layer 0: token 1 (angle, not length)
    assert torch.allclose(dk[1, 0, 0], torch.tensor([0.0, 1.0]), atol=1e-4)  # layer 1: token 0
    assert torch.equal(dv, -dk)


def test_roles_name_the_agent_and_the_spans_place():
    call = CallInput([0] * 10, name="critic")
    reuse = ReusePlan(approx=[SpanLoad("p/solver", 0, 2, 1), SpanLoad("p/solver", 5, 8, 4)])
    assert roles_of(call, reuse) == ["critic#0"] * 2 + ["critic#1"] * 3
