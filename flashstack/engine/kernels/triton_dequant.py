"""Q8_0 and Q4_K weights dequantized into the compute dtype in one pass, for the products with more
rows than the skinny GEMM takes (prefill): the stored bytes read once, the 16-bit weight written
once, then cuBLAS. In plain torch the same takes several passes over float32 temporaries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.engine.kernels.triton_q4k import group_scales

_BLOCK = 4096  # Q8_0 weights per program: 128 blocks
_GROUPS = 64  # Q4_K 64-weight groups per program: 4096 weights of a row


@triton.jit
def _dequantize_q8_kernel(q_ptr, s_ptr, w_ptr, total, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    q = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + idx // 32, mask=mask, other=0.0).to(tl.float32)
    tl.store(w_ptr + idx, (q * s).to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _column(x, GROUPS: tl.constexpr):
    # [1, GROUPS] -> [GROUPS, 1]
    return tl.reshape(x, (GROUPS, 1))


@triton.jit
def _dequantize_q4k_kernel(q_ptr, s_ptr, w_ptr, N, K, GROUPS: tl.constexpr):
    # Each program: GROUPS 64-weight groups of one row (two sub-blocks each, the low and the high
    # nibbles of 32 bytes).
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    rows = tl.full([1], row, tl.int32)
    mask = (g < K // 64)[None, :]
    sc_lo, m_lo, sc_hi, m_hi, d, dmin = group_scales(s_ptr, rows, g, K, mask)
    i = tl.arange(0, 32)
    byte = row.to(tl.int64) * (K // 2) + (g * 32)[:, None] + i[None, :]
    column = (g < K // 64)[:, None]
    q = tl.load(q_ptr + byte, mask=column, other=0)
    lo = (q & 15).to(tl.float32) * _column(d * sc_lo, GROUPS) - _column(dmin * m_lo, GROUPS)
    hi = (q >> 4).to(tl.float32) * _column(d * sc_hi, GROUPS) - _column(dmin * m_hi, GROUPS)
    out = w_ptr + row.to(tl.int64) * K + (g * 64)[:, None] + i[None, :]
    tl.store(out, lo.to(w_ptr.dtype.element_ty), mask=column)
    tl.store(out + 32, hi.to(w_ptr.dtype.element_ty), mask=column)


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` that Q8_0's int8 `q` [N, K] and float16 block scales
    [N, K / 32], or Q4_K's values uint8 [N, K / 2] and int32 words [N, K / 64 + K / 256], stand
    for (each value computed in float32 and rounded once: engine/quantization.py)."""
    assert q.is_contiguous() and scale.is_contiguous()
    if q.dtype == torch.uint8:
        n, k = q.shape[0], q.shape[1] * 2
        assert scale.shape == (n, k // 64 + k // 256) and k % 256 == 0
        w = torch.empty(n, k, dtype=dtype, device=q.device)
        grid = (n, triton.cdiv(k // 64, _GROUPS))
        _dequantize_q4k_kernel[grid](q, scale, w, n, k, GROUPS=_GROUPS)
        return w
    n, k = q.shape
    assert scale.shape == (n, k // 32)
    w = torch.empty(n, k, dtype=dtype, device=q.device)
    _dequantize_q8_kernel[(triton.cdiv(n * k, _BLOCK),)](q, scale, w, n * k, BLOCK=_BLOCK)
    return w
