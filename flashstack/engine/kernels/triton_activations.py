"""The SwiGLU activation as every kernel computes it, so that a product taking silu(gate) * up in
its prologue (the batch-1 GEMV) or its epilogue (the skinny GEMM) rounds exactly as the
SiLU-and-mul kernel would."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up: `gate` in float32, its SiLU rounded to up's dtype, times up in that dtype
    (the unfused MLP's rounding: torch's silu(gate) * up)."""
    return (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
