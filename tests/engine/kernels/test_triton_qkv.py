"""The fused q/k-norm + rotary + KV-store kernel against the unfused kernels and torch
references."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.kernels.attention import store_kvcache_reference
from flashstack.engine.models.layers import RotaryEmbedding, apply_rotary

tq = pytest.importorskip("flashstack.engine.kernels.triton_qkv")
te = pytest.importorskip("flashstack.engine.kernels.triton_elementwise")
ta = pytest.importorskip("flashstack.engine.kernels.triton_attention")

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float32]


def _inputs(device, dtype, hq, hk, dim, block_size, n=4):
    torch.manual_seed(0)
    rope = RotaryEmbedding(dim, {"rope_theta": 10000.0, "rope_type": "default"}).to(device)
    positions = torch.tensor([0, 3, 17, 511][:n], device=device)
    cos, sin = rope(positions, dtype)
    # strided views, as in a model
    qkv = torch.randn(n, (hq + 2 * hk) * dim, dtype=dtype, device=device)
    q = qkv[:, : hq * dim].view(n, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(n, hk, dim)
    v = qkv[:, (hq + hk) * dim :].view(n, hk, dim)
    num_blocks = 3
    cache = torch.randn(num_blocks, 2, block_size, hk, dim, dtype=dtype, device=device)
    # Scattered slots, one of them padding (-1: nothing written).
    slots = torch.tensor(
        [2 * block_size + 1, -1, 5, block_size - 1][:n], dtype=torch.int64, device=device
    )
    return q, k, v, cos, sin, cache, slots


def _tol(dtype):
    return dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hk,dim,block_size", [(4, 4, 64, 16), (8, 2, 128, 256), (6, 1, 32, 16)])
def test_fused_matches_unfused_kernels(device, dtype, qk_norm, hq, hk, dim, block_size):
    q, k, v, cos, sin, cache, slots = _inputs(device, dtype, hq, hk, dim, block_size)
    qw = torch.randn(dim, dtype=dtype, device=device) if qk_norm else None
    kw = torch.randn(dim, dtype=dtype, device=device) if qk_norm else None

    uq, uk, uv, ucache = q.clone(), k.clone(), v.clone(), cache.clone()
    if qk_norm:
        uq = te.rmsnorm_triton(uq, qw, 1e-6)[0]
        uk = te.rmsnorm_triton(uk, kw, 1e-6)[0]
    uq, uk = te.rope_triton(uq, uk, cos, sin)
    ta.store_kvcache_triton(uk, uv, ucache, slots)

    got_q = tq.rope_and_store_kv_triton(q, k, v, cos, sin, cache, slots, qw, kw, 1e-6)
    # Same roundings as the unfused kernels: identical bits, except that the head norm sums its two
    # halves separately (a different fp32 summation order, so the last bit may differ).
    tol = _tol(dtype) if qk_norm else dict(atol=0, rtol=0)
    torch.testing.assert_close(got_q, uq, **tol)
    torch.testing.assert_close(cache, ucache, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_torch_reference(device, dtype):
    hq, hk, dim, bs = 8, 2, 64, 16
    q, k, v, cos, sin, cache, slots = _inputs(device, dtype, hq, hk, dim, bs)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    want_cache = cache.clone()
    keep = slots >= 0
    store_kvcache_reference(want_k[keep], v[keep], want_cache, slots[keep])
    got_q = tq.rope_and_store_kv_triton(q, k, v, cos, sin, cache, slots)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(cache, want_cache, **_tol(dtype))
    # The padded slot's token wrote nothing: every block row it could have hit is unchanged.
    assert torch.equal(cache[0, :, 0], want_cache[0, :, 0])
