"""On CUDA, attention leaves out cuDNN's SDPA (a plan per new prompt length); every forward asks for that."""

import contextlib

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.model import transformer
from kvrelay.model.layers import attention_backends
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
