"""Fused RMSNorm, rotary and SiLU-and-mul kernels against their torch references."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.models.layers import RotaryEmbedding, apply_rotary

te = pytest.importorskip("flashstack.engine.kernels.triton_elementwise")
DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float32]


def _tol(dtype):
    return dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 100, 4096])
def test_rmsnorm(device, dtype, with_residual, hidden):
    torch.manual_seed(0)
    x = torch.randn(5, hidden, dtype=dtype, device=device)
    res = torch.randn(5, hidden, dtype=dtype, device=device) if with_residual else None
    w = torch.randn(hidden, dtype=dtype, device=device)
    want, want_res = te.rmsnorm_reference(x, w, 1e-6, res)
    got, got_res = te.rmsnorm_triton(x, w, 1e-6, res)
    torch.testing.assert_close(got, want, **_tol(dtype))
    if with_residual:
        torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,dim", [(4, 4, 64), (8, 2, 128), (6, 1, 32)])
def test_rope(device, dtype, hq, hk, dim):
    torch.manual_seed(1)
    rope = RotaryEmbedding(dim, {"rope_theta": 10000.0, "rope_type": "default"}).to(device)
    positions = torch.tensor([0, 3, 17, 511], device=device)
    cos, sin = rope(positions, dtype)
    # strided views, as in a model
    qkv = torch.randn(4, (hq + 2 * hk) * dim, dtype=dtype, device=device)
    q = qkv[:, : hq * dim].view(4, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(4, hk, dim)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = te.rope_triton(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 1000, 2304])
def test_silu_and_mul(device, dtype, n):
    torch.manual_seed(2)
    x = torch.randn(3, 2 * n, dtype=dtype, device=device)
    torch.testing.assert_close(
        te.silu_and_mul_triton(x), te.silu_and_mul_reference(x), **_tol(dtype)
    )
