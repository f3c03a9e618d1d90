"""Triton kernels for the paged KV cache: store, split-KV decode attention, paged prefill attention.

Cache layout per layer (see attention.py): [num_blocks, 2 (K|V), block_size, kv_heads, head_dim].
A token's K for one head is head_dim contiguous elements (256 B at head_dim 128 in bf16: two whole
128-byte segments), and consecutive tokens of a block are kv_heads * head_dim apart, so a tile of
BLOCK_N tokens is BLOCK_N row loads of whole segments.

Decode follows flash-decoding: the KV range of each sequence is split across programs so a single
long sequence still occupies every SM; each program handles one KV head and all the query heads that
share it (GQA), so K and V are read from memory once per KV head, not once per query head. A second
small kernel merges the splits with their log-sum-exp weights. In a decode step the split kernel
also takes over the q/k/v kernel's work (NewTokens): one launch a layer fewer.

On Hopper and later, where a block holds whole tiles, the decode kernel fetches each tile of K and V
with the tensor-memory accelerator (TMA) into shared memory, and reads the split's block-table
entries before its loop, so the pipeliner keeps tiles in flight without registers or address
arithmetic per element. Its launch keeps one wave of programs (tma_launch). Measured on the H200:
docs/benchmarks.md, "Long context" and "Decode attention launch". Merging inside the split kernel
(the last split to finish merges) measured slower everywhere, by up to 45 % at 32K.

An fp8 cache (attention.py) is quantized where K and V are stored and dequantized in registers:
tiles are converted to fp16 (exactly: fp16 holds every e4m3 value) for the dot products, k_scale is
folded into the queries' softmax scale and v_scale into the output: no multiply per element beyond
the conversion. fp16, not the queries' bf16: e4m3 -> fp16 is one instruction per two values on
Hopper, and the decode kernel at 32K measured 58 us with bf16 tiles against bf16's 37 us.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashstack.cuda.torch_interop import device_for
from flashstack.engine.config import KernelOptions
from flashstack.engine.kernels.attention import (
    FP8,
    AttentionMetadata,
    check_kv_scale,
    paged_prefill_sdpa,
    sdpa_prefill_applies,
)
from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel

# Programs per SM the split heuristic aims for: enough to hide memory latency, few enough that the
# merge stays negligible.
_PROGRAMS_PER_SM = 2
# Programs per SM in one wave of a decode launch, at most (tma_launch: one or two).
_WAVE_PROGRAMS = 2


@triton.jit
def fp8_e4m3(x):
    """fp32 x in float8_e4m3fn: rounded to nearest even and saturated at +-448, as torch's
    quantize_fp8 (attention.py) does. The rounding is done here, in integer arithmetic, so the cast
    is exact: the Triton interpreter's own fp32 -> fp8 rounding drops the carry into the exponent
    (7.98 becomes 4.0)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    # keep 3 of fp32's 23 mantissa bits, ties to even; a carry rounds up into the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # below e4m3's smallest normal, 2^-6: multiples of 2^-9 (adding 1.5 * 2^23 rounds to integers),
    # x's sign bit put back (a negative that rounds to zero is -0, as torch's cast gives)
    a = tl.abs(x)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) / 512.0
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(a < 0.015625, sub, normal).to(tl.float8e4nv)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    kvs_ptr,
    stride_kt,
    stride_vt,
    stride_cb,
    stride_ckv,
    stride_cs,
    block_size,
    HD: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    valid = slot >= 0  # padded slots (CUDA-graph padding) are -1 and write nothing
    slot = tl.maximum(slot, 0)
    blk = (slot // block_size).to(tl.int64)
    off = slot % block_size
    cols = tl.arange(0, BLOCK_HD)
    mask = (cols < HD) & valid
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    dst = cache_ptr + blk * stride_cb + off * stride_cs + cols
    if FP8:
        k = fp8_e4m3(tl.math.div_rn(k.to(tl.float32), tl.load(kvs_ptr)))
        v = fp8_e4m3(tl.math.div_rn(v.to(tl.float32), tl.load(kvs_ptr + 1)))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into `kv_cache` at `slot_mapping` (-1 = skip);
    an fp8 cache gets them quantized by its layer's `kv_scale`."""
    fp8 = check_kv_scale(kv_cache, kv_scale)
    num_tokens, heads, dim = k.shape
    assert k.stride(-1) == 1 and k.stride(-2) == dim and v.stride(-1) == 1 and v.stride(-2) == dim
    hd = heads * dim
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_scale if fp8 else slot_mapping,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[2],
        HD=hd,
        BLOCK_HD=triton.next_power_of_2(hd),
        FP8=fp8,
    )


@dataclass(frozen=True)
class NewTokens:
    """A decode step's new tokens as the fused q/k/v projection leaves them: k and v [batch,
    kv_heads, head_dim] (views are fine), the rotary cos/sin of their positions ([batch, 1 or
    nothing, head_dim]), their cache slots (-1 = graph padding, store nothing) and, for Qwen3, the
    per-head q/k RMSNorm weights. Given these, the decode kernel does the q/k/v kernel's work itself
    (kernels/triton_qkv.py): one launch a layer fewer."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


@triton.jit
def rotated_heads(ptr, mask, d, cos, sin, w_ptr, eps, D: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads [rows, D] at ptr (+ d): optional per-head RMSNorm, then the rotary embedding, in
    fp32. Full-width, each element beside its rotation partner, so no dot ever runs over a half
    head. Rounds where rmsnorm_triton and rope_triton round."""
    HALF: tl.constexpr = D // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    x = tl.load(ptr + d[None, :], mask=mask, other=0.0)
    xp = tl.load(ptr + partner[None, :], mask=mask, other=0.0)
    if QK_NORM:
        dtype = x.dtype
        xf = x.to(tl.float32)
        rs = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
        x = (tl.load(w_ptr + d)[None, :] * (xf * rs).to(dtype)).to(dtype)
        xp = (tl.load(w_ptr + partner)[None, :] * (xp.to(tl.float32) * rs).to(dtype)).to(dtype)
    sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
    return x.to(tl.float32) * cos[None, :] + sign * xp.to(tl.float32) * sin[None, :]


@triton.jit
def rotated_key(ptr, d, cos, sin, w_ptr, eps, D: tl.constexpr, QK_NORM: tl.constexpr):
    """A new token's key head [1, D] at ptr, rotated (rotated_heads) and rounded to ptr's dtype, as
    the q/k/v kernel stores it."""
    one = tl.arange(0, 1)
    k = rotated_heads(ptr + one[:, None] * 0, one[:, None] < 1, d, cos, sin, w_ptr, eps, D, QK_NORM)
    return k.to(ptr.dtype.element_ty)


