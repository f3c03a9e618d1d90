"""A CPU KV cache holds memory as its blocks fill, not its whole budget from start-up."""

from __future__ import annotations

import psutil
import pytest
import torch

from flashstack.engine.kv_cache import allocate_kv_cache

_MiB = 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_cache_is_zero_and_committed_on_first_write(dtype) -> None:
    rss = psutil.Process().memory_info
    shape = (2, 512, 2, 16, 8, 64)  # [layers, blocks, K|V, block, heads, head_dim]: 512 MiB fp32
    before = rss().rss
    cache = allocate_kv_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert rss().rss - before < 32 * _MiB  # torch.zeros would have written every page
    cache[0, :4] = 1  # four blocks of one layer
    assert rss().rss - before < 32 * _MiB
    assert cache[0, :4].float().eq(1).all() and cache[1, 300].float().eq(0).all()
