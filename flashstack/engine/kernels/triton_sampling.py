"""Sampling at temperature by inverse CDF, in two small kernels; greedy rows by a fused argmax.

softmax(logits / T) is sampled by drawing u ~ U(0, 1) and taking the first index whose cumulative
probability passes u. The first kernel gives every slice of a row (CHUNK entries) its maximum,
its first argmax and its sum of exp((x - max) / T) in one read of the (bf16) logits; the second,
one program a row, weighs the slices' sums to the row's maximum, draws u, finds the slice the
cumulative sum crosses u in and scans only that slice. One exponential per entry and one random
number per row, where the Gumbel-max trick draws a Philox number and two logarithms per entry and
is bound by them, not by its reads (200 rows of a 152K vocabulary on the H200: 24.8 µs against
118.9 µs, docs/benchmarks.md, "Sampler").

A row at temperature 0 takes its first maximum, so greedy and sampled rows share a call; an
all-greedy batch (`argmax_triton`) takes the same two kernels without the sums. torch's argmax
gives one program a row: one 128K-entry row (plus its fp32 copy of the logits) measured 30 µs per
batch-1 step on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Entries of a row one program of the inverse-CDF sampler reads: the second kernel scans one such
# slice in registers (32 values a thread on 4 warps).
_CHUNK = 4096
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _inverse_temperature(temp_ptr, row):
    # 1 / T, and 0 for a greedy row (T = 0). int64 temperatures are float32 bit patterns: a decode
    # graph stages them among its integer inputs (engine/cuda_graphs.py).
    t = tl.load(temp_ptr + row)
    if temp_ptr.dtype.element_ty == tl.int64:
        t = t.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(t > 0.0, 1.0 / tl.maximum(t, 1e-30), 0.0)


@triton.jit
def _slice_softmax_kernel(
    logits_ptr,
    temp_ptr,
    max_ptr,
    arg_ptr,
    sum_ptr,
    stride_row,
    vocab,
    num_chunks,
    GREEDY: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab, other=float("-inf")
    ).to(tl.float32)
    top = tl.max(x, 0)
    arg = tl.min(tl.where(x == top, cols, vocab), 0)  # the slice's first maximum
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, top)
    tl.store(arg_ptr + out, arg)
    if not GREEDY:
        scale = _inverse_temperature(temp_ptr, row) * _LOG2E
        if scale > 0.0:  # a greedy row of a sampled batch reads no sums
            # A slice of -inf only: its sum is 0 (exp2 of -inf), never NaN from -inf - -inf.
            total = tl.sum(tl.exp2((x - tl.where(top == float("-inf"), 0.0, top)) * scale), 0)
            tl.store(sum_ptr + out, total)


@triton.jit
def _pick_kernel(
    logits_ptr,
    temp_ptr,
    max_ptr,
    arg_ptr,
    sum_ptr,
    token_ptr,
    stride_row,
    vocab,
    num_chunks,
    seed,
    ring_ptr,
    seq_ptr,
    ring_stride,
    GREEDY: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    RING_SLOTS: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = 0.0 if GREEDY else _inverse_temperature(temp_ptr, row)
    scale = inv_t * _LOG2E
    c = tl.arange(0, CHUNKS)
    live = c < num_chunks
    tops = tl.load(max_ptr + row * num_chunks + c, mask=live, other=float("-inf"))
    best = tl.max(tops, 0)
    if inv_t == 0.0:  # greedy: the first slice holding the maximum has the row's first maximum
        args = tl.load(arg_ptr + row * num_chunks + c, mask=live, other=vocab)
        token = tl.min(tl.where(tops == best, args, vocab), 0)
    else:
        ref = tl.where(best == float("-inf"), 0.0, best)
        sums = tl.load(sum_ptr + row * num_chunks + c, mask=live, other=0.0)
        # each slice's mass relative to the row's maximum
        mass = tl.where(tops == float("-inf"), 0.0, sums * tl.exp2((tops - ref) * scale))
        # a decode graph's seed is one of its staged inputs, read when the graph replays
        key = tl.load(seed) if seed.dtype.is_ptr() else seed
        target = tl.rand(key, row) * tl.sum(mass, 0)
        cum = tl.cumsum(mass, 0)
        # the first slice whose cumulative mass passes the target; rounding may carry the target
        # past the last slice with mass, which then takes it
        pick = tl.minimum(
            tl.sum((cum <= target).to(tl.int32), 0), tl.max(tl.where(mass > 0, c, 0), 0)
        )
        rest = target - tl.sum(tl.where(c < pick, mass, 0.0), 0)
        cols = pick * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(
            logits_ptr + row.to(tl.int64) * stride_row + cols,
            mask=cols < vocab,
            other=float("-inf"),
        ).to(tl.float32)
        p = tl.exp2((x - ref) * scale)
        hit = tl.min(tl.where(tl.cumsum(p, 0) > rest, cols, vocab), 0)
        # the slice's sum, recomputed here, may fall a rounding short of `rest`: its last
        # possible entry then
        token = tl.where(hit < vocab, hit, tl.max(tl.where(p > 0, cols, 0), 0))
    tl.store(token_ptr + row, token.to(tl.int64))
    if RING_SLOTS:  # and into the host's row of this step, over the bus
        slot = tl.load(seq_ptr) % RING_SLOTS
        tl.store(ring_ptr + slot * ring_stride + row, token.to(tl.int64))


def sample_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed: int | torch.Tensor,
    chunk: int = _CHUNK,
    out: torch.Tensor | None = None,
    host_ring: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [n, vocab] (any float dtype), drawn from softmax(logits / T)
    with T = `temperatures` [n] (0: the row's first maximum; int64: float32 bit patterns); `seed`
    picks the draws (a one-element int64 device tensor: read when the kernel runs, as a CUDA
    graph replays it). Returns int64 [n] on the device (`out` when given). `chunk`: entries a
    program reads (a power of two). `host_ring` (rows [slots, width] int64 in pinned host memory,
    seq: an int64 device tensor): the tokens also go to row seq[0] % slots, read when the kernel
    runs (a decode graph's step number: engine/input_ring.py)."""
    if temperatures.dtype != torch.int64:
        temperatures = temperatures.float()
    return _launch(logits, temperatures.contiguous(), seed, chunk, out, host_ring)


