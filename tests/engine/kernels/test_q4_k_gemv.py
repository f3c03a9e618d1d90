"""The products on Q4_K weights (4-bit values, 6-bit scales and mins per 32 under a super-block's
float16 d and dmin) against the plain-torch product of the dequantized weight: the batch-1 GEMV with
each input prologue and output epilogue the decoder uses, the skinny GEMM of the multi-row decode
step, and the one-pass dequantization of prefill."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.kernels import triton_gemv as tg
from flashstack.engine.quantization import dequantize_q4_k, dequantized_linear, quantize_q4_k
from tests.engine.kernels.test_fp8_weights_gemv import DTYPE, DTYPES, _tol

# (rows, K chunk in bytes, warps[, stages]): None (Q4K_CONFIGS), registers, shared memory, a chunk
# of one 64-weight group
ONE_GROUP = (4, 32, 4, 2)
CONFIGS = [None, (16, 512, 8), (2, 256, 4), (8, 512, 4, 3), ONE_GROUP]
# ragged rows and chunks; several chunks and super-blocks. A one-group chunk walks 36 chunks a
# program at K = 2,304 (~7 s a case in the interpreter): it takes four super-blocks instead.
GEMV_CASES = [
    (9, 1024, config) if config == ONE_GROUP and k == 2304 else (n, k, config)
    for config in CONFIGS
    for n, k in [(37, 256), (64, 2304)]
]


def _q4(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # sub-blocks of very different magnitudes and offsets along each row: a scale or a min applied
    # to the wrong sub-block shows
    w = torch.randn(n, k, device=device) / k**0.5
    w = w * torch.logspace(-2, 1, k // 32, device=device).repeat_interleave(32)[None, :]
    w = w + torch.linspace(-0.05, 0.1, k // 32, device=device).repeat_interleave(32)[None, :]
    qs, head = quantize_q4_k(w)
    return w, qs, head


def _want(x, qs, head, b=None):
    ref = dequantize_q4_k(qs, head, torch.float32)
    return torch.nn.functional.linear(x.float(), ref, None if b is None else b.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,config", GEMV_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_k_gemv_is_the_dequantized_product(device, dtype, n, k, config, with_bias):
    torch.manual_seed(0)
    w, qs, head = _q4(n, k, device)
    x = torch.randn(1, k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    got = tg.gemv_triton(qs, x, b, config, scale=head)
    torch.testing.assert_close(got, _want(x, qs, head, b), **_tol(dtype))
    exact = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    assert (got.float() - exact.float()).norm() < 0.1 * exact.float().norm()  # 4 bits a weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_q4_k_prologues_and_epilogue(device, dtype):
    """norm, SiLU-and-mul and the residual add on Q4_K weights: each the dequantized reference."""
    torch.manual_seed(1)
    n, k = 48, 768
    _, qs, head = _q4(n, k, device)
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = torch.rand(k, dtype=dtype, device=device) + 0.5
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5)).to(dtype) * g
    got = tg.gemv_triton(qs, x, None, norm=(g, 1e-5), scale=head)
    torch.testing.assert_close(got, _want(normed, qs, head), **_tol(dtype))

    _, qs2, head2 = _q4(n, k // 3, device)
    gate_up = torch.randn(1, 2 * k // 3, dtype=dtype, device=device)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.float()).to(dtype) * up
    residual = torch.randn(1, n, dtype=dtype, device=device)
    before = residual.clone()
    out = tg.gemv_triton(qs2, gate_up, None, silu=True, residual=residual, scale=head2)
    assert out.data_ptr() == residual.data_ptr()  # in place
    want = (_want(act, qs2, head2).float() + before.float()).to(dtype)
    torch.testing.assert_close(out, want, **_tol(dtype))


def test_linear_takes_q4_k_weights_for_any_rows(device):
    torch.manual_seed(2)
    _, qs, head = _q4(40, 512, device)
    x = torch.randn(5, 512, dtype=DTYPE, device=device)
    b = torch.randn(40, dtype=DTYPE, device=device)
    many = tg.linear(x, qs, b, scale=head)
    torch.testing.assert_close(many, dequantized_linear(x, qs, head, b))
    torch.testing.assert_close(tg.linear(x[:1], qs, b, scale=head), many[:1], **_tol(DTYPE))


# (M, N, K, skinny config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) or None): ragged N, a K slice
# not a multiple of the chunk (split in three), and past one row tile
SKINNY = [(3, 70, 256, (32, 64, 1, 4, 2)), (5, 100, 768, (32, 128, 3, 4, 3)), (17, 64, 512, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", SKINNY)
def test_skinny_gemm_on_q4_k_is_the_dequantized_product(device, dtype, m, n, k, config):
    """A few rows: each chunk's low and high nibbles dequantized in registers, each multiplied with
    its own inputs; the plain-torch product of the dequantized weight is the reference."""
    from flashstack.engine.kernels.triton_skinny import skinny_linear

    torch.manual_seed(m + k)
    _, qs, head = _q4(n, k, device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    got = skinny_linear(x, qs, b, config, scale=head)
    want = dequantized_linear(x, qs, head, b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_one_pass_dequantization_is_dequantize_q4_k(device):
    from flashstack.engine.kernels.triton_dequant import dequantize_triton

    torch.manual_seed(4)
    _, qs, head = _q4(33, 4352, device)  # 561 super-blocks: a last program only partly full
    for dtype in (torch.float32, DTYPE):
        assert torch.equal(dequantize_triton(qs, head, dtype), dequantize_q4_k(qs, head, dtype))
