"""One kernel for everything between the q/k/v projection and attention: optional per-head q/k
RMSNorm (Qwen3), rotary embedding, and the store of the new K/V into the paged cache.

Unfused, that is four launches per layer (q-norm, k-norm, rotary, KV store), each touching a few
kilobytes per token; in a CUDA-graph decode step their cost is their count. Attention reads K and
V back from the cache (decode and prefill alike), so the rotated k is written only there; q is
rotated in place. The arithmetic, and every rounding to the activation dtype, follows the unfused
kernels exactly (`rmsnorm_triton`, `rope_triton`, `store_kvcache_triton`), which are its oracle.
An fp8 cache gets k and v quantized by the layer's scales, as store_kvcache_triton does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.engine.kernels.attention import check_kv_scale
from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel
from flashstack.engine.kernels.triton_attention import fp8_e4m3


@triton.jit
def _head_rmsnorm(x1, x2, w_ptr, d, eps, HALF: tl.constexpr):
    # RMSNorm over one head's 2*HALF values, held as two halves; rounded as rmsnorm_triton rounds.
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    var = (tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF)
    rs = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + d)[None, :]
    w2 = tl.load(w_ptr + HALF + d)[None, :]
    return (w1 * (a * rs).to(dtype)).to(dtype), (w2 * (b * rs).to(dtype)).to(dtype)


@triton.jit
def _rotated_heads(ptr, mask, cos, sin, w_ptr, d, eps, HALF: tl.constexpr, QK_NORM: tl.constexpr):
    # Load heads as two halves, optionally RMS-normalise each head, rotate: fp32 halves back.
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    if QK_NORM:
        x1, x2 = _head_rmsnorm(x1, x2, w_ptr, d, eps, HALF)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return a * cos[None, :] - b * sin[None, :], b * cos[None, :] + a * sin[None, :]


@triton.jit
def _qkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    cache_ptr,
    slot_ptr,
    kvs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_cb,
    stride_ckv,
    stride_cs,
    num_q_heads,
    num_k_heads,
    block_size,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    # q/k/v are the previous kernel's output, and the cache is read by the kernels before it
    wait_for_previous_kernel(USE_PDL)
    cos = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + d).to(tl.float32)

    qmask = (h < num_q_heads)[:, None]
    pq = q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    r1, r2 = _rotated_heads(pq, qmask, cos, sin, qw_ptr, d, eps, HALF, QK_NORM)
    tl.store(pq, r1.to(q_ptr.dtype.element_ty), mask=qmask)
    tl.store(pq + HALF, r2.to(q_ptr.dtype.element_ty), mask=qmask)

    slot = tl.load(slot_ptr + t)
    valid = slot >= 0  # padded slots (CUDA-graph padding) are -1 and write nothing
    slot = tl.maximum(slot, 0)
    row = (slot // block_size).to(tl.int64) * stride_cb + (slot % block_size) * stride_cs
    kmask = (h < num_k_heads)[:, None] & valid
    pk = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    r1, r2 = _rotated_heads(pk, kmask, cos, sin, kw_ptr, d, eps, HALF, QK_NORM)
    # Rounded to k's dtype first, as the unfused rotary writes k before the store converts it.
    dst = cache_ptr + row + h[:, None] * (2 * HALF) + d[None, :]
    k1, k2 = r1.to(k_ptr.dtype.element_ty), r2.to(k_ptr.dtype.element_ty)
    pv = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
    v1 = tl.load(pv, mask=kmask, other=0.0)
    v2 = tl.load(pv + HALF, mask=kmask, other=0.0)
    if FP8:
        ks, vs = tl.load(kvs_ptr), tl.load(kvs_ptr + 1)
        k1 = fp8_e4m3(tl.math.div_rn(k1.to(tl.float32), ks))
        k2 = fp8_e4m3(tl.math.div_rn(k2.to(tl.float32), ks))
        v1 = fp8_e4m3(tl.math.div_rn(v1.to(tl.float32), vs))
        v2 = fp8_e4m3(tl.math.div_rn(v2.to(tl.float32), vs))
    tl.store(dst, k1.to(cache_ptr.dtype.element_ty), mask=kmask)
    tl.store(dst + HALF, k2.to(cache_ptr.dtype.element_ty), mask=kmask)
    tl.store(dst + stride_ckv, v1.to(cache_ptr.dtype.element_ty), mask=kmask)
    tl.store(dst + stride_ckv + HALF, v2.to(cache_ptr.dtype.element_ty), mask=kmask)


def rope_and_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Rotate q [n, Hq, D] in place; rotate k [n, Hkv, D] and store it and v into `kv_cache` at
    `slot_mapping` (-1 = skip). With `q_norm`/`k_norm` weights, each head of q and k is first
    RMS-normalised (Qwen3). cos/sin are [n, 1, D]. `kv_scale`: an fp8 cache's [k_scale, v_scale].
    `pdl`: programmatic dependent launch where the device has it. Returns q."""
    pdl = pdl_applies(q.device, pdl)
    fp8 = check_kv_scale(kv_cache, kv_scale)
    n, hq, dim = q.shape
    hk = k.shape[1]
    assert dim & (dim - 1) == 0, "the rotary halves must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert kv_cache.stride(3) == dim and kv_cache.stride(4) == 1, (
        "a token's heads must be contiguous"
    )
    assert (q_norm is None) == (k_norm is None)
    cos2, sin2 = cos.reshape(n, dim), sin.reshape(n, dim)
    qk_norm = q_norm is not None
    _qkv_kernel[(n,)](
        q,
        k,
        v,
        cos2,
        sin2,
        q_norm if qk_norm else q,
        k_norm if qk_norm else k,
        kv_cache,
        slot_mapping,
        kv_scale if fp8 else slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos2.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        hq,
        hk,
        kv_cache.shape[2],
        eps,
        HALF=dim // 2,
        BLOCK_H=triton.next_power_of_2(max(hq, hk)),
        QK_NORM=qk_norm,
        FP8=fp8,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return q
