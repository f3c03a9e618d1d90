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

from flashstack.engine.kernels.triton_skinny import store_fp8_row
from flashstack.engine.quantization import FP8, Fp8Activations


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    FP8_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype, as the unfused `x + residual` would be.
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w * normed).to(out_ptr.dtype.element_ty)
    if FP8_OUT:  # the next product's fp8 activations, quantized from the rounded output
        store_fp8_row(q_ptr, s_ptr, row, y.to(tl.float32), cols, mask, n_cols)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rmsnorm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    fp8_out: bool = False,
) -> tuple[torch.Tensor | Fp8Activations, torch.Tensor | None]:
    """RMSNorm(x + residual) and, when a residual is given, the new residual x + residual.
    `fp8_out`: the norm as the fp8 activations of the product after it (x [M, K] only), quantized
    as quantization.quantize_activations would quantize the 16-bit output."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    # with fp8_out the 16-bit output is not written: only its dtype is read
    out = torch.empty(0 if fp8_out else (m, k), dtype=x.dtype, device=x.device)
    q, scales = _fp8_rows(m, k, x.device) if fp8_out else (out, out)
    res_out = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, x.shape[-1]) if residual is not None else x2
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        res_out,
        q,
        scales,
        x2.stride(0),
        r2.stride(0),
        k,
        res_out.stride(0),
        x2.shape[1],
        eps,
        HAS_RES=residual is not None,
        FP8_OUT=fp8_out,
        BLOCK=triton.next_power_of_2(x2.shape[1]),
    )
    new_residual = res_out.view_as(x) if residual is not None else None
    if fp8_out:
        assert x.dim() == 2
        return Fp8Activations(q, scales, x.dtype), new_residual
    return out.view_as(x), new_residual


def _fp8_rows(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # where a kernel writes m rows of fp8 activations and their scales
    q = torch.empty(m, k, dtype=FP8, device=device)
    return q, torch.empty(m, dtype=torch.float32, device=device)


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
    x_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_o, n, FP8_OUT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    if FP8_OUT:  # one program holds the whole row (BLOCK >= n): its scale is the row's
        store_fp8_row(q_ptr, s_ptr, row, (act * up).to(tl.float32), cols, mask, n)
    else:
        tl.store(out_ptr + row * stride_o + cols, act * up, mask=mask)


def silu_and_mul_triton(x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Activations:
    """silu(x[..., :n]) * x[..., n:] for x [tokens, 2n] (a fused gate_up projection's output).
    `fp8_out`: as the fp8 activations of the product after it, quantized as
    quantization.quantize_activations would quantize the 16-bit result."""
    rows, two_n = x.shape
    n = two_n // 2
    if fp8_out:
        q, scales = _fp8_rows(rows, n, x.device)
        block = triton.next_power_of_2(n)
        _silu_mul_kernel[(rows, 1)](
            x,
            scales,
            q,
            scales,
            x.stride(0),
            0,
            n,
            FP8_OUT=True,
            BLOCK=block,
            num_warps=min(16, max(4, block // 1024)),
        )
        return Fp8Activations(q, scales, x.dtype)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        x, out, out, out, x.stride(0), out.stride(0), n, FP8_OUT=False, BLOCK=block
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The oracle: silu(gate) * up, in the input dtype as the unfused MLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
