"""On CUDA, attention leaves out cuDNN's SDPA (a plan per new prompt length) and runs masks on repeated K/V heads."""

import contextlib

import torch
import torch.nn.functional as F

from kvrelay.cache.kv import SequenceKV
from kvrelay.model import transformer
from kvrelay.model.layers import attention, attention_backends, repeat_kv, visible_mask
from tests.helpers import tiny_lm


def test_cuda_forwards_leave_cudnn_attention_out_and_restore_it():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before  # CPU: nothing changed


def test_prefill_and_decode_run_under_their_devices_backends(monkeypatch):
    devices = []

    def recording(device):
        devices.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(transformer, "attention_backends", recording)
    lm = tiny_lm("llama3")
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    lm.model.prefill(torch.arange(5), cache)
    lm.model.decode_step(7, cache)
    assert devices == [torch.device("cpu")] * 2


def test_kv_repeated_per_query_head_attend_as_grouped_heads():
    """The CUDA path under a mask (K/V repeated per query head, for SDPA's memory-efficient kernel) gives what
    grouped heads give: head j*group + i reads kv head j."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((6, 5, 8), (2, 9, 8), (2, 9, 8)))
    assert torch.equal(repeat_kv(k, 3), k.repeat_interleave(3, dim=0))
    mask = visible_mask(torch.tensor([1, 4, 6, 7, 8]), 9, None)
    grouped = attention(q, k, v, mask, False)  # CPU: enable_gqa
    repeated = F.scaled_dot_product_attention(q[None], repeat_kv(k, 3)[None], repeat_kv(v, 3)[None],
                                              attn_mask=mask[None, None])[0].transpose(0, 1).reshape(5, -1)
    torch.testing.assert_close(repeated, grouped, atol=1e-12, rtol=0)
