"""Batch-1 GEMV: y = W x (+ b) for one activation row against an nn.Linear weight [N, K], with the
per-token work around a decoder's projections folded into it.

At batch 1 a projection is a pure weight stream. cuBLAS picks split-K kernels for some of the
Llama-3-8B shapes, which adds a reduce kernel after o and down, and reads the q/k/v and o weights
at ~3.2 TB/s inside a decode graph. This kernel gives each program BLOCK_N whole rows and streams
them in BLOCK_K chunks, one fp32 dot per row at the end: no split-K, no second kernel.

Because every program reads the whole input row anyway (a few KB, from L2), the elementwise
kernels that sit between the projections of a decoder layer fold in at little cost:
- `norm`: the input is the residual stream and the product is taken with RMSNorm(input) * weight;
  each program first computes the row's mean square (one extra pass over the input).
- `silu`: the input is a fused gate/up output [1, 2K] and the product is taken with
  silu(gate) * up, computed chunk by chunk as the weight streams.
- `residual`: the output is added into the residual stream in place (each program owns its rows),
  or written elsewhere with the residual added (`out`: a tensor-parallel rank's partial sum,
  staged where the all-reduce reads it).
Each rounds where the unfused kernels round (triton_elementwise.py), so the fused and unfused
paths agree to the last bit given the same accumulation order.

fp8 weights (`scale`: engine/quantization.py) stream as float8_e4m3fn, half the bytes of bf16; each
row's dot is multiplied by the row's scale before the bias and the residual. With twice the
multiply-adds per byte, conversions rather than bytes bound it: widening every weight to float32
(e4m3 -> f16 -> f32, two conversions) ran the 8B chain at 65 % of its floor against bf16's 96 %.
With 16-bit activations the products are therefore taken in float16: one conversion per weight
(e4m3 -> f16) instead of two, the input pre-scaled by 2^-8 so that 448 * x stays in range, each
product summed in float16 over the K chunks (4 to 14 terms) and the rows' sums in float32: 73 % of
the floor (docs/benchmarks.md, "fp8 weights"). Tensor-core products of the row block against the
input chunk measured slower still (2.7x), so they are not used. The input's own conversions count
too: the down projection's SiLU prologue, computed and converted in every program, took 23.4 us
where a float16 input already pre-scaled takes 16.3 (`prescaled`, fed by a SiLU-and-mul kernel
of its own: KernelOptions.fp8_silu_kernel).

Q8_0 weights (int8, one float16 scale per 32 weights of a row: engine/quantization.py) stream with
their scales, 1.0625 bytes a weight; each 32-weight block's dot (float32) is multiplied by its
scale as the chunk is summed, so the accumulator holds one partial sum per block of the chunk.

Q4_K weights (4-bit values two a byte, beside int32 words with each 32 weights' 6-bit scale and
min and each super-block's d and dmin: engine/quantization.py) stream at 0.58 bytes a weight; each
32 bytes of a chunk are two sub-blocks, the low nibbles and the high, each dotted with its own
inputs, times d * sc, less dmin * m times the sum of those inputs (kernels/triton_q4k.py reads the
words). On the H200 it runs at bf16's batch-1 speed on a third of the bytes, bound by those
instructions (docs/benchmarks.md, "Q4_K weights").

The weights stream one chunk ahead of the multiply, either in registers or (`stages` >= 2 in the
configuration) through shared memory, stages - 1 chunks ahead, by Triton's software pipeliner:
more bytes in flight per program without spending registers on them. Same chunks, same order, same
bits either way. It pays where a program's share is long: the down projection (14336-wide rows)
with three stages took the 8B batch-1 decode step from 4.14 to 4.06 ms on the H200.

A small weight (KernelOptions.gemv_l2_prefetch_bytes) is asked of the L2 whole by the first
programs before the PDL wait (`l2_prefetch_plan`), while the kernel before still runs:
SmolLM2-135M's step 481 -> 467 us on the H100; larger weights measured slower
(docs/benchmarks.md, "Engine small-model profile").

Against cuBLAS on the H200: docs/benchmarks.md, "Batch-1 GEMV", "GEMV chain" and "Decode step".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.cuda.torch_interop import device_for
from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel
from flashstack.engine.kernels.triton_activations import silu_mul
from flashstack.engine.kernels.triton_q4k import group_scales
from flashstack.engine.quantization import FP8, dequantized_linear

# What fp8 products in float16 multiply their input by first (_product): 448 * x stays in range.
HALF_INPUT_SCALE = 2.0**-8
_HALF_INPUT_SCALE = tl.constexpr(HALF_INPUT_SCALE)

# The largest piece one L2 prefetch asks for (`prefetch_to_l2`): a program's span goes in pieces.
_L2_PREFETCH_PIECE = tl.constexpr(1 << 16)


@triton.jit
def prefetch_to_l2(ptr, nbytes):
    """Ask the L2 for `nbytes` (a multiple of 16) from `ptr` (16-byte aligned) without waiting for
    them (`cp.async.bulk.prefetch.L2`, Hopper): one thread of the program asks, in 64 KB pieces."""
    base = ptr.to(tl.int64, bitcast=True)
    for off in range(0, nbytes, _L2_PREFETCH_PIECE):
        size = tl.minimum(nbytes - off, _L2_PREFETCH_PIECE).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + off, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def stream_values(x_ptr, p_ptr, offs, mask, PENDING: tl.constexpr = False):
    """The residual stream x at `offs`; with PENDING, plus a fused MLP's float32 sum p not yet
    added (kernels/triton_mlp.py), rounded as the down GEMV's residual epilogue rounds them."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PENDING:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(x.dtype).to(tl.float32)
        x = (p + x.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def input_chunk(
    x_ptr,
    g_ptr,
    kcols,
    cmask,
    K,
    rstd,
    act_dtype,
    NORM_IN: tl.constexpr,
    SILU_IN: tl.constexpr,
    p_ptr=None,
    PENDING: tl.constexpr = False,
):
    """The activations that multiply one weight chunk (columns `kcols`), with the input prologue
    applied: RMSNorm (NORM_IN: of the residual stream x, PENDING: plus p's sum, `stream_values`;
    times the norm's weight g, at `rstd`) or silu(gate) * up (SILU_IN: x holds gate then up),
    rounded as the unfused kernels round, in float32."""
    if SILU_IN:
        gate = tl.load(x_ptr + kcols, mask=cmask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + kcols, mask=cmask, other=0.0)
        x = silu_mul(gate, up)
    elif NORM_IN:  # x is the residual stream
        x = stream_values(x_ptr, p_ptr, kcols, cmask, PENDING)
        x = tl.load(g_ptr + kcols, mask=cmask, other=0.0) * (x.to(tl.float32) * rstd).to(act_dtype)
    else:
        x = tl.load(x_ptr + kcols, mask=cmask, other=0.0)
    return x.to(act_dtype).to(tl.float32)


@triton.jit
def row_rstd(x_ptr, K, eps, BLOCK_K: tl.constexpr, p_ptr=None, PENDING: tl.constexpr = False):
    """1 / sqrt(mean(x^2) + eps) of the row x [K] (PENDING: plus p's sum, `stream_values`),
    summed in BLOCK_K-wide chunks (RMSNorm's scale, as the norm prologues take it)."""
    cols = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_K], tl.float32)
    # unrolled: with K a launch argument, a plain loop issued each chunk's load only after the
    # previous one had arrived (one L2 round trip a chunk, between the wait and the first product)
    for k in tl.range(0, K, BLOCK_K, loop_unroll_factor=4):
        xs = stream_values(x_ptr, p_ptr, k + cols, k + cols < K, PENDING).to(tl.float32)
        sq += xs * xs
    return tl.rsqrt(tl.sum(sq, 0) / K + eps)


