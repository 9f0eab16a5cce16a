"""The paged layout the connector reads is the one vLLM's own CPU attention kernel writes (vLLM needed, no server)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_layout_is_found_and_read_back(dtype):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvrelay.vllm.connector import key_layout
    from kvrelay.vllm.paged import PagedKV

    num_blocks, heads, block, head_dim = 3, 3, 128, 64
    isa = _get_attn_isa(dtype, block, head_dim)
    kv = torch.zeros(num_blocks, heads, block, 2 * head_dim, dtype=dtype)
    layout = key_layout(kv, heads, head_dim, isa)
    # what the kernel writes for a request's positions 0..9 in blocks [2, 0], the connector reads back
    key = torch.randn(10, heads, head_dim).to(dtype)
    value = torch.randn(10, heads, head_dim).to(dtype)
    slots = torch.tensor([2 * block + i for i in range(10)])
    key_cache, value_cache = kv.view(num_blocks, heads, 2 * block, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    paged = PagedKV([kv], block, heads, head_dim, layout)
    k, v = paged.read(paged.slots([2, 0], 0, 10))
    assert torch.equal(k[0], key.transpose(0, 1)) and torch.equal(v[0], value.transpose(0, 1))
