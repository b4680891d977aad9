"""The KV caches an engine allocates: zeros, and on the CPU mapped only where written (a worker's start does not
fault in the whole cache)."""

from __future__ import annotations

import sys

import pytest
import torch

from deepinfer.dataplane.buffers import resident_fraction
from deepinfer.engine.memory import zeroed_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_kv_cache_is_zero_and_its_pages_are_mapped_where_written(dtype):
    shape = (2, 1024, 16, 4, 64)  # [K/V, num_blocks, block_size, num_kv_heads, head_dim]: 32 MiB in float32
    cache = zeroed_kv_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    num_bytes = cache.numel() * cache.element_size()
    if sys.platform.startswith("linux"):
        assert resident_fraction(cache.data_ptr(), num_bytes) == 0.0
    cache[:, 3] = 1.0
    if sys.platform.startswith("linux"):  # block 3 of K and of V: two pages each, or two huge pages with THP
        assert 0.0 < resident_fraction(cache.data_ptr(), num_bytes) < 0.25
    assert torch.count_nonzero(cache) == cache[:, 3].numel()
    assert torch.all(cache[:, 3] == 1.0)
