"""Batch-1 GEMV: y = W x (+ b) for one activation row against an nn.Linear weight [N, K].

At batch 1 a projection is a pure weight stream. cuBLAS picks split-K kernels for some of the
Llama-3-8B shapes, which adds a reduce kernel after o and down, and reads the q/k/v and o weights
at ~3.2 TB/s inside a decode graph. This kernel gives each program BLOCK_N whole rows and streams
them in BLOCK_K chunks, one fp32 dot per row at the end: no split-K, no second kernel.

Measured alone on the H200 (`bench/engine_gemv.py`, one CUDA graph of 20 calls; q/k/v and o fit
in the 50 MB L2 there, so those two read partly from cache, for cuBLAS too): q/k/v 13.8 → 11.6 µs,
o 9.6 → 6.1 µs, gate/up 54.6 → 54.4 µs, down 30.2 → 28.5 µs, lm_head 238 → 231 µs against
cuBLAS. Not yet measured inside the engine's decode step: the engine uses it only with
FLASHSTACK_TRITON_GEMV=1 (models/fused.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, b_ptr, y_ptr, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        cmask = cols < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=cmask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, K chunk, warps): the fastest of 16 configurations per shape on the H200
    (bench/engine_gemv.py): long rows (down, K = 14336) want 16 rows and 8 warps; very many rows
    (gate/up, lm_head) 2 rows per program; the rest 8 rows, 512-wide chunks."""
    if k > 8192:
        return 16, 1024, 8
    if n >= 16384:
        return 2, 1024, 4
    return 8, 512, 4


def gemv_triton(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] in x's dtype (what F.linear returns).
    `config` overrides `gemv_config` (rows per program, K chunk, warps)."""
    n, k = weight.shape
    assert x.shape == (1, k) and weight.stride(1) == 1 and x.stride(-1) == 1
    block_n, block_k, warps = config or gemv_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        weight, x, bias if bias is not None else y, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return y
