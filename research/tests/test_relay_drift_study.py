"""research/relay_drift_study.py: the estimates of the non-recomputed tokens' moves, on toy shapes."""

import torch
from relay_drift_study import by_group, kernel, ridge


def test_kernel_at_a_low_temperature_takes_the_most_similar_sources_move():
    src_feat = torch.tensor([[[10.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])  # [H=1, 3 sources, d=2]
    src_move = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    # closest in angle to source 1 (a dot product would pick source 0, the longest), then to source 2
    tgt_feat = torch.tensor([[[0.2, 1.0], [-3.0, 0.2]]])
    out = kernel(tgt_feat, src_feat, src_move, 1e-3)
    assert torch.allclose(out, torch.tensor([[[3.0, 4.0], [5.0, 6.0]]]), atol=1e-4)
    # a high temperature tends to the plain mean
    assert torch.allclose(kernel(tgt_feat, src_feat, src_move, 1e6), src_move.mean(1, keepdim=True).expand(1, 2, 2),
                          atol=1e-4)


def test_ridge_keeps_the_sources_mean_and_finds_a_linear_move():
    torch.manual_seed(0)
    src_feat, tgt_feat = torch.randn(2, 40, 3), torch.randn(2, 5, 3)
    constant = torch.tensor([0.5, -1.0])[None, None].expand(2, 40, 2)  # every source moved alike
    assert torch.allclose(ridge(tgt_feat, src_feat, constant, 1.0), constant[:, :5], atol=1e-5)
    weights = torch.randn(2, 3, 2)
    linear = src_feat @ weights + 0.3  # [H, 40, 2]
    near = ridge(tgt_feat, src_feat, linear, 1e-6)
    assert torch.allclose(near, tgt_feat @ weights + 0.3, atol=1e-3)
    shrunk = ridge(tgt_feat, src_feat, linear, 10.0)  # a heavy penalty pulls toward the mean, not toward zero
    mean = linear.mean(1, keepdim=True)
    assert (shrunk - mean).norm() < (near - mean).norm()


def test_by_group_estimates_within_a_group_and_falls_back_to_every_sources_mean():
    src_move = torch.tensor([[[1.0], [3.0], [10.0]]])  # [H=1, 3 sources, 1]
    groups_s, groups_t = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2])

    def group_mean(rows, src):
        return src_move[:, src].mean(1, keepdim=True).expand(1, rows.numel(), 1)

    out = by_group(groups_t, groups_s, src_move, group_mean, (1, 3, 1))
    assert torch.allclose(out.flatten(), torch.tensor([2.0, 10.0, 14.0 / 3]))  # group 2 has no source: all three
