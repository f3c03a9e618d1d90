"""Reading Q4_K inside a Triton kernel (engine/quantization.py has the format): per 64 weights one
int32 word with the scale and min of its two sub-blocks, per super-block one with the float16 d
and dmin, and a chunk of values dequantized in registers. The GEMV (triton_gemv.py), the skinny
GEMM (triton_skinny.py) and the one-pass dequantization (triton_dequant.py) share these."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _half(bits):
    # the float16 whose bits are the low 16 of `bits` (uint32), widened to float32
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def group_scales(s_ptr, rows, g, K, mask):
    """For the 64-weight groups g of `rows` ([BLOCK_N] and [G]; `mask` [BLOCK_N, G]), each
    [BLOCK_N, G] float32: the 6-bit scale and min of the group's first sub-block, of its second,
    and its super-block's d and dmin. s_ptr: the int32 words [N, K / 64 + K / 256]."""
    row = s_ptr + rows[:, None].to(tl.int64) * (K // 64 + K // 256)
    word = tl.load(row + g[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
    halves = tl.load(row + K // 64 + (g // 4)[None, :], mask=mask, other=0)
    halves = halves.to(tl.uint32, bitcast=True)
    sc_lo = (word & 255).to(tl.float32)
    m_lo = ((word >> 8) & 255).to(tl.float32)
    sc_hi = ((word >> 16) & 255).to(tl.float32)
    m_hi = (word >> 24).to(tl.float32)
    return sc_lo, m_lo, sc_hi, m_hi, _half(halves), _half(halves >> 16)


@triton.jit
def dequantize_chunk(w, s_ptr, rows, k, K, dtype, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights k .. k + BLOCK_K of `rows` in `dtype`, from their BLOCK_K / 2 bytes of values `w`:
    (lo, hi), each [BLOCK_N, BLOCK_K / 2], lo the low nibbles (inputs (b // 32) * 64 + b % 32 of
    byte b) and hi the high ones (32 inputs further on)."""
    groups: tl.constexpr = BLOCK_K // 64
    g = k // 64 + tl.arange(0, groups)
    sc_lo, m_lo, sc_hi, m_hi, d, dmin = group_scales(s_ptr, rows, g, K, (g < K // 64)[None, :])
    lo = tl.reshape((w & 15).to(tl.float32), (BLOCK_N, groups, 32))
    hi = tl.reshape((w >> 4).to(tl.float32), (BLOCK_N, groups, 32))
    lo = lo * (d * sc_lo)[:, :, None] - (dmin * m_lo)[:, :, None]
    hi = hi * (d * sc_hi)[:, :, None] - (dmin * m_hi)[:, :, None]
    half: tl.constexpr = BLOCK_K // 2
    return tl.reshape(lo, (BLOCK_N, half)).to(dtype), tl.reshape(hi, (BLOCK_N, half)).to(dtype)
