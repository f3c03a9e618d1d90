"""The batch-1 GEMV on Q8_0 weights (int8, one float16 scale per 32 weights of a row) against the
plain-torch product of the dequantized weight, with each input prologue and output epilogue the
decoder uses (the batch-1 decoder step on Q8_0 weights: test_fp8_weights_gemv.py)."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.kernels import triton_gemv as tg
from flashstack.engine.quantization import dequantize_blocks, dequantized_linear, quantize_blocks
from tests.engine.kernels.test_fp8_weights_gemv import DTYPE, DTYPES, _tol

# (rows, K chunk, warps[, stages]): None (the one-byte configurations), registers, shared memory
CONFIGS = [None, (16, 1024, 8), (2, 512, 4), (8, 512, 4, 3), (4, 2048, 4, 3)]


def _q8(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # blocks of very different magnitudes along each row: a scale applied to the wrong block shows
    w = torch.randn(n, k, device=device) / k**0.5
    w = w * torch.logspace(-2, 1, k // 32, device=device).repeat_interleave(32)[None, :]
    q, scale = quantize_blocks(w)
    return w, q, scale


def _want(x, q, scale, b=None):
    ref = dequantize_blocks(q, scale, torch.float32)
    return torch.nn.functional.linear(x.float(), ref, None if b is None else b.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", [(37, 288), (64, 2112)])  # ragged rows and chunks, several chunks
@pytest.mark.parametrize("with_bias", [False, True])
def test_q8_0_gemv_is_the_dequantized_product(device, dtype, config, n, k, with_bias):
    torch.manual_seed(0)
    w, q, scale = _q8(n, k, device)
    x = torch.randn(1, k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    got = tg.gemv_triton(q, x, b, config, scale=scale)
    torch.testing.assert_close(got, _want(x, q, scale, b), **_tol(dtype))
    exact = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    assert (got.float() - exact.float()).norm() < 0.02 * exact.float().norm()


@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_0_prologues_and_epilogue(device, dtype):
    """norm, SiLU-and-mul and the residual add on Q8_0 weights: each the dequantized reference."""
    torch.manual_seed(1)
    n, k = 48, 640
    _, q, scale = _q8(n, k, device)
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = torch.rand(k, dtype=dtype, device=device) + 0.5
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5)).to(dtype) * g
    got = tg.gemv_triton(q, x, None, norm=(g, 1e-5), scale=scale)
    torch.testing.assert_close(got, _want(normed, q, scale), **_tol(dtype))

    _, q2, scale2 = _q8(n, k // 2, device)
    gate_up = torch.randn(1, k, dtype=dtype, device=device)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.float()).to(dtype) * up
    residual = torch.randn(1, n, dtype=dtype, device=device)
    before = residual.clone()
    out = tg.gemv_triton(q2, gate_up, None, silu=True, residual=residual, scale=scale2)
    assert out.data_ptr() == residual.data_ptr()  # in place
    want = (_want(act, q2, scale2).float() + before.float()).to(dtype)
    torch.testing.assert_close(out, want, **_tol(dtype))


def test_linear_takes_q8_0_weights_for_any_rows(device):
    torch.manual_seed(2)
    _, q, scale = _q8(40, 96, device)
    x = torch.randn(5, 96, dtype=DTYPE, device=device)
    b = torch.randn(40, dtype=DTYPE, device=device)
    many = tg.linear(x, q, b, scale=scale)
    torch.testing.assert_close(many, dequantized_linear(x, q, scale, b))
    torch.testing.assert_close(tg.linear(x[:1], q, b, scale=scale), many[:1], **_tol(DTYPE))


# (M, N, K, skinny config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) or None): ragged N, a K not a
# multiple of the chunk, split-K, and past one row tile
SKINNY = [(3, 70, 224, (32, 64, 1, 4, 2)), (5, 100, 384, (32, 64, 3, 4, 3)), (17, 64, 512, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", SKINNY)
def test_skinny_gemm_on_q8_0_is_the_dequantized_product(device, dtype, m, n, k, config):
    """A few rows (the multi-row decode step): the skinny GEMM dequantizes each chunk in
    registers; the plain-torch product of the dequantized weight is the reference."""
    from flashstack.engine.kernels.triton_skinny import skinny_linear

    torch.manual_seed(m + k)
    _, q, scale = _q8(n, k, device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    got = skinny_linear(x, q, b, config, scale=scale)
    want = dequantized_linear(x, q, scale, b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_one_pass_dequantization_is_dequantize_blocks(device):
    from flashstack.engine.kernels.triton_dequant import dequantize_triton

    torch.manual_seed(4)
    _, q, scale = _q8(33, 4160, device)  # 137,280 weights: a last program only partly full
    for dtype in (torch.float32, DTYPE):
        got = dequantize_triton(q, scale, dtype)
        assert torch.equal(got, dequantize_blocks(q, scale, dtype))