def argmax_triton(
    logits: torch.Tensor,
    out: torch.Tensor | None = None,
    host_ring: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each row's first maximum, as torch.argmax(logits, -1) gives it (int64 [n], on the device;
    `out` when given; `host_ring` as `sample_triton`'s)."""
    return _launch(logits, None, 0, _CHUNK, out, host_ring)


def _launch(
    logits: torch.Tensor,
    temps: torch.Tensor | None,
    seed: int | torch.Tensor,
    chunk: int,
    out: torch.Tensor | None = None,
    host_ring: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    # temps None: every row greedy, no temperatures read and no sums taken
    n, vocab = logits.shape
    assert logits.stride(1) == 1
    chunk = min(chunk, max(16, triton.next_power_of_2(vocab)))
    num_chunks = triton.cdiv(vocab, chunk)
    tops = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    args = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device) if out is None else out
    assert tokens.shape == (n,) and tokens.dtype == torch.int64 and tokens.is_contiguous()
    greedy = temps is None
    # a greedy launch reads no temperatures and writes no sums: any tensor fills those slots
    sums = tops if greedy else torch.empty_like(tops)
    temps = tops if greedy else temps
    warps = max(1, min(8, chunk // 1024))
    common = (logits.stride(0), vocab, num_chunks)
    ring_slots, ring_args = 0, (tokens, tokens, 0)  # no ring: any tensors fill the slots
    if host_ring is not None:
        rows, seq = host_ring
        assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.shape[1] >= n
        ring_slots, ring_args = rows.shape[0], (rows, seq, rows.shape[1])
    _slice_softmax_kernel[(n, num_chunks)](
        logits, temps, tops, args, sums, *common, GREEDY=greedy, CHUNK=chunk, num_warps=warps
    )
    _pick_kernel[(n,)](
        logits,
        temps,
        tops,
        args,
        sums,
        tokens,
        *common,
        seed,
        *ring_args,
        GREEDY=greedy,
        CHUNK=chunk,
        CHUNKS=max(2, triton.next_power_of_2(num_chunks)),
        RING_SLOTS=ring_slots,
        num_warps=warps,
    )
    return tokens
