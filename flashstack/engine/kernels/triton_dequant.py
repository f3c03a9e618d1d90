"""Q8_0 weights dequantized into the compute dtype in one pass, for the products with more rows than
the skinny GEMM takes (prefill): int8 and float16 scales read once, the 16-bit weight written once,
then cuBLAS. In plain torch the same takes four passes over float32 temporaries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # weights per program: 128 Q8_0 blocks


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, w_ptr, total, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    q = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + idx // 32, mask=mask, other=0.0).to(tl.float32)
    tl.store(w_ptr + idx, (q * s).to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_q8_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight int8 `q` [N, K] and its float16 block scales [N, K / 32] stand for, in `dtype`
    (each value q * d in float32, rounded once: engine/quantization.dequantize_blocks)."""
    n, k = q.shape
    assert q.is_contiguous() and scale.is_contiguous() and scale.shape == (n, k // 32)
    w = torch.empty(n, k, dtype=dtype, device=q.device)
    _dequantize_kernel[(triton.cdiv(n * k, _BLOCK),)](q, scale, w, n * k, BLOCK=_BLOCK)
    return w
