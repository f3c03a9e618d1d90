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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_launches_wait_for_their_producers_in_a_graph():
    """Under programmatic dependent launch (Hopper) each kernel may start before its producer has
    drained: in a captured chain of skinny products, RMSNorm with the residual add, SiLU-and-mul
    and the q/k/v kernel, replayed on new inputs, every output equals the chain launched without
    PDL."""
    from flashstack.engine.kernels.triton_qkv import rope_and_store_kv_triton
    from flashstack.engine.kernels.triton_skinny import skinny_linear

    torch.manual_seed(3)
    bf16, rows, hidden, heads, dim = torch.bfloat16, 8, 4096, 8, 128
    x = torch.randn(rows, hidden, dtype=bf16, device="cuda")
    residual = torch.randn_like(x)
    gain = torch.randn(hidden, dtype=bf16, device="cuda")
    w_up = torch.randn(2 * 6144, hidden, dtype=bf16, device="cuda") / hidden**0.5
    w_qkv = torch.randn(3 * heads * dim, hidden, dtype=bf16, device="cuda") / hidden**0.5
    cos = torch.rand(rows, 1, dim, dtype=bf16, device="cuda")
    sin = torch.rand(rows, 1, dim, dtype=bf16, device="cuda")
    slots = torch.arange(rows, device="cuda") * 3

    def chain(pdl: bool) -> list[torch.Tensor]:
        normed, stream = te.rmsnorm_triton(x, gain, 1e-5, residual, pdl=pdl)
        act = te.silu_and_mul_triton(skinny_linear(normed, w_up, pdl=pdl), pdl=pdl)
        normed2, stream2 = te.rmsnorm_triton(act[:, :hidden], gain, 1e-5, stream, pdl=pdl)
        qkv = skinny_linear(normed2, w_qkv, pdl=pdl).view(rows, 3 * heads, dim)
        cache = torch.zeros(8, 2, 16, heads, dim, dtype=bf16, device="cuda")
        q = rope_and_store_kv_triton(
            qkv[:, :heads],
            qkv[:, heads : 2 * heads],
            qkv[:, 2 * heads :],
            cos,
            sin,
            cache,
            slots,
            pdl=pdl,
        )
        return [stream, act, stream2, q, cache]

    chain(True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    for t in (x, residual):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, chain(False)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
