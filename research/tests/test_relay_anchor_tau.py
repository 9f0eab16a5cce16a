"""research/relay_anchor_tau.py: a threshold set by the share of span tokens above it."""

import torch
from relay_anchor_tau import tau_for_share


def test_the_threshold_leaves_its_share_of_the_misses_above_it():
    misses = torch.randperm(1000).float()  # 0..999, shuffled
    for share in (0.05, 0.06, 0.5):
        tau = tau_for_share(misses, share)
        assert int((misses > tau).sum()) == round(share * 1000)
