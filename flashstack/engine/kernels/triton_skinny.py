"""Skinny GEMM: y = x W^T (+ b) for a few activation rows (M = 2..128) against an nn.Linear weight
[N, K], the multi-row decode step's projections.

At these shapes a projection is still a weight stream: M rows of activations (a few hundred KB,
from L2) against tens of MB of weights read once. cuBLAS reads the Llama-3-8B q/k/v and o weights
at 2.5-3.3 TB/s here. Each program owns BLOCK_N output columns (weight rows) for all M rows and
streams its K-slice of those weight rows in BLOCK_K chunks, unmasked and coalesced, through shared
memory
(Triton's software pipeliner, STAGES - 1 chunks ahead). The product is taken swapped, W-tile @
x-tile^T, so the tensor cores' wide side is the weight's N and the narrow side the M rows (padded
to 16).

Where N / BLOCK_N programs are few and their rows long (down: 64 programs over K = 14336), the K
range is split in two: each slice writes its float32 partial sums and a second kernel adds the
slices in order, so the result does not depend on which finishes first. For q/k/v and o
(K = 4096) the split and its second kernel measured slower than one pass. A product whose output
only feeds an RMSNorm (down, into the next layer's norm) can leave the slices to that norm
(`SplitK`, kernels/triton_elementwise.py), which adds them in the same order: no second kernel.

Against cuBLAS on the H200 (docs/benchmarks.md, "Skinny GEMM"), at 8 to 32 rows: 0.91-0.95x its
time on o and lm_head, 0.94-1.01x on q/k/v, 0.98-0.99x on down, 1.01-1.02x on gate/up; at 64 rows
faster on gate/up, down and lm_head only, and at 128 slower everywhere, so past 32 rows q/k/v and o
stay on cuBLAS and past 64 rows everything does (`skinny_applies`). In the 8B decode step: batch 8
4.951 -> 4.840 ms, batch 32 5.505 -> 5.311 ms. A small model's weights take it from 2 to 32 rows
(KernelOptions.skinny_small_weights); a weight with few outputs (a small model's o and down) then
spreads the rows over 16-row tiles (`row_tile`), a program per (column tile, row tile), as its
column tiles alone would leave most SMs idle.

Q8_0 weights (int8 with a float16 scale per 32 weights: engine/quantization.py) are dequantized
chunk by chunk into the activations' dtype, in registers, before the tensor-core product: the
weight stream is 1.0625 bytes a weight instead of 2. Q4_K's (0.5625 bytes a weight) likewise, each
chunk's low and high nibbles as two halves, each with the inputs it holds (kernels/triton_q4k.py).

fp8 weights (float8_e4m3fn, a float32 scale per row) are not converted at all: the activations are
quantized to e4m3 first, one scale per row (`_quantize_activations_kernel`; the plain-torch form is
quantization.fp8_activations_linear), the chunks go to the fp8 tensor cores as they are, and the
sums take the weight's row scales and the activations' at the end (W8A8, as vLLM's fp8 on Hopper):
8B decode step on the H200 at batch 8 / 32 / 128 1.38 / 1.33 / 1.22x faster than bf16. Per-row
scales, not per 64 values: one scale per group of a chunk meant a product and a scaled add per
group, 1.3-4.5x slower at 32 to 128 rows, for no better agreement on the trained SmolLM2; and
quantizing inside the loop (a maximum across threads per chunk in every program) measured 1.4-2x
slower than the separate pass. With `fp8_activations=False` each fp8 chunk is widened to the
activations' dtype in registers instead (W8A16), as Q8_0's: 0.76-0.86x bf16's speed.

A gate/up product can return silu(gate) * up instead (`gated`): each program's tile is the gate
rows and the up rows of the same columns, and the epilogue rounds both sums as the product would
store them and applies the SiLU-and-mul kernel's arithmetic (kernels/triton_activations.py), so
the down projection reads the activation and no SiLU-and-mul kernel runs (KernelOptions.
gate_up_swiglu). 8B decode step on the H100: batch 8 / 32 0.8 / 1.3 % faster.

One launch configuration per shape (`skinny_config`), so a step captured in a CUDA graph replays
the same kernels; nothing reads back to the host. Launched with programmatic dependent launch
where the device has it (kernels/pdl.py): the launch overlaps the previous kernel's drain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashstack.cuda.torch_interop import device_for
from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel
from flashstack.engine.kernels.triton_activations import silu_mul
from flashstack.engine.kernels.triton_attention import fp8_e4m3
from flashstack.engine.kernels.triton_q4k import dequantize_chunk
from flashstack.engine.quantization import FP8, FP8_ACT_MAX_ROWS, FP8_MAX

E4M3_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _dequantize_q8(w, s_ptr, w_rows, k, K, dtype, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One int8 weight chunk [BLOCK_N, BLOCK_K] times its blocks' float16 scales, in `dtype`.
    blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(
        s_ptr + w_rows[:, None].to(tl.int64) * (K // 32) + blocks[None, :],
        mask=(blocks < K // 32)[None, :],
        other=0.0,
    )
    w = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * s.to(tl.float32)[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(dtype)


@triton.jit
def _q4k_slice(
    x_ptr,
    w_ptr,
    s_ptr,
    w_rows,
    x_rows,
    k0,
    k_end,
    K,
    stride_x,
    stride_w,
    acc,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # Q4_K: each chunk's BLOCK_K / 2 bytes dequantized in registers to two halves, the low and the
    # high nibbles, each multiplied with the inputs it holds (x's columns gathered to match).
    # Chunks are whole 64-weight groups, so one mask serves the bytes and both halves' inputs.
    kb = tl.arange(0, BLOCK_K // 2)
    x_cols = kb // 32 * 64 + kb % 32
    w_ptrs = w_ptr + w_rows[:, None].to(tl.int64) * stride_w + (k0 // 2 + kb)[None, :]
    x_ptrs = x_ptr + x_rows[None, :].to(tl.int64) * stride_x + (k0 + x_cols)[:, None]
    for k in tl.range(k0, k_end, BLOCK_K, num_stages=STAGES):
        kmask = k + x_cols < k_end
        w = tl.load(w_ptrs, mask=kmask[None, :], other=0)
        x_lo = tl.load(x_ptrs, mask=kmask[:, None], other=0.0)
        x_hi = tl.load(x_ptrs + 32, mask=kmask[:, None], other=0.0)
        lo, hi = dequantize_chunk(w, s_ptr, w_rows, k, K, x_lo.dtype, BLOCK_N, BLOCK_K)
        if WIDEN:  # as in _skinny_kernel
            lo, hi = lo.to(tl.float32), hi.to(tl.float32)
            x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
        if IEEE:
            acc = tl.dot(lo, x_lo, acc, input_precision="ieee")
            acc = tl.dot(hi, x_hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(lo, x_lo, acc)
            acc = tl.dot(hi, x_hi, acc)
        w_ptrs += BLOCK_K // 2
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, USE_PDL: tl.constexpr, BLOCK: tl.constexpr
):
    # One row, whole in registers (one read from L2): its largest magnitude to 448, an all-zero
    # row scale 1.
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_MAX), 1.0)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, fp8_e4m3(tl.math.div_rn(x, scale)), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _store_gated(y_ptr, acc, pid_n, rows, M, n_out, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    # acc [2 * HALF, BLOCK_M]: gate's sums over its first half, up's over its second. Both rounded
    # to y's dtype as the gate/up product stores them, then the SiLU-and-mul kernel's arithmetic.
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
    dtype = y_ptr.dtype.element_ty
    act = silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype))
    cols = pid_n * HALF + tl.arange(0, HALF)
    mask = (rows < M)[None, :] & (cols < n_out)[:, None]
    tl.store(y_ptr + rows[None, :] * n_out + cols[:, None], act.to(dtype), mask=mask)


# M is not specialized: one compiled kernel serves every batch bucket of a row tile.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    s_ptr,
    xs_ptr,
    M,
    N,
    K,
    k_slice,
    stride_x,
    stride_w,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
    Q8: tl.constexpr,
    Q4: tl.constexpr,
    FP8: tl.constexpr,
    FP8_IN: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's row tile
    # Out-of-range columns and rows read the last valid one instead of masking: the weight stream
    # stays unmasked; their results are never stored.
    if GATED:  # the first half of the tile: gate's rows; the second: the same columns' up rows
        tile = tl.arange(0, BLOCK_N)
        cols = pid_n * (BLOCK_N // 2) + tile % (BLOCK_N // 2)
        w_rows = tl.minimum(cols, N // 2 - 1) + tile // (BLOCK_N // 2) * (N // 2)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = tl.minimum(cols, N - 1)
    x_rows = tl.minimum(rows, M - 1)
    # The epilogue's weights (fp8 row scales, bias) load before the wait and the activations'
    # scales right after it: at the end, each would add a memory latency to the program's tail.
    if FP8 or FP8_IN:
        w_scale = tl.load(s_ptr + w_rows)[:, None]
    if HAS_BIAS and not PARTIAL:
        bias = tl.load(b_ptr + w_rows).to(tl.float32)[:, None]
    wait_for_previous_kernel(USE_PDL)  # x is the previous kernel's output
    if FP8_IN:
        x_scale = tl.load(xs_ptr + x_rows)[None, :]
    k0 = pid_k * k_slice
    k_end = tl.minimum(k0 + k_slice, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if Q4:
        acc = _q4k_slice(
            x_ptr,
            w_ptr,
            s_ptr,
            w_rows,
            x_rows,
            k0,
            k_end,
            K,
            stride_x,
            stride_w,
            acc,
            IEEE,
            WIDEN,
            BLOCK_N,
            BLOCK_K,
            STAGES,
        )
    else:
        ks = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + w_rows[:, None].to(tl.int64) * stride_w + (k0 + ks)[None, :]
        x_ptrs = x_ptr + x_rows[None, :].to(tl.int64) * stride_x + (k0 + ks)[:, None]
        for k in tl.range(k0, k_end, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                kmask = k + ks < k_end
                w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=kmask[:, None], other=0.0)
            if Q8:
                w = _dequantize_q8(w, s_ptr, w_rows, k, K, x.dtype, BLOCK_N, BLOCK_K)
            if FP8 and not FP8_IN:  # e4m3 is exact in 16 bits: the row scales come at the end
                w = w.to(x.dtype)
            # Triton's CPU interpreter multiplies bf16 wrongly; bf16 products are exact in fp32.
            if WIDEN:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            if IEEE:  # float32 activations: full precision, not tf32
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if FP8_IN:  # e4m3 x e4m3 on the tensor cores; each slice's share times both scales
        acc *= w_scale * x_scale
    elif FP8:
        acc *= w_scale
    out = (rows < M)[None, :] & (cols < N)[:, None]
    if PARTIAL:  # y_ptr is the float32 [SPLIT_K, M, N] workspace
        tl.store(y_ptr + pid_k * M * N + rows[None, :] * N + cols[:, None], acc, mask=out)
    else:
        if HAS_BIAS:
            acc += bias
        if GATED:  # y [M, N / 2] = silu(gate) * up, rounded as the unfused kernels round them
            _store_gated(y_ptr, acc, pid_n, rows, M, N // 2, BLOCK_M, BLOCK_N // 2)
        else:
            tl.store(
                y_ptr + rows[None, :] * N + cols[:, None],
                acc.to(y_ptr.dtype.element_ty),
                mask=out,
            )


@triton.jit(do_not_specialize=["total"])
def _split_sum_kernel(
    p_ptr,
    b_ptr,
    y_ptr,
    N,
    total,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The K slices' partial sums added in slice order, then the bias, rounded once.
    wait_for_previous_kernel(USE_PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    acc = tl.load(p_ptr + idx, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * total + idx, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + idx % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + idx, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Where the skinny GEMM measured at least as fast as cuBLAS on the H200 (the Llama-3-8B shapes): up
# to 64 rows for the larger weights (gate/up, down, lm_head), up to 32 for q/k/v and o. Too few
# programs to spread over the 132 SMs: cuBLAS. Weights smaller than o's: SMALL_MODEL_ROWS below.
MAX_ROWS = 64
SMALL_WEIGHT_ROWS = 32
LARGE_WEIGHT = 32 * 1024 * 1024  # elements: above q/k/v's 6144 x 4096, below down's 4096 x 14336
MIN_WEIGHT = 16 * 1024 * 1024  # o's 4096 x 4096
MIN_PROGRAMS = 64  # o's 4096 rows over 64 per program


# Q8_0, Q4_K and fp8 weights take the skinny GEMM at every decode batch: cuBLAS would need them
# dequantized first.
BLOCKS_MAX_ROWS = FP8_ACT_MAX_ROWS


# A small model's weights (under MIN_WEIGHT: SmolLM2-135M's, the Qwen3-0.6B shape's, the
# Llama-3.2-1B shape's q/k/v and o) take it from 2 to 32 rows (KernelOptions.skinny_small_weights):
# on the H100, in graphs of calls launched with PDL, 0.1-1.1 µs (1-26 %) under cuBLAS's 3-7.6 µs
# on every such shape (docs/benchmarks.md, "Skinny GEMM"), and in a decode step far more, as
# cuBLAS launches without PDL (SmolLM2-135M's step at batch 8 953 -> 691 µs). Those of at most
# ROW_TILED_MAX_N outputs spread the rows over ROW_TILE-row tiles, as their few column tiles alone
# leave most SMs idle.
SMALL_MODEL_ROWS = 32
ROW_TILED_MAX_N = 2048
ROW_TILE = 16


def skinny_applies(
    rows: int, n: int, k: int, blocks: bool = False, small_weights: bool = False
) -> bool:
    """Whether a product of `rows` activation rows with an [n, k] weight takes the skinny GEMM (one
    row takes the GEMV). `blocks`: Q8_0, Q4_K or fp8 weights, up to BLOCKS_MAX_ROWS rows whatever
    the weight's size. `small_weights`: a weight under MIN_WEIGHT takes it up to SMALL_MODEL_ROWS
    rows (else cuBLAS)."""
    if blocks:
        return 2 <= rows <= BLOCKS_MAX_ROWS
    size = n * k
    if size < MIN_WEIGHT:
        return small_weights and 2 <= rows <= SMALL_MODEL_ROWS
    if not 2 <= rows <= (MAX_ROWS if size >= LARGE_WEIGHT else SMALL_WEIGHT_ROWS):
        return False
    block_n, _, split, _, _ = skinny_config(rows, n, k)
    return triton.cdiv(n, block_n) * split >= MIN_PROGRAMS


def row_tile(m: int, n: int, k: int) -> int:
    """Activation rows per program of a 16-bit product: all M (padded to the tensor cores' 16), or
    ROW_TILE-row tiles for a small model's weight of at most ROW_TILED_MAX_N outputs."""
    if n * k < MIN_WEIGHT and n <= ROW_TILED_MAX_N:
        return ROW_TILE
    return block_m(m)


def gated_fits(rows: int, n: int, k: int, act8: bool = False) -> bool:
    """Whether a gate/up product the skinny GEMM takes (`skinny_applies`), of `rows` rows with an
    [n, k] weight (gate's n / 2 rows, then up's), can return silu(gate) * up from its epilogue
    (`skinny_linear(gated=True)`): its sums whole in one K slice. `act8`: its activations are
    quantized to fp8 (W8A8)."""
    return n % 2 == 0 and (fp8_skinny_config if act8 else skinny_config)(rows, n, k)[2] == 1


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` converts and multiplies e4m3 in Triton, on its tensor cores (compute
    capability 8.9 and later; Triton's interpreter emulates them)."""
    if triton.knobs.runtime.interpret:
        return True
    return device.type == "cuda" and device_for(device).compute_capability >= (8, 9)


def block_m(m: int) -> int:
    """The row tile: M padded to a power of two, at least the tensor cores' 16."""
    return max(16, triton.next_power_of_2(m))


def skinny_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) for an [m, k] x [n, k]^T product, the best of the
    H200 sweep (bench/engine_skinny.py) on the Llama-3-8B shapes at 8 to 64 rows: very many weight
    rows (gate/up, lm_head) 128 per program in 128-wide chunks on 8 warps; the rest 64 per program
    in 256-wide chunks (128-wide past 32 rows); long rows (down) split in two; four stages. A small
    model's rows shorter than 1,024 (SmolLM2's 576) take 128-wide chunks: 0.6-0.8 µs faster on the
    H100 than 256-wide ones, whose third chunk is mostly masked."""
    if n >= 16384:
        return 128, 128, 1, 8, 4
    if n * k < MIN_WEIGHT and k < 1024:
        return 64, 128, 1, 4, 4
    return 64, 256 if block_m(m) <= 32 else 128, 2 if k > 8192 else 1, 4, 4


def fp8_skinny_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """`skinny_config` for fp8 weights and activations, the best of the H200 sweep on the Llama-3-8B
    shapes at 8 to 128 rows (docs/benchmarks.md, "fp8 weights"): very many weight rows (gate/up)
    128 per program in 128-wide chunks on 8 warps; the rest 64 per program in 256-wide chunks, six
    stages, four at 64 rows, and at 128 rows 128-wide chunks, or long rows (down) split in two."""
    bm = block_m(m)
    if n >= 16384:
        return 128, 128, 1, 8, 4 if bm <= 32 else 3
    if bm <= 32:
        return 64, 256, 1, 4, 6
    if bm <= 64:
        return 64, 256, 1, 4, 6 if k > 8192 else 4
    return (64, 256, 2, 4, 4) if k > 8192 else (64, 128, 1, 4, 6)


def _plan(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    has_bias: bool,
    config: tuple[int, ...] | None,
    pdl: bool = False,
    weight_dtype: torch.dtype | None = None,
    fp8_activations: bool = True,
    gated: bool = False,
) -> tuple[tuple[int, int, int], int, dict]:
    """(grid: column tiles x K slices x row tiles, K slice, constexprs and launch options) of
    `_skinny_kernel` for one product."""
    fp8 = weight_dtype == FP8
    act8 = fp8 and fp8_activations
    # fp8 weights with 16-bit activations: tiles as small as bf16's, bf16's configurations
    block_n, block_k, split, warps, stages = config or (
        fp8_skinny_config(m, n, k) if act8 else skinny_config(m, n, k)
    )
    if config is None and dtype == torch.float32 and not act8:
        # The 16-bit configurations' tiles at 4 bytes a value overflow shared memory (227 KB on
        # the H200): half the chunk, three stages. Not swept: float32 is the oracles' dtype.
        block_k, stages = block_k // 2, min(stages, 3)
    k_slice = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_slice)
    # the nonlinearity needs whole sums: one K slice; a tile's halves pair gate with up
    assert not gated or (split == 1 and n % 2 == 0 and block_n % 2 == 0)
    meta = dict(
        HAS_BIAS=has_bias,
        PARTIAL=split > 1,
        EVEN_K=k % k_slice == 0,
        IEEE=dtype == torch.float32 and not act8,
        WIDEN=triton.knobs.runtime.interpret and dtype == torch.bfloat16,
        Q8=weight_dtype == torch.int8,
        Q4=weight_dtype == torch.uint8,
        FP8=fp8,
        FP8_IN=act8,
        GATED=gated,
        USE_PDL=pdl,
        BLOCK_M=row_tile(m, n, k) if weight_dtype is None else block_m(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        num_warps=warps,
    )
    # gated as well: each column tile is n / 2's output columns, half a tile of them
    return (triton.cdiv(n, block_n), split, triton.cdiv(m, meta["BLOCK_M"])), k_slice, meta


def compile_skinny(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    config: tuple[int, ...] | None = None,
    pdl: bool = True,
    weight_dtype: torch.dtype | None = None,
    fp8_activations: bool = True,
) -> None:
    """Compile the kernel `skinny_linear` would launch for this product, without launching it (a
    benchmark compiles its sweep in parallel processes: Triton caches the result on disk).
    `weight_dtype`: fp8 weights (Q8_0 and Q4_K are not compiled here)."""
    grid, k_slice, meta = _plan(m, n, k, dtype, False, config, pdl, weight_dtype, fp8_activations)
    fp8 = weight_dtype == FP8
    _skinny_kernel.warmup(
        FP8 if meta["FP8_IN"] else dtype,
        FP8 if fp8 else dtype,
        dtype,
        torch.float32 if grid[1] > 1 else dtype,
        torch.float32 if fp8 else dtype,
        torch.float32 if meta["FP8_IN"] else dtype,  # the activations' scales, or a stand-in
        m,
        n,
        k,
        k_slice,
        k,
        k,
        grid=grid,
        **meta,
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    pdl: bool = True,
    scale: torch.Tensor | None = None,
    fp8_activations: bool = True,
    keep_slices: bool = False,
    gated: bool = False,
) -> torch.Tensor | SplitK:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] in x's dtype (what F.linear returns), with
    fp32 accumulation. `config` overrides `skinny_config`. `pdl`: programmatic dependent launch
    where the device has it (EngineConfig.kernels.pdl). `scale` [N, K / 32] float16: the weight
    is Q8_0's int8; [N, K / 64 + K / 256] int32: the weight is Q4_K's values [N, K / 2] and
    `scale` their scales' words; [N] float32: the weight is fp8 with those row scales, and x is
    quantized to fp8 first (W8A8: quantization.fp8_activations_linear), or with
    `fp8_activations` False each weight chunk is widened to x's dtype (W8A16). `keep_slices`: a
    product split along K (no bias) returns its slices unsummed (`SplitK`), for a norm to add.
    `gated`: the weight is a gate/up projection's (gate's N / 2 rows, then up's), and the result
    is silu(gate) * up [M, N / 2], taken in the epilogue: each program streams the gate and up
    rows of the same columns (no SiLU-and-mul kernel after it)."""
    m, k = x.shape
    n = weight.shape[0]
    q4, fp8 = weight.dtype == torch.uint8, weight.dtype == FP8
    assert weight.shape[1] == (k // 2 if q4 else k)
    assert weight.stride(1) == 1 and x.stride(1) == 1
    xs = None
    if fp8:
        assert scale is not None and scale.shape == (n,) and scale.dtype == torch.float32
    elif q4:
        assert scale is not None and scale.shape == (n, k // 64 + k // 256) and k % 256 == 0
    elif scale is not None:
        assert weight.dtype == torch.int8 and scale.shape == (n, k // 32)
    else:
        assert weight.dtype == x.dtype, "skinny GEMM: weights in the activations' dtype"
    assert scale is None or scale.is_contiguous()
    pdl = pdl_applies(x.device, pdl)
    blocks = weight.dtype if scale is not None else None
    grid, k_slice, meta = _plan(
        m, n, k, x.dtype, bias is not None, config, pdl, blocks, fp8_activations, gated
    )
    # whole Q8_0 blocks per chunk; Q4_K: whole 64-weight groups
    assert blocks not in (torch.int8, torch.uint8) or meta["BLOCK_K"] % (64 if q4 else 32) == 0
    y = torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    if meta["FP8_IN"]:
        x, xs = quantize_activations_triton(x, pdl)
    split = grid[1]
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else None
    _skinny_kernel[grid](
        x,
        weight,
        bias if bias is not None else y,
        partial if partial is not None else y,
        scale if scale is not None else y,
        xs if xs is not None else y,
        m,
        n,
        k,
        k_slice,
        x.stride(0),
        weight.stride(0),
        **meta,
        launch_pdl=pdl,
    )
    if partial is None:
        return y
    if keep_slices and bias is None:
        return SplitK(partial, y.dtype)
    return _split_sum(partial, bias, y, pdl)


def _split_sum(
    partial: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, pdl: bool
) -> torch.Tensor:
    # y = the K slices' partial sums [S, M, N] added in order (+ bias), rounded once
    split, m, n = partial.shape
    block = 1024
    _split_sum_kernel[(triton.cdiv(m * n, block),)](
        partial,
        bias if bias is not None else y,
        y,
        n,
        m * n,
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        SPLIT_K=split,
        BLOCK=block,
        launch_pdl=pdl,
    )
    return y


@dataclass(frozen=True, slots=True)
class SplitK:
    """A product's float32 partial sums, one [M, N] slice per K slice, not yet added: the sum
    rounded to `dtype` is the product (`skinny_linear(keep_slices=True)`)."""

    slices: torch.Tensor  # [S, M, N] float32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.slices.shape[1:]

    def summed(self) -> torch.Tensor:
        """The product, the slices added in order as the reducing kernel adds them."""
        y = torch.empty(self.shape, dtype=self.dtype, device=self.slices.device)
        return _split_sum(self.slices, None, y, pdl=False)


def quantize_activations_triton(
    x: torch.Tensor, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantization.quantize_activations on the device: (x [M, K] in float8_e4m3fn, float32 scales
    [M]), bit for bit."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_activations_kernel[(m,)](
        x,
        q,
        scales,
        k,
        x.stride(0),
        USE_PDL=pdl,
        BLOCK=block,
        num_warps=min(16, max(4, block // 1024)),
        launch_pdl=pdl,
    )
    return q, scales