@triton.jit
def attend_new_token(q, k_new, v_new, m, row_sum, acc, q_scale, pv_dtype: tl.constexpr):
    """The step's own token, its k/v [1, D] in the cache's dtype, from registers: a rank-one
    online-softmax update of the running maximum, sum and output (scores times `q_scale`), p
    rounded to `pv_dtype` as the tiles' P @ V rounds it."""
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * q_scale
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)
    row_sum = row_sum * alpha + p
    acc = acc * alpha[:, None] + p.to(pv_dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
    return m_new, row_sum, acc


@triton.jit
def fp8_pairs(t, dtype: tl.constexpr, ASM: tl.constexpr):
    """An fp8 tile read as 16-bit words [N, D / 2], each two neighbouring values of a row (the
    even column in the low byte): the even and the odd columns, each [N, D / 2] in `dtype`.
    ASM (compiled, float16): two words a register, one byte permute for them and one conversion
    for each two values of a column, where the compiler's own took a mask, a permute and a
    multiply-add before each conversion."""
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            # bytes e0 o0 e1 o1 -> e0 e1 | o0 o1, each half two values to convert
            "{ .reg .b32 w; .reg .b16 e, o; prmt.b32 w, $2, 0, 0x3120; mov.b32 {e, o}, w; "
            "cvt.rn.f16x2.e4m3x2 $0, e; cvt.rn.f16x2.e4m3x2 $1, o; }",
            "=r,=r,r",
            [t],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        even = (t & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
        odd = ((t >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
    return even, odd


@triton.jit
def splits_of(ctx, min_split, num_splits, BLOCK_N: tl.constexpr):
    """(tokens per split, splits holding part of the context) for one sequence: the split kernel
    and the merge must agree on both."""
    ctx = tl.maximum(ctx, 1)
    tokens_per_split = tl.maximum(min_split, tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N)
    return tokens_per_split, tl.cdiv(ctx, tokens_per_split)


@triton.jit
def merged_splits(
    part_ptr,
    lse_ptr,
    cols,
    cmask,
    active,
    S: tl.constexpr,
    D: tl.constexpr,
    PART_S: tl.constexpr,
    PART_H: tl.constexpr,
    LSE_S: tl.constexpr,
    LSE_H: tl.constexpr,
    act,
):
    """One sequence's attention output at these columns (head * D + d), rounded to `act`, in
    float32: the splits' partials (split s of head h at part_ptr + s * PART_S + h * PART_H + d)
    weighted by their log-sum-exps (at lse_ptr + s * LSE_S + h * LSE_H), as the merge kernel weighs
    them, in one pass with a running maximum over every split of the launch, those past `active`
    masked. Unrolled, no load waits for another: a loop to `active` made each split's loads wait
    for the one before (one L2 round trip a split, twice)."""
    h = cols // D
    d = cols % D
    # below any log-sum-exp, yet finite: no -inf - -inf
    top = tl.full(cols.shape, -1e30, tl.float32)
    num = tl.zeros(cols.shape, tl.float32)
    den = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(S):
        smask = cmask & (s < active)
        lse = tl.load(lse_ptr + s * LSE_S + h * LSE_H, mask=smask, other=float("-inf"))
        part = tl.load(part_ptr + s * PART_S + h * PART_H + d, mask=smask, other=0.0)
        new_top = tl.maximum(top, lse)
        keep = tl.exp(top - new_top)
        w = tl.exp(lse - new_top)  # 0 for a split with nothing (lse -inf)
        num = num * keep + part * w
        den = den * keep + w
        top = new_top
    return (num / tl.where(den > 0, den, 1.0)).to(act).to(tl.float32)


@triton.jit
def softmax_step(qk, nmask, m, row_sum):
    """One tile's scores [G, N] into the running maximum and sum (online softmax): the tile's
    weights p (masked columns 0), the factor alpha the running output is rescaled by, and the
    new maximum and sum."""
    qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m - m_new)
    return p, alpha, m_new, row_sum * alpha + tl.sum(p, 1)


@triton.jit
def _fp8_pair_tiles(
    q,
    cache_desc,
    span,
    blks,
    first_blk,
    first,
    lo,
    hi,
    hkv,
    block_size,
    m,
    row_sum,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_DOT: tl.constexpr,
    MASK_V: tl.constexpr,
    ASM: tl.constexpr,
    PREC: tl.constexpr,
):
    # An fp8 cache's TMA tiles as 16-bit words (fp8_pairs): each word's two values go to the dot
    # products' operands by register, where a byte-wide tile went through shared memory a byte at
    # a time. q's even and odd columns meet K's (the sum over the head is the same sum), and
    # P @ V gives the output's even and odd columns apart, interleaved once at the end.
    HALF: tl.constexpr = D_PAD // 2
    q_even, q_odd = tl.split(tl.reshape(q, (G_PAD, HALF, 2)))
    acc_even = tl.zeros([G_PAD, HALF], tl.float32)
    acc_odd = tl.zeros([G_PAD, HALF], tl.float32)
    for start in range(first, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = (n >= lo) & (n < hi)
        blk = tl.sum(tl.where(span == start // block_size - first_blk, blks, 0))
        krow = blk * 2 * block_size + start % block_size
        k_even, k_odd = fp8_pairs(
            cache_desc.load([krow, hkv, 0]).reshape(BLOCK_N, HALF), KV_DOT, ASM
        )
        qk = tl.dot(q_even, tl.trans(k_even), input_precision=PREC)
        qk = tl.dot(q_odd, tl.trans(k_odd), qk, input_precision=PREC)
        p, alpha, m, row_sum = softmax_step(qk, nmask, m, row_sum)
        v_even, v_odd = fp8_pairs(
            cache_desc.load([krow + block_size, hkv, 0]).reshape(BLOCK_N, HALF), KV_DOT, ASM
        )
        if MASK_V:
            v_even = tl.where(nmask[:, None], v_even, 0.0)
            v_odd = tl.where(nmask[:, None], v_odd, 0.0)
        p = p.to(KV_DOT)
        acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=PREC)
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=PREC)
    return m, row_sum, tl.reshape(tl.join(acc_even, acc_odd), (G_PAD, D_PAD))


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    slot_ptr,
    cache_ptr,
    cache_desc,
    kvs_ptr,
    tables_ptr,
    ctx_ptr,
    order_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_rb,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    scale,
    eps,
    block_size,
    window,
    min_split,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    NEW: tl.constexpr,
    QK_NORM: tl.constexpr,
    SPLIT: tl.constexpr,
    TMA: tl.constexpr,
    TABLE_SPAN: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP8: tl.constexpr,
    KV_DOT: tl.constexpr,
    ORDERED: tl.constexpr,
    QK_FP8: tl.constexpr = False,
    ORDER_READY: tl.constexpr = False,
    MASK_V: tl.constexpr = True,
    IDLE_EXIT: tl.constexpr = False,
    FP8_PAIRS: tl.constexpr = False,
    FP8_ASM: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
    HEADS_FIRST: tl.constexpr = False,
):
    # HEADS_FIRST: the grid is (kv_heads, batch, splits), so the programs that start together
    # are one sequence's KV heads, whose tiles interleave in the cache's rows (see DecodePlan)
    if HEADS_FIRST:
        seq_pid = tl.program_id(1)
        hkv = tl.program_id(0)
    else:
        seq_pid = tl.program_id(0)
        hkv = tl.program_id(1)
    split = tl.program_id(2)
    if FP8:  # the layer's scales: fixed for the engine's life, safe before the wait
        k_scale = tl.load(kvs_ptr)
        v_scale = tl.load(kvs_ptr + 1)
    # Where the sequence is known before the wait (its context length and block table are step
    # inputs), they load before it, and so does its split's table entries below.
    EARLY: tl.constexpr = ORDER_READY or not ORDERED
    if ORDERED:
        # Programs start in grid order: the longest contexts first, so the shortest fill the
        # launch's last wave instead of a long one running on alone (longest processing time
        # first). The order is computed in the step: just before the first layer's launch (read
        # after the wait), by the time of the others' long done (ORDER_READY: before it).
        if not ORDER_READY:
            wait_for_previous_kernel(USE_PDL)
        b = tl.load(order_ptr + seq_pid)
        ctx = tl.load(ctx_ptr + b)
    else:
        b = seq_pid
        # a step input, written before the forward pass: safe before the wait
        ctx = tl.load(ctx_ptr + b)
    # This sequence's own share per split (whole tiles, at least `min_split` tokens), not the
    # grid's: a graph's grid is sized for max_model_len, and a short context should still be read by
    # all its splits, not by the first few. Splits past the context have nothing to read.
    tokens_per_split, active = splits_of(ctx, min_split, num_splits, BLOCK_N)
    if IDLE_EXIT:
        # A split past the context leaves at once, before the wait: it would otherwise hold its
        # SM slot through the wait, q's rotation and an empty loop (a graph's grid is sized for
        # the longest context its bound allows, so a short one leaves many splits idle).
        if split >= active:
            return
    # A split past the context (lo >= ctx) runs an empty loop and writes nothing.
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, ctx)
    if window > 0:
        lo = tl.maximum(lo, ctx - window)
    if NEW:  # the new token is not read from the cache: the split that owns it attends it last
        last = tl.maximum(ctx, 1) - 1
        owner = split == last // tokens_per_split
        hi = tl.minimum(hi, last)
    if TMA:
        # Whole tiles inside one block, each fetched by the tensor-memory accelerator into shared
        # memory. The split's block-table entries are read once, before the loop: with no load
        # feeding a tile's coordinates inside the loop, Triton's pipeliner keeps NUM_STAGES - 1
        # tiles in flight (one when the entry is loaded per tile). A step input: before the wait
        # (EARLY), so the first tile's fetch waits for one memory latency after it, not two.
        first = (lo // BLOCK_N) * BLOCK_N
        first_blk = first // block_size
        span = tl.arange(0, TABLE_SPAN)
        blks = tl.load(
            tables_ptr + b * stride_tb + first_blk + span,
            mask=(first_blk + span) * block_size < hi,
            other=0,
        )
        if PRELOAD:
            # The split's first K and V tiles: cache rows of earlier steps (the new token comes
            # from registers, NEW), so nothing the kernel before writes. Fetched before the
            # wait, they arrive while that kernel drains.
            krow_first = tl.sum(tl.where(span == 0, blks, 0)) * 2 * block_size + first % block_size
            k_first = cache_desc.load([krow_first, hkv, 0]).reshape(BLOCK_N, D_PAD)
            v_first = cache_desc.load([krow_first + block_size, hkv, 0]).reshape(BLOCK_N, D_PAD)
    else:
        first = lo
    if EARLY:
        wait_for_previous_kernel(USE_PDL)  # q (and the new k/v) are the previous kernel's output
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < G
    dmask = d < D
    heads = hkv * G + g
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if NEW:
        # This step's token: rotate q and k here; its k and v enter the scores from registers
        # (after the loop), and the split that owns its position stores them in the cache.
        cos = tl.load(cos_ptr + b * stride_rb + d % (D // 2)).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_rb + d % (D // 2)).to(tl.float32)
        q = rotated_heads(q_rows, gmask[:, None], d, cos, sin, qw_ptr, eps, D, QK_NORM).to(
            q_ptr.dtype.element_ty
        )
        k_ptr += b * stride_kb + hkv * stride_kh
        k_new = rotated_key(k_ptr, d, cos, sin, kw_ptr, eps, D, QK_NORM)
        v_new = tl.load(v_ptr + b * stride_vb + hkv * stride_vh + d[None, :])
        if FP8:
            k_new = fp8_e4m3(tl.math.div_rn(k_new.to(tl.float32), k_scale))
            v_new = fp8_e4m3(tl.math.div_rn(v_new.to(tl.float32), v_scale))
        else:
            k_new = k_new.to(cache_ptr.dtype.element_ty)
            v_new = v_new.to(cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b)
        if owner & (slot >= 0):
            row = (
                (slot // block_size).to(tl.int64) * stride_cb
                + (slot % block_size) * stride_cs
                + hkv * stride_ch
            )
            tl.store(cache_ptr + row + d[None, :], k_new)
            tl.store(cache_ptr + stride_ckv + row + d[None, :], v_new)
    else:
        q = tl.load(q_rows + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    # P @ V's operands: dequantized tiles of an fp8 cache, the cache's own dtype otherwise
    pv_dtype: tl.constexpr = KV_DOT if FP8 else cache_ptr.dtype.element_ty
    q_scale = 1.0
    if QK_FP8:
        # q @ K on the fp8 tensor cores, K's tiles as stored: q quantized to e4m3 with one scale
        # for the program's rows (k_scale and the softmax scale ride on it), every score then
        # multiplied back by it
        qs = q.to(tl.float32) * (scale * k_scale)
        q_scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(qs), 1), 0), 1e-30), 448.0)
        q = fp8_e4m3(tl.math.div_rn(qs, q_scale))
    elif FP8:  # the dot products run in KV_DOT on dequantized tiles; k_scale rides on q
        q = (q * (scale * k_scale)).to(KV_DOT)
    else:
        q = (q * scale).to(cache_ptr.dtype.element_ty)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if FP8_PAIRS:
        m, row_sum, acc = _fp8_pair_tiles(
            q,
            cache_desc,
            span,
            blks,
            first_blk,
            first,
            lo,
            hi,
            hkv,
            block_size,
            m,
            row_sum,
            G_PAD,
            D_PAD,
            BLOCK_N,
            KV_DOT,
            MASK_V,
            FP8_ASM,
            PREC,
        )
    else:
        loop_first = first
        if PRELOAD:  # the fetched first tile, then the loop over the rest
            loop_first = first + BLOCK_N
            if first < hi:
                n = first + tl.arange(0, BLOCK_N)
                nmask = (n >= lo) & (n < hi)
                qk = tl.dot(q, tl.trans(k_first), input_precision=PREC)
                p, alpha, m, row_sum = softmax_step(qk, nmask, m, row_sum)
                v = v_first
                if MASK_V:
                    v = tl.where(nmask[:, None], v, 0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        for start in range(loop_first, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            if TMA:
                nmask = (n >= lo) & (n < hi)
                # Rows of the cache viewed as [blocks * 2 * block_size, kv_heads, D]: K at the
                # block's first half, V at its second.
                blk = tl.sum(tl.where(span == start // block_size - first_blk, blks, 0))
                krow = blk * 2 * block_size + start % block_size
                k = cache_desc.load([krow, hkv, 0]).reshape(BLOCK_N, D_PAD)
            else:
                nmask = n < hi
                blk = tl.load(tables_ptr + b * stride_tb + n // block_size, mask=nmask, other=0)
                row = blk.to(tl.int64) * stride_cb + (n % block_size) * stride_cs + hkv * stride_ch
                kv_mask = nmask[:, None] & dmask[None, :]
                k = tl.load(cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if QK_FP8:
                qk = tl.dot(q, tl.trans(k)) * q_scale
            else:
                if FP8:
                    k = k.to(q.dtype)
                qk = tl.dot(q, tl.trans(k), input_precision=PREC)
            p, alpha, m, row_sum = softmax_step(qk, nmask, m, row_sum)
            if TMA:
                # A tile's rows past the context hold other tokens' values or never-written
                # memory: their scores are masked above, and V is zeroed so a stale NaN cannot
                # reach the sum. Without MASK_V the rows go to P @ V as fetched (a cache holding
                # only finite values there, as the engine's zeroed one does: their weights are
                # exactly 0): zeroing them took V through registers and back to shared memory
                # before its dot operands.
                v = cache_desc.load([krow + block_size, hkv, 0]).reshape(BLOCK_N, D_PAD)
                if FP8:
                    v = v.to(pv_dtype)
                if MASK_V:
                    v = tl.where(nmask[:, None], v, 0.0)
            else:
                v = tl.load(
                    cache_ptr + stride_ckv + row[:, None] + d[None, :], mask=kv_mask, other=0.0
                )
                if FP8:
                    v = v.to(pv_dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    if NEW:
        if owner:
            m, row_sum, acc = attend_new_token(q, k_new, v_new, m, row_sum, acc, q_scale, pv_dtype)
    has = row_sum > 0
    out = acc / tl.where(has, row_sum, 1.0)[:, None]
    if FP8:
        out = out * v_scale
    omask = gmask[:, None] & dmask[None, :]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if split < active:
        # SPLIT (a compile-time constant) keeps the partials' code out of one-split launches, where
        # it cost the kernel 12 % at batch 128 even though it never ran.
        if SPLIT:
            if active > 1:  # partial output and log-sum-exp for the merge kernel
                lse = tl.where(has, m + tl.log(tl.where(has, row_sum, 1.0)), float("-inf"))
                tl.store(
                    part_ptr
                    + b * stride_pb
                    + heads[:, None] * stride_ph
                    + split * stride_ps
                    + d[None, :],
                    out,
                    mask=omask,
                )
                tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)
            # the whole context in one split: the output itself, and the merge kernel skips it
            else:
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    ctx_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    min_split,
    num_splits,
    S_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    wait_for_previous_kernel(USE_PDL)  # the partials are the split kernel's output
    # The partials load together with the context length, not after it (one memory latency, not
    # two): every split of the grid is in bounds, and those past this sequence's context are
    # masked out once `active` is known (their slots hold stale values).
    ctx = tl.load(ctx_ptr + b)
    in_grid = s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=in_grid, other=float("-inf"))
    parts = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=in_grid[:, None] & (d[None, :] < D),
        other=0.0,
    )
    _, active = splits_of(ctx, min_split, num_splits, BLOCK_N)
    if active > 1:
        smask = s < active
        lse = tl.where(smask, lse, float("-inf"))
        top = tl.max(lse, 0)
        w = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
        parts = tl.where(smask[:, None], parts, 0.0)
        out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < D,
        )


def _precision(kv_cache: torch.Tensor, q: torch.Tensor) -> str:
    # fp32 caches are for exactness checks: keep their dot products in full precision, not tf32.
    # So are fp32 queries over an fp8 cache (_kv_dot).
    dot_dtype = q.dtype if kv_cache.dtype == FP8 else kv_cache.dtype
    return "ieee" if dot_dtype == torch.float32 else "tf32"


def _kv_dot(q: torch.Tensor) -> tl.dtype:
    # What an fp8 cache's tiles become for the dot products: fp16 (see the module docstring), or
    # fp32 for fp32 queries (exactness checks).
    return tl.float32 if q.dtype == torch.float32 else tl.float16


# Fewest tokens a split reads, unless the whole context is shorter (see _decode_kernel). Measured on
# the H200 over 128-1024 (docs/benchmarks.md): 128 is fastest at batch 1 and 8, within 5 %
# elsewhere.
DECODE_MIN_SPLIT = 128


def decode_num_splits(
    batch: int, kv_heads: int, max_context_len: int, block_n: int, sm_count: int
) -> int:
    """Splits per sequence so batch × kv_heads × splits fills the GPU, never smaller than one
    tile."""
    want = math.ceil(_PROGRAMS_PER_SM * sm_count / max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(max_context_len / block_n)))


# One sequence whose context is at most this many tokens (the grid's bound: a graph's own, or the
# step's longest context) reads it in 64-token tiles and 64-token splits, two stages.
SHORT_DECODE_CONTEXT = 1024


def decode_block_n(batch: int, kv_heads: int) -> int:
    """Tokens per tile. Measured on the H200 (bench/engine_attention.py): with few (sequence, KV
    head) pairs, 128-token tiles keep more bytes in flight per program (8B shape, context 576:
    batch 1 11.1 → 8.5 µs, batch 32 33.7 → 30.7 µs; batch 4 at 32K 155 → 135 µs); from batch 128
    on, 64-token tiles are as fast or faster (78.9 vs 83.1 µs)."""
    return 128 if batch * kv_heads <= 256 else 64


def short_decode(batch: int, max_context_len: int) -> bool:
    """True when a decode launch takes the short-context configuration: one sequence, a grid bound
    of at most SHORT_DECODE_CONTEXT. Measured on the H200 (8B heads, batch 1, ten layers a graph):
    64-token tiles, 64-token splits and two stages take 6.68 / 7.82 / 9.77 µs at contexts 576 /
    1,100 / 2,200 against the default's 7.70 / 7.77 / 8.60 µs: more programs, each with less to
    read, win only while the context is short."""
    return batch == 1 and max_context_len <= SHORT_DECODE_CONTEXT


def tma_applies(kv_cache: torch.Tensor, block_n: int) -> bool:
    """Whether decode tiles can go through the tensor-memory accelerator (TMA): Hopper or later, a
    contiguous 16-bit or fp8 cache whose blocks hold whole tiles and a power-of-two head size."""
    dim = kv_cache.shape[-1]
    return (
        kv_cache.is_cuda
        and kv_cache.dtype in (torch.bfloat16, torch.float16, FP8)
        and device_for(kv_cache.device).compute_capability >= (9, 0)
        and kv_cache.is_contiguous()
        and kv_cache.data_ptr() % 16 == 0
        and kv_cache.shape[2] % block_n == 0
        and dim & (dim - 1) == 0
    )


# Most block-table entries a TMA launch holds in registers per split (a split's blocks, plus one);
# a longer split (one sequence's whole long context, at large batches) reads through plain loads.
TMA_MAX_TABLE_SPAN = 64


# (sequence, KV head) pairs from which a 16-bit TMA launch reads 64-token tiles three stages deep
# (deep_tma_launch).
DEEP_TMA_PAIRS = 128
# Longest grid bound of a `wave` launch (tma_launch): beyond it, fewer and longer splits lose.
WAVE_TMA_MAX_CONTEXT = 8192


def deep_tma_launch(batch: int, kv_heads: int, short: bool, fp8: bool) -> bool:
    """Whether a TMA decode launch of 16-bit KV reads 64-token tiles three stages deep, two
    programs per SM, instead of decode_block_n's tiles two stages deep. Measured on the H200
    (bench/engine_attention.py --mixed and the 8B heads at context 576, one layer, ten launches a
    graph): batches of mixed context lengths, what serving sees, 231 -> 217 µs (208 sequences of
    100-2,000 tokens, Qwen3-0.6B heads) and 158 -> 144 µs (128 of them, 8B heads); uniform
    contexts at 16 / 32 sequences 13.0 -> 12.1 / 24.4 -> 22.3 µs, but at 64 / 128 sequences of 576
    to 2,000 tokens 3-7 % slower. Below 128 pairs (batch 8 of the 8B) it measured no faster."""
    return not short and not fp8 and batch * kv_heads >= DEEP_TMA_PAIRS


def unmasked_v_applies(dtype: torch.dtype, deep: bool, fp8_pairs: bool = False) -> bool:
    """Whether a TMA launch takes V's tiles as fetched (KernelOptions.decode_unmasked_v): caches
    of float32's range (bfloat16; float32 in the interpreter), whose stores cannot overflow to an
    inf that a freed block would carry into another sequence's tiles (a float16 cache can), not
    the deep launch's tiles. Measured on the H100 (docs/benchmarks.md, "Decode attention launch"),
    one layer off -> on: batch 1 at context 576 7.25 -> 6.43 µs, 32K 177.3 -> 175.1 µs (batch 4);
    but the deep launch at batch 32 28.6 -> 30.7 µs (its tiles then fit three programs an SM),
    and fp8 tiles, read a byte at a time unzeroed, at batch 32 and 4K 95.7 -> 111.1 µs. fp8
    tiles read as 16-bit words (`fp8_pairs`) take them: e4m3fn has no inf and stores saturate, and
    unzeroed, the pairs' tile loop compiles to 553 instructions against 884 zeroed."""
    return (dtype in (torch.bfloat16, torch.float32) or (dtype == FP8 and fp8_pairs)) and not deep


def tma_launch(
    batch: int,
    kv_heads: int,
    sm_count: int,
    short: bool,
    fp8: bool = False,
    deep: bool = False,
    wave: bool = False,
    fp8_pairs: bool = False,
) -> tuple[int, int]:
    """(pipeline stages, programs per SM) of a TMA decode launch. Measured on the H200 (8B heads,
    docs/benchmarks.md): with at most one (sequence, KV head) pair per 8 SMs, 3 stages (two
    128-token tiles of K and V in flight, 172 KB of shared memory: one program per SM) read a 32K
    context fastest (batch 1 37.6 µs against 39.6 with 2 stages); otherwise, for 128-token tiles,
    2 stages (106 KB, two programs per SM) win everywhere, short contexts included. An fp8
    cache's tiles are half the bytes: 3 stages and two programs per SM took batch 1 at 32K
    42.1 -> 31.1 µs, batch 4 at 32K 111.9 -> 101.4 µs and batch 32 at 4K 103.5 -> 94.7 µs
    (docs/benchmarks.md, "fp8 KV cache").
    `deep`: deep_tma_launch's 64-token tiles, three stages (96 KB: two programs per SM).
    `wave` (KernelOptions.decode_wave_tma, for grids of up to WAVE_TMA_MAX_CONTEXT tokens): up to
    one pair per SM also reads 3 stages deep, one program per SM. Measured on the H200 under PDL,
    as a step launches it (8B heads, ten launches a graph; the sweeps above ran without PDL):
    batch 8 at context 544 12.3 -> 8.8 µs (two splits of 128-token tiles instead of four), at
    4,096 40.1 -> 36.0 µs, at 8,192 70.0 -> 65.3 µs; batch 4 at 544 / 4,096 / 8,192 8.1 -> 7.3 /
    23.0 -> 21.3 / 38.3 -> 36.2 µs; but at 16K and 32K contexts 11-13 % slower.
    `fp8_pairs` (KernelOptions.decode_fp8_pairs): fp8 tiles read as 16-bit words, two programs
    per SM; two stages, three from one (sequence, KV head) pair per SM. Measured on the H100, the
    grid sized as the engine's 4K or 32K graphs size it, 2 / 3 stages: batch 1 and 4 at 32K level
    (30.2-30.8 / 30.1-30.7 µs, 95.7-96.0 / 95.8-96.0 µs), batch 32 at 4K 92.6-93.1 / 93.2-93.4
    µs, at 576 14.9-15.2 / 13.0-13.4 µs, batch 128 at 576 58.1-58.2 / 57.7-58.0 µs; a batch-32
    step of the Llama-3.2-1B shape with an fp8 cache 1.410 -> 1.384 ms (docs/benchmarks.md, "fp8
    KV cache")."""
    if fp8 and fp8_pairs and not short:
        return (3 if batch * kv_heads >= sm_count else 2), 2
    if (fp8 or deep) and not short:
        return 3, 2
    pairs = batch * kv_heads
    if not short and (pairs * 8 <= sm_count or (wave and pairs <= sm_count)):
        return 3, 1
    return 2, 2


def _table_span(
    max_context_len: int, num_splits: int, block_n: int, min_split: int, block_size: int
) -> int:
    # Block-table entries of the longest split a launch can have: its blocks, plus one when its
    # first tile is not block-aligned (a sliding window).
    longest = max(
        min_split, triton.cdiv(triton.cdiv(max_context_len, num_splits), block_n) * block_n
    )
    return triton.next_power_of_2(triton.cdiv(longest, block_size) + 1)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return device_for(device).sm_count
    return 4  # the interpreter: a few splits, small enough to run the merge on CPU


def decode_grid_bounds(batch: int, max_model_len: int) -> list[int]:
    """The grid bounds a decode graph of `batch` sequences is captured for, one graph each: a
    lone sequence also gets the short-context launch when contexts can be longer than its bound."""
    if batch == 1 and max_model_len > SHORT_DECODE_CONTEXT:
        return [SHORT_DECODE_CONTEXT, max_model_len]
    return [max_model_len]


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One decode launch's configuration for a grid bound: what a CUDA graph bakes in, and what an
    eager step plans for its own longest context (`plan_decode`)."""

    batch: int
    max_context_len: int  # the grid bound: every context of a step must be at most this
    block_n: int  # tokens per tile
    min_split: int  # fewest tokens a split reads
    num_splits: int
    tma: bool  # tiles through the tensor-memory accelerator
    table_span: int  # block-table entries a TMA split holds (1 without TMA)
    num_stages: int | None = None  # None: Triton's default
    num_warps: int | None = None
    pdl: bool = False  # launched with programmatic dependent launch (KernelOptions.attention_pdl)
    # programs start longest context first (KernelOptions.decode_longest_first), over one wave
    longest_first: bool = False
    # an fp8 cache's q @ K on the fp8 tensor cores, q quantized (KernelOptions.decode_fp8_qk)
    qk_fp8: bool = False
    # TMA tiles of V feed P @ V as fetched, rows past the context not zeroed: the cache must hold
    # finite values there (KernelOptions.decode_unmasked_v)
    unmasked_v: bool = False
    # splits past a sequence's context return before the wait (KernelOptions.decode_idle_exit)
    idle_exit: bool = False
    # an fp8 cache's TMA tiles read as 16-bit words, two values a word, split into even and odd
    # columns in registers (KernelOptions.decode_fp8_pairs)
    fp8_pairs: bool = False
    # a split's first K and V tiles fetched before the PDL wait where the new token's k/v come
    # from registers (KernelOptions.decode_preload_rows; a 16-bit cache's TMA tiles)
    preload: bool = False
    # the grid's first axis the KV heads, not the sequences (KernelOptions.decode_heads_first):
    # a cache row holds every KV head's values of a token, so one sequence's heads, started
    # together, read whole rows between them, where the sequences' programs of one head each
    # read a slice of every row
    heads_first: bool = False


# A CUDA grid's second axis holds at most this many programs: a heads-first grid of more
# sequences keeps them on the first axis.
GRID_Y_MAX = 65535


def plan_decode(
    batch: int,
    kv_cache: torch.Tensor,
    max_context_len: int,
    *,
    tma: bool | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    min_split: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    pdl: bool = False,
    longest_first: bool = False,
    deep: bool = True,
    wave: bool = True,
    qk_fp8: bool = False,
    unmasked_v: bool = False,
    idle_exit: bool = False,
    fp8_pairs: bool = False,
    preload: bool = False,
    heads_first: bool = False,
) -> DecodePlan:
    """The launch for `batch` sequences of contexts up to `max_context_len` over `kv_cache`.

    Pass the engine's max_model_len when capturing a CUDA graph, so one graph serves every step.
    `tma`: None takes the accelerator where tma_applies (with tma_launch's stages and split count
    unless given), False never, True always. `deep`: deep_tma_launch where it applies
    (KernelOptions.decode_deep_tma). `wave`: tma_launch's (KernelOptions.decode_wave_tma).
    `qk_fp8`: over an fp8 cache, q @ K on the fp8 tensor cores (KernelOptions.decode_fp8_qk).
    `unmasked_v`: V's TMA tiles unzeroed past the context, for a cache that holds only finite
    values (KernelOptions.decode_unmasked_v), where unmasked_v_applies. `idle_exit`: splits past
    a sequence's context return first thing (KernelOptions.decode_idle_exit). `fp8_pairs`: an fp8
    cache's TMA tiles as 16-bit words (KernelOptions.decode_fp8_pairs; not with `qk_fp8`).
    `preload`: a 16-bit cache's TMA split fetches its first K and V tiles before the PDL wait
    when the kernel takes the new token from registers (KernelOptions.decode_preload_rows).
    `heads_first`: the grid's first axis the KV heads (KernelOptions.decode_heads_first), up to
    GRID_Y_MAX sequences. The
    other arguments override the measured defaults (benchmarks and tests)."""
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    short = short_decode(batch, max_context_len)
    fp8 = kv_cache.dtype == FP8
    deep = deep and block_n is None and deep_tma_launch(batch, kv_heads, short, fp8)
    # word pairs need half a head of at least 16 values: the dot products' smallest side
    pairs = fp8_pairs and fp8 and not qk_fp8 and kv_cache.shape[-1] >= 32
    if short:
        block_n = 64 if block_n is None else block_n
        min_split = block_n if min_split is None else min_split
        num_stages = 2 if num_stages is None else num_stages
    if block_n is None:
        block_n = decode_block_n(batch, kv_heads)
    if min_split is None:
        min_split = DECODE_MIN_SPLIT
    sm_count = _sm_count(kv_cache.device)
    tile = 64 if deep else block_n  # a deep launch's tiles; plain loads keep block_n's
    if tma is None and tma_applies(kv_cache, tile):
        # A TMA launch keeps one wave: its shared memory leaves room for `per_sm` programs.
        wave = wave and max_context_len <= WAVE_TMA_MAX_CONTEXT
        stages, per_sm = tma_launch(batch, kv_heads, sm_count, short, fp8, deep, wave, pairs)
        splits = num_splits or max(
            1, min(per_sm * sm_count // (batch * kv_heads), math.ceil(max_context_len / tile))
        )
        if _table_span(max_context_len, splits, tile, min_split, block_size) <= TMA_MAX_TABLE_SPAN:
            tma, num_splits, num_stages, block_n = True, splits, num_stages or stages, tile
    tma = bool(tma)
    if num_splits is None:
        num_splits = decode_num_splits(batch, kv_heads, max_context_len, block_n, sm_count)
    table_span = (
        _table_span(max_context_len, num_splits, block_n, min_split, block_size) if tma else 1
    )
    # Order only matters where programs wait for a slot: more than one wave of them.
    programs = batch * kv_heads * num_splits
    longest_first = longest_first and batch > 1 and programs > _WAVE_PROGRAMS * sm_count
    return DecodePlan(
        batch,
        max_context_len,
        block_n,
        min_split,
        num_splits,
        tma,
        table_span,
        num_stages,
        num_warps,
        pdl_applies(kv_cache.device, pdl),
        longest_first,
        qk_fp8 and fp8,
        unmasked_v and tma and unmasked_v_applies(kv_cache.dtype, deep, pairs),
        idle_exit and num_splits > 1,
        pairs and tma,
        preload and tma and not fp8,
        heads_first and batch <= GRID_Y_MAX,
    )


@triton.jit
def _longest_first_kernel(lens_ptr, order_ptr, n, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    # Each sequence's rank counts the longer contexts, and the equal ones before it (a stable
    # order); the sequence then writes itself at its rank.
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mine = tl.load(lens_ptr + i, mask=i < n, other=0)
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for start in range(0, n, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        theirs = tl.load(lens_ptr + j, mask=j < n, other=0)
        ahead = (theirs[None, :] > mine[:, None]) | (
            (theirs[None, :] == mine[:, None]) & (j[None, :] < i[:, None])
        )
        rank += tl.sum((ahead & (j[None, :] < n)).to(tl.int32), 1)
    tl.store(order_ptr + rank, i, mask=i < n)


_ORDER_BLOCK = 64  # sequences a program ranks, and compares against per iteration


def decode_order(context_lens: torch.Tensor) -> torch.Tensor:
    """The sequences' permutation, longest context first, ties in batch order (int32): a decode
    launch's start order. One small kernel of pairwise comparisons, where torch's sort of a few
    hundred values launches several (18 µs a step at 207 sequences on the H200)."""
    n = context_lens.shape[0]
    order = torch.empty(n, dtype=torch.int32, device=context_lens.device)
    block = _ORDER_BLOCK
    _longest_first_kernel[(triton.cdiv(n, block),)](
        context_lens, order, n, BLOCK_I=block, BLOCK_J=block
    )
    return order


def paged_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan,
    sliding_window: int | None = None,
    new: NewTokens | None = None,
    kv_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    order_ready: bool = False,
) -> torch.Tensor:
    """One query per sequence, q [batch, heads, head_dim], over the paged cache, launched as `plan`
    says (plan_decode); returns [batch, heads, head_dim] in q's dtype (into `out` when given): the
    split kernel, then the merge kernel where the plan has splits.
    `order`: a permutation of the sequences (int32 [batch], longest context first: decode_order),
    the order their programs start in when `plan.longest_first`; `order_ready`: it was made before
    the kernel just before this launch (an earlier layer's), so programs may read it before their
    PDL wait.
    With `new`, q is the unrotated q straight from the q/k/v projection and the new k/v are not in
    the cache yet: the kernel rotates them, stores them and attends with them (see NewTokens).
    `kv_scale`: an fp8 cache's [k_scale, v_scale].
    """
    fp8 = check_kv_scale(kv_cache, kv_scale)
    batch, heads, dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    assert plan.batch == batch, f"a plan for {plan.batch} sequences launched for {batch}"
    if not plan.longest_first:
        order = None
    elif order is None:
        order, order_ready = decode_order(context_lens), False
    num_splits, block_n, min_split, tma = plan.num_splits, plan.block_n, plan.min_split, plan.tma
    num_stages, num_warps, table_span = plan.num_stages, plan.num_warps, plan.table_span
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    assert out.shape == (batch, heads, dim) and out.stride(-1) == 1
    if num_splits > 1:
        part = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    else:  # one split writes the output itself: no partials
        part, lse, part_strides, lse_strides = out, out, (0, 0, 0), (0, 0)
    d_pad = triton.next_power_of_2(dim)
    if new is not None:
        assert dim & (dim - 1) == 0, "the rotary halves must be a power of two"
        assert q.stride(-1) == 1 and new.k.stride(-1) == 1 and new.v.stride(-1) == 1
        assert (new.q_norm is None) == (new.k_norm is None)
        k, v, slots = new.k, new.v, new.slot_mapping
        cos, sin = new.cos.reshape(batch, dim), new.sin.reshape(batch, dim)
        qw, kw = (new.q_norm, new.k_norm) if new.q_norm is not None else (q, q)
        eps, stride_rb = new.eps, cos.stride(0)
        assert sin.stride(0) == stride_rb
    else:
        k = v = cos = sin = qw = kw = q
        slots, eps, stride_rb = context_lens, 0.0, 0
    desc = None
    if tma:
        assert kv_cache.shape[2] % block_n == 0 and dim & (dim - 1) == 0, (
            "TMA tiles must lie inside one block"
        )
        rows = kv_cache.view(-1, kv_heads, dim)  # [blocks * 2 * block_size, kv_heads, head_dim]
        if plan.fp8_pairs:  # two values a 16-bit word (fp8_pairs)
            rows = rows.view(torch.int16)
        width = rows.shape[-1]
        desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, 1, width])
    grid = (kv_heads, batch, num_splits) if plan.heads_first else (batch, kv_heads, num_splits)
    _decode_kernel[grid](
        q,
        k,
        v,
        cos,
        sin,
        qw,
        kw,
        slots,
        kv_cache,
        desc,
        kv_scale if fp8 else context_lens,
        block_tables,
        context_lens,
        order if order is not None else context_lens,
        out,
        part,
        lse,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        stride_rb,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *part_strides,
        *lse_strides,
        scale,
        eps,
        kv_cache.shape[2],
        sliding_window or 0,
        min_split,
        num_splits,
        G=group,
        # the fp8 tensor cores' products (wgmma) take 64 rows: the group padded to them
        G_PAD=64 if plan.qk_fp8 else max(16, triton.next_power_of_2(group)),
        D=dim,
        D_PAD=d_pad,
        BLOCK_N=block_n,
        PREC=_precision(kv_cache, q),
        NEW=new is not None,
        QK_NORM=new is not None and new.q_norm is not None,
        SPLIT=num_splits > 1,
        TMA=tma,
        TABLE_SPAN=table_span,
        USE_PDL=plan.pdl,
        FP8=fp8,
        KV_DOT=_kv_dot(q),
        ORDERED=order is not None,
        QK_FP8=plan.qk_fp8,
        ORDER_READY=order is not None and order_ready,
        MASK_V=not plan.unmasked_v,
        IDLE_EXIT=plan.idle_exit,
        FP8_PAIRS=plan.fp8_pairs,
        FP8_ASM=plan.fp8_pairs and not triton.knobs.runtime.interpret and _kv_dot(q) == tl.float16,
        # the sequence known before the wait (no order, or one an earlier layer made)
        PRELOAD=plan.preload and new is not None and (order is None or order_ready),
        HEADS_FIRST=plan.heads_first,
        launch_pdl=plan.pdl,
        **{
            k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None
        },
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, heads)](
            part,
            lse,
            out,
            context_lens,
            *part_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            min_split,
            num_splits,
            S_PAD=max(2, triton.next_power_of_2(num_splits)),
            D=dim,
            D_PAD=d_pad,
            BLOCK_N=block_n,
            USE_PDL=plan.pdl,
            launch_pdl=plan.pdl,
        )
    return out


@triton.jit
def _prefill_tile(
    q,
    qk_scale,
    m,
    row_sum,
    acc,
    head_ptr,
    desc,
    table_ptr,
    start,
    last,
    qpos,
    window,
    hkv,
    d,
    stride_cb,
    stride_ckv,
    stride_cs,
    block_size,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    FP8: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    """One tile of BLOCK_N keys into the running softmax, in base 2: the scores stay as the dot
    gives them and `qk_scale` (softmax scale times log2(e)) enters the maximum and, one fused
    multiply-add a score, the exponent. Unmasked tiles lie wholly before the program's first query
    and inside the window: no compare, no select, no guarded load."""
    n = start + tl.arange(0, BLOCK_N)
    nmask = n < last
    if TMA:  # a tile inside one block (BLOCK_N divides it): rows [blocks * 2 * bs, kv_heads, D]
        krow = tl.load(table_ptr + start // block_size) * 2 * block_size + start % block_size
        k = desc.load([krow, hkv, 0]).reshape(BLOCK_N, D_PAD)
        v = desc.load([krow + block_size, hkv, 0]).reshape(BLOCK_N, D_PAD)
    else:
        if MASKED:
            blk = tl.load(table_ptr + n // block_size, mask=nmask, other=0)
        else:
            blk = tl.load(table_ptr + n // block_size)
        kv_ptrs = head_ptr + (blk.to(tl.int64) * stride_cb + (n % block_size) * stride_cs)[:, None]
        kv_mask = nmask[:, None] & (d < D)[None, :]  # unmasked tiles: every row inside
        if MASKED or D_PAD != D:
            k = tl.load(kv_ptrs + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(kv_ptrs + stride_ckv + d[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(kv_ptrs + d[None, :])
            v = tl.load(kv_ptrs + stride_ckv + d[None, :])
    if FP8:
        k = k.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASKED:
        allowed = nmask[None, :] & (n[None, :] <= qpos[:, None])
        if window > 0:
            allowed = allowed & (n[None, :] > qpos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1) * qk_scale)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with no key yet (window)
        if TMA:  # a stale NaN past the context must not reach the sum: weight 0 times V
            v = tl.where(nmask[:, None], v, 0.0)
    else:
        m_new = tl.maximum(m, tl.max(qk, 1) * qk_scale)
        m_safe = m_new
    p = tl.exp2(qk * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    if FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, row_sum, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    desc,
    kvs_ptr,
    tables_ptr,
    ctx_ptr,
    qstart_ptr,
    out_ptr,
    tiles_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_tb,
    stride_ot,
    stride_oh,
    scale,
    block_size,
    window,
    G: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    FP8: tl.constexpr,
    KV_DOT: tl.constexpr,
    TILED: tl.constexpr,
    TMA: tl.constexpr,
):
    # A program takes P query heads of one KV head (P divides G) for BLOCK_M queries: its rows are
    # (query, head) pairs, query-major, so each K/V tile feeds P heads' products.
    h0 = tl.program_id(1) * P
    if TILED:  # a fixed grid (a CUDA graph's): each program reads its (sequence, query tile)
        seq = tl.load(tiles_ptr + 2 * tl.program_id(0))
        mtile = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
        if seq < 0:
            return
    else:
        seq = tl.program_id(0)
        mtile = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_begin
    if mtile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    hkv = h0 // G
    r = tl.arange(0, BLOCK_M * P)
    i = mtile * BLOCK_M + r // P  # query index within the sequence's chunk
    head = h0 + r % P
    imask = i < q_len
    qpos = ctx - q_len + i  # absolute position of each query
    d = tl.arange(0, D_PAD)
    dmask = d < D
    q = tl.load(
        q_ptr + (q_begin + i)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=imask[:, None] & dmask[None, :],
        other=0.0,
    )
    # the softmax scale and log2(e) are applied to the fp32 scores (_prefill_tile): folded into the
    # bf16 queries, their rounding cost up to half a point of the trained model's bf16 agreement
    qk_scale = scale * 1.4426950408889634
    if FP8:  # as in _decode_kernel: dequantized tiles, k_scale on q, v_scale on the output
        q = (q * tl.load(kvs_ptr)).to(KV_DOT)
    else:
        q = q.to(cache_ptr.dtype.element_ty)
    m = tl.full([BLOCK_M * P], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M * P], tl.float32)
    acc = tl.zeros([BLOCK_M * P, D_PAD], tl.float32)
    tile_pos = ctx - q_len + mtile * BLOCK_M  # position of the tile's first query
    last = tl.minimum(ctx, tile_pos + BLOCK_M)  # causal: no key past the tile's last query
    first = tl.where(window > 0, tl.maximum(tile_pos - window + 1, 0), 0)
    first = (first // BLOCK_N) * BLOCK_N
    # key tiles every query sees whole: before the first query, and no window to cut them
    full_end = tl.where(window > 0, first, ((tile_pos + 1) // BLOCK_N) * BLOCK_N)
    for masked in tl.static_range(2):  # the unmasked tiles' loop, then the diagonal's
        for start in range(full_end if masked else first, last if masked else full_end, BLOCK_N):
            m, row_sum, acc = _prefill_tile(
                q,
                qk_scale,
                m,
                row_sum,
                acc,
                cache_ptr + hkv * stride_ch,
                desc,
                tables_ptr + seq * stride_tb,
                start,
                last,
                qpos,
                window,
                hkv,
                d,
                stride_cb,
                stride_ckv,
                stride_cs,
                block_size,
                D,
                D_PAD,
                BLOCK_N,
                PREC,
                FP8,
                masked,
                TMA,
            )
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    if FP8:
        out = out * tl.load(kvs_ptr + 1)
    tl.store(
        out_ptr + (q_begin + i)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=imask[:, None] & dmask[None, :],
    )


@dataclass(frozen=True)
class PrefillLaunch:
    """How paged_prefill_triton tiles a step: query heads a program takes (dividing the group),
    keys a tile, warps, pipeline stages, and whether K/V tiles come through the TMA where the
    cache allows (prefill_tma_fits)."""

    heads_per_program: int = 1
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # TMA tiles, one query head a program: the fastest of the sweep on the H100 (2026-12-07,
    # docs/benchmarks.md "Prefill attention"), 0.222 -> 0.127 ms on a step of the throughput
    # workload's prompts against the kernel before these options.
    tma: bool = True


def prefill_tma_fits(kv_cache: torch.Tensor, block_n: int, fp8: bool) -> bool:
    """Whether prefill tiles can come through the TMA: a contiguous, aligned 16-bit cache (or
    fp32, for the interpreter's checks) whose blocks hold whole tiles, a power-of-two head size,
    Hopper or later where the cache is on a GPU."""
    dim = kv_cache.shape[-1]
    # on a GPU only what was measured there: 16-bit tiles; fp32 only in the interpreter
    on_gpu = kv_cache.dtype in (torch.bfloat16, torch.float16) and (
        device_for(kv_cache.device).compute_capability >= (9, 0)
    )
    return (
        not fp8
        and (not kv_cache.is_cuda or on_gpu)
        and kv_cache.is_contiguous()
        and kv_cache.data_ptr() % 16 == 0
        and kv_cache.shape[2] % block_n == 0
        and dim & (dim - 1) == 0
    )


def paged_prefill_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    kv_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    launch: PrefillLaunch | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries q [num_tokens, heads, head_dim] over the paged cache,
    cached prefixes included (the queries are the last query_len positions of each context).

    With `meta.prefill_tiles` (prefill_tiles() below, for block_m = PREFILL_BLOCK_M) the grid is
    that map's length, whatever the step's sequences: what a CUDA graph can bake in."""
    fp8 = check_kv_scale(kv_cache, kv_scale)
    num_tokens, heads, dim = q.shape
    group = heads // kv_cache.shape[3]
    launch = launch or PrefillLaunch()
    if block_n is not None:
        launch = dataclasses.replace(launch, block_n=block_n)
    per_program = launch.heads_per_program
    if group % per_program:
        raise ValueError(f"{per_program} query heads a program do not divide the group of {group}")
    out = torch.empty_like(q) if out is None else out
    tiles = meta.prefill_tiles
    if tiles is not None:
        assert block_m == PREFILL_BLOCK_M, "the tile map is laid out for PREFILL_BLOCK_M"
        grid: tuple[int, ...] = (tiles.shape[0] // 2, heads // per_program)
    else:
        grid = (meta.num_seqs, heads // per_program, triton.cdiv(meta.max_query_len, block_m))
    desc = None
    if launch.tma and prefill_tma_fits(kv_cache, launch.block_n, fp8):
        rows = kv_cache.view(-1, *kv_cache.shape[3:])  # [blocks * 2 * block_size, kv_heads, D]
        desc = TensorDescriptor(
            rows, list(rows.shape), list(rows.stride()), [launch.block_n, 1, dim]
        )
    _prefill_kernel[grid](
        q,
        kv_cache,
        desc,
        kv_scale if fp8 else meta.context_lens,
        meta.block_tables,
        meta.context_lens,
        meta.query_start_loc,
        out,
        tiles if tiles is not None else meta.context_lens,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        kv_cache.shape[2],
        sliding_window or 0,
        G=group,
        P=per_program,
        D=dim,
        D_PAD=triton.next_power_of_2(dim),
        BLOCK_M=block_m,
        BLOCK_N=launch.block_n,
        PREC=_precision(kv_cache, q),
        FP8=fp8,
        KV_DOT=_kv_dot(q),
        TILED=tiles is not None,
        TMA=desc is not None,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out


PREFILL_BLOCK_M = 64  # paged_prefill_triton's query tile


def prefill_tiles(query_lens: list[int], num_tiles: int, skip: int = 0) -> list[int]:
    """The (sequence, query tile) of each program of a fixed `num_tiles`-program prefill grid,
    flat, padded with (-1, -1): programs past the step's tiles exit at once. The first `skip`
    sequences get none (their rows go to the decode kernel: AttentionMetadata.decode_lens)."""
    flat = [
        v
        for seq, n in enumerate(query_lens)
        if seq >= skip
        for t in range(-(-n // PREFILL_BLOCK_M))
        for v in (seq, t)
    ]
    assert len(flat) <= 2 * num_tiles, "more query tiles than the grid holds"
    return flat + [-1] * (2 * num_tiles - len(flat))


def max_prefill_tiles(num_tokens: int, num_seqs: int) -> int:
    """Query tiles of any step of `num_tokens` tokens over at most `num_seqs` sequences."""
    return -(-num_tokens // PREFILL_BLOCK_M) + min(num_seqs, num_tokens)


def plan_step_decode(
    meta: AttentionMetadata, kv_cache: torch.Tensor, kernels: KernelOptions
) -> DecodePlan:
    """The decode launch of a step: for its graph's grid bound inside a CUDA graph (one graph serves
    every step), for the step's own longest context otherwise."""
    bound = meta.grid_context_len or meta.max_context_len
    return plan_decode(
        meta.num_seqs,
        kv_cache,
        bound,
        tma=None if kernels.decode_tma else False,
        pdl=kernels.attention_pdl,
        longest_first=kernels.decode_longest_first,
        deep=kernels.decode_deep_tma,
        wave=kernels.decode_wave_tma,
        qk_fp8=kernels.decode_fp8_qk,
        num_splits=kernels.decode_splits or None,
        unmasked_v=kernels.decode_unmasked_v,
        idle_exit=kernels.decode_idle_exit,
        fp8_pairs=kernels.decode_fp8_pairs,
        preload=meta.num_seqs <= kernels.decode_preload_rows,
        heads_first=kernels.decode_heads_first,
    )


def step_order(
    meta: AttentionMetadata, lens: torch.Tensor, plan: DecodePlan
) -> tuple[torch.Tensor | None, bool]:
    """The step's decode start order (decode_order), one sort a step shared by its layers
    (meta.scratch lives for one step, or one graph), and whether an earlier layer made it
    (paged_decode_triton's `order_ready`)."""
    if not plan.longest_first:
        return None, False
    if "decode_order" not in meta.scratch:
        meta.scratch["decode_order"] = decode_order(lens)
        return meta.scratch["decode_order"], False
    return meta.scratch["decode_order"], True


def _mixed_in_graph(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    kernels: KernelOptions,
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """A mixed step's attention on fixed grids: the split-KV decode kernel over the leading
    one-token rows (`meta.decode_lens`; the rows past the step's decodes have context 1 and are
    rewritten next), then the tile-mapped prefill kernel over the other sequences' chunks. The
    prefill kernel alone would give each decode row a 64-row query tile and one program per head
    reading its whole context: 60 % of a Qwen3-0.6B step of 512 prefill tokens and 31 decodes."""
    out = torch.empty_like(q)
    lens = meta.decode_lens
    if lens is not None:
        rows = lens.shape[0]
        plan = plan_decode(
            rows,
            kv_cache,
            meta.grid_context_len or meta.max_context_len,
            tma=None if kernels.decode_tma else False,
            pdl=kernels.attention_pdl,
            longest_first=kernels.decode_longest_first,
            deep=kernels.decode_deep_tma,
            wave=kernels.decode_wave_tma,
            num_splits=kernels.decode_splits or None,
            unmasked_v=kernels.decode_unmasked_v,
            idle_exit=kernels.decode_idle_exit,
            fp8_pairs=kernels.decode_fp8_pairs,
            preload=rows <= kernels.decode_preload_rows,
            heads_first=kernels.decode_heads_first,
        )
        order, ready = step_order(meta, lens, plan)
        paged_decode_triton(
            q[:rows],
            kv_cache,
            meta.block_tables[:rows],
            lens,
            scale,
            plan,
            sliding_window,
            kv_scale=kv_scale,
            out=out[:rows],
            order=order,
            order_ready=ready,
        )
    return paged_prefill_triton(
        q, kv_cache, meta, scale, sliding_window, kv_scale=kv_scale, out=out
    )


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kernels: KernelOptions = KernelOptions(),
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton backend's attention: split-KV decode for decode-only steps; long prefill chunks
    through torch's fused attention (attention.SDPA_MIN_QUERY_LEN says why); paged prefill
    otherwise."""
    if meta.prefill_tiles is not None:  # a mixed step inside a CUDA graph
        return _mixed_in_graph(q, kv_cache, meta, scale, sliding_window, kernels, kv_scale)
    if sdpa_prefill_applies(meta, sliding_window):
        return paged_prefill_sdpa(q, kv_cache, meta, scale, kv_scale)
    if meta.is_decode_only:
        plan = plan_step_decode(meta, kv_cache, kernels)
        order, ready = step_order(meta, meta.context_lens, plan)
        return paged_decode_triton(
            q,
            kv_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            plan,
            sliding_window,
            kv_scale=kv_scale,
            order=order,
            order_ready=ready,
        )
    return paged_prefill_triton(q, kv_cache, meta, scale, sliding_window, kv_scale=kv_scale)
