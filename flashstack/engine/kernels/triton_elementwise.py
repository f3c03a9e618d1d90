"""Fused Triton kernels for the per-token work between matmuls: RMSNorm (+ residual add), rotary
embedding, SiLU-and-mul.

In a decode step at batch 1 each of these touches a few kilobytes; what they cost is their launch
count. Plain torch spends ~5 kernels on an RMSNorm and ~8 on a rotary embedding; each of these is
one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel
from flashstack.engine.kernels.triton_activations import silu_mul
from flashstack.engine.kernels.triton_skinny import SplitK


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    stride_slice,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK: tl.constexpr,
    SLICES: tl.constexpr,
    SPLIT: tl.constexpr = False,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # a weight: safe before the wait
    wait_for_previous_kernel(USE_PDL)  # x and the residual are the previous kernel's output
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if SPLIT:  # x is a split product's float32 slices: their sum, rounded as the product's
        for s in tl.static_range(1, SLICES):
            x += tl.load(x_ptr + s * stride_slice + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype, as the unfused `x + residual` would be.
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(
    x: torch.Tensor | SplitK,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x + residual) and, when a residual is given, the new residual x + residual. `x` may
    be a split product's slices (`SplitK`), added here first. `pdl`: programmatic dependent
    launch where the device has it (KernelOptions.elementwise_pdl)."""
    if isinstance(x, SplitK):
        slices = x.slices
        x2 = slices[0]
        out = torch.empty(x.shape, dtype=x.dtype, device=slices.device)
    else:
        slices = None
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(x2)
    pdl = pdl_applies(out.device, pdl)
    res_out = torch.empty_like(out) if residual is not None else out
    r2 = residual.reshape(-1, out.shape[-1]) if residual is not None else x2
    _rmsnorm_kernel[(x2.shape[0],)](
        slices if slices is not None else x2,
        r2,
        weight,
        out,
        res_out,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        res_out.stride(0),
        slices.stride(0) if slices is not None else 0,
        x2.shape[1],
        eps,
        HAS_RES=residual is not None,
        USE_PDL=pdl,
        BLOCK=triton.next_power_of_2(x2.shape[1]),
        SLICES=slices.shape[0] if slices is not None else 1,
        SPLIT=slices is not None,
        launch_pdl=pdl,
    )
    shape = x.shape
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oracle: Hugging Face's RMSNorm, after an optional residual add."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed, (x if residual is not None else None)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + d).to(tl.float32)
    for which in tl.static_range(2):
        if which == 0:
            base, stride_t, stride_h, heads = q_ptr, stride_qt, stride_qh, num_q_heads
        else:
            base, stride_t, stride_h, heads = k_ptr, stride_kt, stride_kh, num_k_heads
        mask = (h < heads)[:, None]
        p1 = base + t * stride_t + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(base.dtype.element_ty), mask=mask)
        tl.store(
            p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(base.dtype.element_ty), mask=mask
        )


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [n, Hq, D] and k [n, Hkv, D] in place; cos/sin [n, 1,
    D]."""
    n, hq, dim = q.shape
    hk = k.shape[1]
    cos2, sin2 = cos.reshape(n, dim), sin.reshape(n, dim)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos2.stride(-1) == 1
    _rope_kernel[(n,)](
        q,
        k,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos2.stride(0),
        hq,
        hk,
        HALF=dim // 2,
        BLOCK_H=triton.next_power_of_2(max(hq, hk)),
    )
    return q, k


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n,
    USE_PDL: tl.constexpr,
    OUT_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    wait_for_previous_kernel(USE_PDL)  # x is the previous kernel's output
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    act = silu_mul(gate, up)
    if OUT_SCALE != 1.0:  # rounded in x's dtype first, as the unscaled output is
        act = act.to(tl.float32) * OUT_SCALE
    tl.store(out_ptr + row * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(
    x: torch.Tensor,
    pdl: bool = False,
    out_dtype: torch.dtype | None = None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:] for x [tokens, 2n] (a fused gate_up projection's output).
    `pdl`: as rmsnorm_triton's. `out_dtype` / `out_scale`: the result, rounded in x's dtype, then
    times `out_scale` in that dtype (an fp8 GEMV's float16 input: triton_gemv.py)."""
    pdl = pdl_applies(x.device, pdl)
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        x,
        out,
        x.stride(0),
        out.stride(0),
        n,
        USE_PDL=pdl,
        OUT_SCALE=out_scale,
        BLOCK=block,
        launch_pdl=pdl,
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The oracle: silu(gate) * up, in the input dtype as the unfused MLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