@triton.jit
def _product(w, x, HALF: tl.constexpr, PRESCALED: tl.constexpr = False):
    # One chunk's products. HALF (fp8 weights, 16-bit activations): in float16, one e4m3 -> f16
    # conversion per weight and the input pre-scaled by 2^-8 so that 448 * x stays in range
    # (PRESCALED: it came so); float32 otherwise (for fp8 weights two conversions per weight,
    # e4m3 -> f16 -> f32).
    if PRESCALED:
        p = w.to(tl.float16) * x[None, :]
    elif HALF:
        p = w.to(tl.float16) * (x * _HALF_INPUT_SCALE).to(tl.float16)[None, :]
    else:
        p = w.to(tl.float32) * x[None, :]
    return p


@triton.jit
def _block_product(w, x, s_ptr, rows, rmask, k, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Q8_0: each 32-weight block's dot times the block's float16 scale, [BLOCK_N, BLOCK_K // 32].
    sums = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, BLOCK_K // 32, 32)), 2)
    blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
    per_row = K // 32
    s = tl.load(
        s_ptr + rows[:, None].to(tl.int64) * per_row + blocks[None, :],
        mask=rmask[:, None] & (blocks < per_row)[None, :],
        other=0.0,
    )
    return sums * s.to(tl.float32)


@triton.jit
def _q4k_product(
    w, x_lo, x_hi, s_ptr, rows, rmask, k, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    # Q4_K: BLOCK_K bytes of values, in 32-byte groups whose low nibbles are one sub-block and
    # high nibbles the next. Each sub-block's dot times d * sc, less dmin * m times the sum of its
    # inputs: [BLOCK_N, BLOCK_K // 32], one entry per pair of sub-blocks.
    groups: tl.constexpr = BLOCK_K // 32
    lo = tl.reshape((w & 15).to(tl.float32) * x_lo[None, :], (BLOCK_N, groups, 32))
    hi = tl.reshape((w >> 4).to(tl.float32) * x_hi[None, :], (BLOCK_N, groups, 32))
    sum_lo = tl.sum(tl.reshape(x_lo, (groups, 32)), 1)[None, :]
    sum_hi = tl.sum(tl.reshape(x_hi, (groups, 32)), 1)[None, :]
    g = k // 32 + tl.arange(0, groups)  # 64-weight group in the row
    mask = rmask[:, None] & (g < K // 64)[None, :]
    sc_lo, m_lo, sc_hi, m_hi, d, dmin = group_scales(s_ptr, rows, g, K, mask)
    scaled = sc_lo * tl.sum(lo, 2) + sc_hi * tl.sum(hi, 2)
    return d * scaled - dmin * (m_lo * sum_lo + m_hi * sum_hi)


@triton.jit
def _chunk(
    w,
    x_ptr,
    g_ptr,
    s_ptr,
    rows,
    rmask,
    k,
    K,
    rstd,
    act_dtype,
    NORM_IN: tl.constexpr,
    SILU_IN: tl.constexpr,
    HALF: tl.constexpr,
    Q8: tl.constexpr,
    Q4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRESCALED: tl.constexpr,
    p_ptr=None,
    PENDING: tl.constexpr = False,
):
    # What one weight chunk (storage columns k .. k + BLOCK_K) adds to the accumulator: products,
    # Q8_0's scaled block sums or Q4_K's, with the activations it multiplies.
    cols = k + tl.arange(0, BLOCK_K)
    if Q4:  # byte b holds input (b // 32) * 64 + b % 32 and, in its high nibble, 32 further on
        x_cols = cols // 32 * 64 + cols % 32
        x_lo = input_chunk(
            x_ptr, g_ptr, x_cols, x_cols < K, K, rstd, act_dtype, NORM_IN, SILU_IN, p_ptr, PENDING
        )
        x_hi = input_chunk(
            x_ptr,
            g_ptr,
            x_cols + 32,
            x_cols + 32 < K,
            K,
            rstd,
            act_dtype,
            NORM_IN,
            SILU_IN,
            p_ptr,
            PENDING,
        )
        p = _q4k_product(w, x_lo, x_hi, s_ptr, rows, rmask, k, K, BLOCK_N, BLOCK_K)
    else:
        if PRESCALED:  # float16, already times 2^-8 (_product): as stored
            p = _product(w, tl.load(x_ptr + cols, mask=cols < K, other=0.0), HALF, PRESCALED)
        else:
            x = input_chunk(
                x_ptr, g_ptr, cols, cols < K, K, rstd, act_dtype, NORM_IN, SILU_IN, p_ptr, PENDING
            )
            if Q8:
                p = _block_product(w, x, s_ptr, rows, rmask, k, K, BLOCK_N, BLOCK_K)
            else:
                p = _product(w, x, HALF)
    return p


@triton.jit
def _gemv_kernel(
    w_ptr,
    x_ptr,
    b_ptr,
    y_ptr,
    r_ptr,
    g_ptr,
    s_ptr,
    N,
    K,
    KW,
    stride_w,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORM_IN: tl.constexpr,
    SILU_IN: tl.constexpr,
    ADD_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
    HALF: tl.constexpr,
    Q8: tl.constexpr,
    Q4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PRESCALED: tl.constexpr,
    PREFETCH_L2: tl.constexpr = False,
    pf_rows=0,
    pf_row_bytes=0,
    p_ptr=None,
    PENDING: tl.constexpr = False,
):
    # K: the input's length; KW: a weight row's, in stored elements (K / 2 bytes for Q4_K)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    act_dtype = x_ptr.dtype.element_ty
    # The first weight chunk depends on nothing earlier in the stream: under programmatic dependent
    # launch it is in flight while the previous kernel finishes.
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & (cols < KW)[None, :], other=0.0)
    # So are the rows' scales and bias; the residual rows are read right after the wait: each
    # load at the end would add a memory latency to the program's tail, which on a small model
    # (a program or two an SM) is the kernel's
    if HAS_SCALE:
        row_scale = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if PREFETCH_L2:
        # The first programs ask the L2 for every row, pf_rows each, while the kernel before
        # still runs: the later waves, and this wave's next chunks, read them from there.
        first = pid * pf_rows
        if first < N:
            span = tl.minimum(N - first, pf_rows).to(tl.int64) * pf_row_bytes
            prefetch_to_l2(w_ptr + first.to(tl.int64) * stride_w, span)
    wait_for_previous_kernel(USE_PDL)  # our input is the previous kernel's output
    if ADD_OUT:  # PENDING: the residual, with a fused MLP's sum added as it is taken in
        old = stream_values(r_ptr, p_ptr, rows, rmask, PENDING).to(tl.float32)
    rstd = 1.0
    if NORM_IN:  # the row's mean square first: rstd scales every chunk of the main loop
        rstd = row_rstd(x_ptr, K, eps, BLOCK_K, p_ptr, PENDING)
    if STAGES > 1:
        # The rest streams through shared memory, STAGES - 1 chunks ahead (Triton's pipeliner,
        # asynchronous copies): more bytes in flight per program without holding them in registers.
        acc = _chunk(
            w,
            x_ptr,
            g_ptr,
            s_ptr,
            rows,
            rmask,
            0,
            K,
            rstd,
            act_dtype,
            NORM_IN,
            SILU_IN,
            HALF,
            Q8,
            Q4,
            BLOCK_N,
            BLOCK_K,
            PRESCALED,
            p_ptr,
            PENDING,
        )
        for k in tl.range(BLOCK_K, KW, BLOCK_K, num_stages=STAGES):
            kcols = k + cols
            w = tl.load(
                w_rows + kcols[None, :], mask=rmask[:, None] & (kcols < KW)[None, :], other=0.0
            )
            acc += _chunk(
                w,
                x_ptr,
                g_ptr,
                s_ptr,
                rows,
                rmask,
                k,
                K,
                rstd,
                act_dtype,
                NORM_IN,
                SILU_IN,
                HALF,
                Q8,
                Q4,
                BLOCK_N,
                BLOCK_K,
                PRESCALED,
                p_ptr,
                PENDING,
            )
    else:
        # One chunk ahead, in registers: the next chunk loads while this one multiplies.
        if Q8 or Q4:
            acc = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float16 if HALF else tl.float32)
        for k in range(0, KW, BLOCK_K):
            acc += _chunk(
                w,
                x_ptr,
                g_ptr,
                s_ptr,
                rows,
                rmask,
                k,
                K,
                rstd,
                act_dtype,
                NORM_IN,
                SILU_IN,
                HALF,
                Q8,
                Q4,
                BLOCK_N,
                BLOCK_K,
                PRESCALED,
                p_ptr,
                PENDING,
            )
            nxt = k + cols + BLOCK_K  # past the end on the last pass: fully masked, reads nothing
            w = tl.load(w_rows + nxt[None, :], mask=rmask[:, None] & (nxt < KW)[None, :], other=0.0)
    y = tl.sum(acc.to(tl.float32), 1)
    if HAS_SCALE:  # fp8 weights: each row's scale (and the input's 2^-8 back, HALF)
        y *= row_scale * (256.0 if HALF else 1.0)
    if HAS_BIAS:
        y += bias
    if ADD_OUT:  # r_ptr is the residual: round the projection first, as `proj(x) + residual` would
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + old
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


# fp8 weights' configurations by prologue or epilogue, swept in the 8B chain on the H200 with the
# float16 products (bench/engine_fp8.py --sweep): three stages each (two chunks ahead through shared
# memory); q/k/v and gate/up with twice bf16's rows, o with bf16's rows in chunks twice as wide,
# down in 2048-wide chunks on 8 warps.
FP8_CONFIGS: dict[str | None, tuple[int, ...]] = {
    "norm": (8, 1024, 4, 3),
    "residual": (4, 2048, 4, 3),
    "silu": (8, 2048, 8, 3),
    None: (8, 1024, 4, 3),
    # float16 input already pre-scaled (a separate SiLU-and-mul kernel's, before down): the
    # best of the down projection alone in a graph of 24 weight copies on the H200, 16.3 us
    "prescaled": (8, 1024, 4, 3),
}


# Q4_K weights' configurations, chunks counted in bytes (two weights each), swept in the 8B chain
# on the H200 (bench/engine_fp8.py --sweep q4_k): q/k/v and gate/up 8 rows in 512-byte chunks, three
# stages; o 4 rows in 1024-byte chunks, three stages; down 8 rows, the next chunk in registers.
Q4K_CONFIGS: dict[str | None, tuple[int, ...]] = {
    "norm": (8, 512, 4, 3),
    "residual": (4, 1024, 4, 3),
    "silu": (8, 512, 4),
    None: (8, 512, 4, 3),
}


def gemv_config(
    n: int, k: int, fused: str | None = None, fp8: bool = False, q4: bool = False
) -> tuple[int, ...]:
    """(rows per program, K chunk, warps[, stages]) per shape, measured on the H200 in the decoder's
    own 32-layer chain (bench/engine_gemv_chain.py; each weight read from memory as in a decode
    step). Fused, as the decoder runs them (`fused` = "norm", "silu" or "residual"): q/k/v and
    gate/up (the norm's extra pass over the input runs in every program) 4 rows in 1024-wide chunks,
    the next chunk in registers; down ("silu") 8 rows, two chunks ahead through shared memory; o
    ("residual") 4 rows, one chunk ahead through shared memory. Plain: long rows (K = 14336) 16 rows
    and 8 warps; very many rows (lm_head) 2 rows; the rest 8 rows, 512-wide chunks. A fourth value
    of 2 or more streams the weights through shared memory (`_gemv_kernel`). `fp8`: weights of one
    byte (fp8 or Q8_0), `FP8_CONFIGS`; `q4`: Q4_K's half a byte, `Q4K_CONFIGS`."""
    if q4:
        return Q4K_CONFIGS[fused]
    if fp8:
        return FP8_CONFIGS[fused]
    # Small models' rows, swept the same way in their own chains (docs/benchmarks.md, "GEMV
    # chain"): rows of one chunk take the shared-memory path (SmolLM2-135M's q/k/v, gate/up and
    # down; Qwen3-0.6B's o); Llama-3.2-1B's step measured slower with such rules, so it keeps these.
    if fused == "silu":
        return (4, 2048, 4, 2) if k <= 2048 else (8, 1024, 4, 3)
    if fused == "residual":
        return (4, 2048, 4, 2) if n <= 1024 and 1024 < k <= 2048 else (4, 1024, 4, 2)
    if fused == "norm":
        return (4, 1024, 4, 2) if k < 1024 else (4, 1024, 4)
    if k > 8192:
        return 16, 1024, 8
    if n >= 16384:
        return 2, 1024, 4
    return 8, 512, 4


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = True,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear (into `out` if given), through `gemv_triton` when x is one row on CUDA. `scale`:
    the weight is fp8 with these per-row scales, Q8_0 with these per-block ones, or Q4_K's values
    with these scales' words (engine/quantization.py)."""
    if x.shape[0] == 1 and x.is_cuda:
        return gemv_triton(weight, x, bias, out=out, pdl=pdl, scale=scale)
    if scale is not None:
        assert out is None, "quantized weights: no `out`"
        if weight.dtype in (torch.int8, torch.uint8) and x.is_cuda:  # one dequantizing pass, cuBLAS
            from flashstack.engine.kernels.triton_dequant import dequantize_triton

            return torch.nn.functional.linear(x, dequantize_triton(weight, scale, x.dtype), bias)
        return dequantized_linear(x, weight, scale, bias)
    if out is None:
        return torch.nn.functional.linear(x, weight, bias)
    torch.matmul(x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


def gemv_triton(
    weight: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = True,
    scale: torch.Tensor | None = None,
    half_products: bool | None = None,
    prescaled: bool = False,
    l2_prefetch_bytes: int = 0,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] in x's dtype (what F.linear returns).

    `norm=(weight, eps)`: multiply by RMSNorm(x) instead of x. `silu`: x is [1, 2K] and the product
    is taken with silu(x[:, :K]) * x[:, K:]. `residual` [1, N]: add the product into it in place and
    return it. `out` [1, N]: write the result there (residual added, if given) and return it.
    `config` overrides `gemv_config` (rows per program, K chunk, warps). `pdl`: programmatic
    dependent launch where the device has it (EngineConfig.kernels.pdl). `scale` [N] float32: the
    weight is float8_e4m3fn and row n of the product is multiplied by scale[n]; [N, K / 32]
    float16: the weight is int8 (Q8_0) and block j of row n by scale[n, j]; [N, K / 64 + K / 256]
    int32: the weight is Q4_K's values, uint8 [N, K / 2], and `scale` their scales' words (the chunk
    of `config` is then in bytes). `half_products`: fp8 products in float16 (default: for 16-bit
    activations) or in float32. `prescaled`: fp8 weights and x float16 already times 2^-8, as the
    float16 products take it (silu_and_mul_triton's `out_scale`), so that no program converts it;
    the result is then in `residual`'s or `out`'s dtype. `l2_prefetch_bytes`: a weight of at most
    this many bytes is asked of the L2 whole before the PDL wait
    (KernelOptions.gemv_l2_prefetch_bytes; `l2_prefetch_plan`). `pending` [1, K or N] float32: a
    fused MLP's sum not yet in the residual stream (kernels/triton_mlp.py), added where the stream
    is read: to x before `norm`, to `residual` before the product goes in."""
    n, kw = weight.shape
    q8, q4 = weight.dtype == torch.int8, weight.dtype == torch.uint8
    k = 2 * kw if q4 else kw
    assert not (norm and silu), "one input prologue per call"
    assert x.shape == (1, 2 * k if silu else k) and weight.stride(1) == 1 and x.stride(-1) == 1
    fused = "silu" if silu else "norm" if norm else "residual" if residual is not None else None
    if prescaled:
        assert scale is not None and weight.dtype == FP8 and x.dtype == torch.float16
        assert not (norm or silu) and (residual is not None or out is not None)
        fused = "prescaled"
    block_n, block_k, warps, *stages = config or gemv_config(
        n, k, fused, fp8=scale is not None, q4=q4
    )
    if q8:
        assert scale is not None and scale.shape == (n, k // 32) and scale.is_contiguous()
        assert k % 32 == 0 and block_k % 32 == 0, "Q8_0: rows and chunks of whole 32-weight blocks"
    elif q4:
        words = (n, k // 64 + k // 256)
        assert scale is not None and scale.shape == words and scale.dtype == torch.int32
        assert scale.is_contiguous() and k % 256 == 0 and block_k % 32 == 0, (
            "Q4_K: rows of whole 256-weight super-blocks, chunks of whole 64-weight groups"
        )
    elif scale is not None:
        assert scale.shape == (n,) and scale.dtype == torch.float32 and scale.is_contiguous()
    y_dtype = x.dtype
    if residual is not None:
        assert residual.shape == (1, n) and residual.is_contiguous()
        y_dtype = residual.dtype
    if out is not None:
        assert out.shape == (1, n) and out.is_contiguous()
        y_dtype = out.dtype
    assert y_dtype == x.dtype or prescaled, "the residual and `out` in x's dtype"
    y = (
        out
        if out is not None
        else residual
        if residual is not None
        else torch.empty(1, n, dtype=x.dtype, device=x.device)
    )
    if pending is not None:
        stream = residual if residual is not None else x
        assert (norm is not None) != (residual is not None), "pending: with `norm` or `residual`"
        assert pending.shape == stream.shape and pending.dtype == torch.float32
        assert pending.is_contiguous()
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    pdl = pdl_applies(x.device, pdl)
    if half_products is None:
        half_products = x.dtype != torch.float32
    half = scale is not None and half_products and not (q8 or q4)
    grid = triton.cdiv(n, block_n)
    pf_rows = 0
    if pdl and l2_prefetch_bytes:  # pdl: compiled for Hopper or later, where the prefetch exists
        pf_rows = l2_prefetch_plan(
            weight, grid, l2_prefetch_bytes, device_for(weight.device).sm_count
        )
    _gemv_kernel[(grid,)](
        weight,
        x,
        bias if bias is not None else y,
        y,
        residual if residual is not None else y,
        norm_weight,
        scale if scale is not None else y,
        n,
        k,
        kw,
        weight.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None and not (q8 or q4),
        NORM_IN=norm is not None,
        SILU_IN=silu,
        ADD_OUT=residual is not None,
        USE_PDL=pdl,
        HALF=half,
        Q8=q8,
        Q4=q4,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages[0] if stages else 0,
        PRESCALED=prescaled,
        PREFETCH_L2=pf_rows > 0,
        pf_rows=pf_rows,
        pf_row_bytes=weight.stride(0) * weight.element_size(),
        p_ptr=pending if pending is not None else y,
        PENDING=pending is not None,
        num_warps=warps,
        launch_pdl=pdl,
    )
    return y


def l2_prefetch_plan(weight: torch.Tensor, programs: int, max_bytes: int, sm_count: int) -> int:
    """Rows each of the first programs asks the L2 for before its PDL wait (0: none): a weight of
    at most `max_bytes`, contiguous and 16-byte aligned in 16-byte rows (the bulk prefetch's
    unit), spread over at most one program an SM, the ones resident while the kernel before
    still runs."""
    nbytes = weight.numel() * weight.element_size()
    row_bytes = weight.stride(0) * weight.element_size()
    aligned = weight.data_ptr() % 16 == 0 and row_bytes % 16 == 0
    if not 0 < nbytes <= max_bytes or not weight.is_contiguous() or not aligned:
        return 0
    return triton.cdiv(weight.shape[0], min(programs, sm_count))
