"""Batch-1 MLP in one kernel: RMSNorm, gate/up, SiLU-and-mul and down
(KernelOptions.fused_mlp).

A small model's batch-1 layer is six dependent kernels, each costing a few microseconds whatever
it reads (docs/benchmarks.md, "Engine small-model profile"). Here the gate/up and down GEMVs are
one: each program owns a slice of the intermediate units, takes their gate and up rows against the
normed input, and multiplies silu(gate) * up by the same units' columns of the down weight. That
gives a partial sum over its units for every output, which it adds into a float32 row by atomics.
Both weights' first bytes load before the PDL wait; the down slice is held in registers through
the gate/up loop.

The float32 row is not yet the residual stream: its sum, rounded to the activations' dtype as the
down GEMV's output would be, is added by whoever reads the stream next (the q/k/v GEMV's RMSNorm
prologue and the o GEMV's residual epilogue: `pending` in kernels/triton_gemv.py; the final
RMSNorm). Rounding matches the unfused kernels up to the order of the down product's float32
sums, which the atomics leave to the hardware.

Off by default: on the H100 it took SmolLM2-135M's step from 443 to 506 µs and the Qwen3-0.6B
shape's from 874 to 897 µs (docs/benchmarks.md, "Engine small-model profile").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel
from flashstack.engine.kernels.triton_activations import silu_mul
from flashstack.engine.kernels.triton_gemv import input_chunk, row_rstd

# Largest down slice (hidden size, padded to a power of two, times the units a program owns) held
# in registers through the gate/up loop: 8K values, 32 a thread at eight warps. A hidden size of
# 2,048 (8 units) took 162 registers, one program an SM; larger slices spilled (sm_90, Triton 3.6).
MAX_HELD_DOWN = 1 << 13


@triton.jit
def _mlp_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    d_ptr,
    acc_ptr,
    H,
    N_UNITS,
    stride_w,
    stride_d,
    eps,
    USE_PDL: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STAGES: tl.constexpr,
):
    # x [H]: the residual stream; g [H]: the norm's weight; w [2 N_UNITS, H]: gate rows, up rows;
    # d [H, N_UNITS]: down; acc [H] float32: where the partial sums go
    units = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    umask = units < N_UNITS
    gate_rows = w_ptr + units[:, None].to(tl.int64) * stride_w
    up_rows = gate_rows + N_UNITS * stride_w
    cols = tl.arange(0, BLOCK_K)
    wmask = umask[:, None] & (cols < H)[None, :]
    # weights depend on nothing earlier in the stream: in flight while the kernel before finishes
    wg = tl.load(gate_rows + cols[None, :], mask=wmask, other=0.0)
    wu = tl.load(up_rows + cols[None, :], mask=wmask, other=0.0)
    hrows = tl.arange(0, BLOCK_H)
    hmask = hrows < H
    wd = tl.load(
        d_ptr + hrows[:, None].to(tl.int64) * stride_d + units[None, :],
        mask=hmask[:, None] & umask[None, :],
        other=0.0,
    )
    wait_for_previous_kernel(USE_PDL)  # the residual stream is the previous kernel's output
    act_dtype = x_ptr.dtype.element_ty
    rstd = row_rstd(x_ptr, H, eps, BLOCK_K)
    x = input_chunk(x_ptr, g_ptr, cols, cols < H, H, rstd, act_dtype, True, False)
    # each chunk summed as it comes: a [units, chunk] float32 accumulator per weight would not
    # fit beside the held down slice
    acc_g = tl.sum(wg.to(tl.float32) * x[None, :], 1)
    acc_u = tl.sum(wu.to(tl.float32) * x[None, :], 1)
    for k in tl.range(BLOCK_K, H, BLOCK_K, num_stages=STAGES):
        kcols = k + cols
        kmask = umask[:, None] & (kcols < H)[None, :]
        wg = tl.load(gate_rows + kcols[None, :], mask=kmask, other=0.0)
        wu = tl.load(up_rows + kcols[None, :], mask=kmask, other=0.0)
        x = input_chunk(x_ptr, g_ptr, kcols, kcols < H, H, rstd, act_dtype, True, False)
        acc_g += tl.sum(wg.to(tl.float32) * x[None, :], 1)
        acc_u += tl.sum(wu.to(tl.float32) * x[None, :], 1)
    # gate and up rounded as the gate/up GEMV's output, SiLU-and-mul as its kernel rounds
    gate = acc_g.to(act_dtype).to(tl.float32)
    up = acc_u.to(act_dtype)
    a = tl.where(umask, silu_mul(gate, up).to(tl.float32), 0.0)
    part = tl.sum(wd.to(tl.float32) * a[None, :], 1)
    tl.atomic_add(acc_ptr + hrows, part, mask=hmask, sem="relaxed")


def mlp_config(hidden: int, intermediate: int) -> tuple[int, int, int, int]:
    """(units per program, gate/up K chunk, warps, stages) for a model's MLP. Compiled for sm_90
    (Triton 3.6), a hidden size of 1,024: 8 units in 256-wide chunks on 8 warps take 80
    registers, three programs an SM; 16 units spilled at every chunk and warp count, and wider
    chunks took 158-255 registers (each chunk's float32 products live at once)."""
    return 8, min(256, triton.next_power_of_2(hidden)), 8, 2


def fused_mlp_applies(hidden: int, weight: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether fused_mlp_triton takes this MLP: 16- or 32-bit weights (quantized ones keep their
    GEMVs), the down slice within MAX_HELD_DOWN."""
    units = mlp_config(hidden, down.shape[1])[0]
    return (
        weight.dtype == down.dtype
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and triton.next_power_of_2(hidden) * units <= MAX_HELD_DOWN
    )


def fused_mlp_triton(
    x: torch.Tensor,
    norm: tuple[torch.Tensor, float],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    acc: torch.Tensor,
    pdl: bool = True,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Adds down(silu(gate) * up) of RMSNorm(x) [1, H] into `acc` [1, H] float32 (zeroed by the
    caller) and returns it. `gate_up` [2I, H]: gate's rows then up's; `down` [H, I]. `pdl`:
    programmatic dependent launch where the device has it. `config` overrides `mlp_config`."""
    hidden = x.shape[-1]
    inter = down.shape[1]
    assert x.shape == (1, hidden) and x.is_contiguous()
    assert gate_up.shape == (2 * inter, hidden) and gate_up.stride(1) == 1
    assert down.shape == (hidden, inter) and down.stride(1) == 1
    assert acc.shape == (1, hidden) and acc.dtype == torch.float32 and acc.is_contiguous()
    units, block_k, warps, stages = config or mlp_config(hidden, inter)
    norm_weight, eps = norm
    pdl = pdl_applies(x.device, pdl)
    _mlp_kernel[(triton.cdiv(inter, units),)](
        x,
        norm_weight,
        gate_up,
        down,
        acc,
        hidden,
        inter,
        gate_up.stride(0),
        down.stride(0),
        eps,
        USE_PDL=pdl,
        BLOCK_U=units,
        BLOCK_K=block_k,
        BLOCK_H=triton.next_power_of_2(hidden),
        STAGES=stages,
        num_warps=warps,
        launch_pdl=pdl,
    )
    return acc
