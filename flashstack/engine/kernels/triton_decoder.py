"""A batch-1 decode step's decoder layers in one persistent kernel.

On a small model every layer of a batch-1 step is six short kernels whose cost is their fixed
latency, not their bytes: launch, ramp-up, a wait for the previous kernel to drain, a tail (2-5 µs
each where the bytes take 0.2-1 µs; docs/benchmarks.md, "Engine small-model profile"). Here the
layers run as one grid of programs that stay resident and walk one list of work items, in order:
per layer the q/k/v rows (RMSNorm folded in), the attention splits (q/k-norm, rotary and the new
K/V store folded in), the o rows (the splits' merge and the residual add folded in), the gate/up
rows (RMSNorm) and the down rows (SiLU-and-mul, the residual add). An item waits only for the
count of finished items of the stage it reads, and loads its first weight chunk before it waits, so
the weights stream while the stage before finishes.

Items are taken in list order, each after every item of the stages it waits for: a program that
waits waits for items already taken by running programs, so the walk cannot deadlock. With one
program per SM every program is resident at once (any kernel fits one block an SM), and programs
take items round-robin (item = program + k * programs); with more, from an atomic counter, which
needs no program to be resident before another finishes.

An SM's L1 is not coherent with other SMs' writes, so every buffer a step writes is written
once, in whole 128-byte lines: each layer has its own line-padded slices of q/k/v, the partials and
gate/up, and the residual stream a row for each of its states. No SM can hold a stale copy of a
value, however a load is compiled (Triton's pipeliner turns loads of under 16 bytes into
L1-allocating `cp.async.ca`), and no line holds values of two layers. An item's count is raised
with release semantics after a barrier of its block, and read with acquire semantics.

The residual stream in tagged words (DecoderLaunch.tagged) needs no counts: each value travels in a
64-bit word beside the step's epoch, written by one store, and its readers (the q/k/v and gate/up
items, a whole row; the o and down items, their rows) load the words until every one carries the
epoch, as NCCL's low-latency protocol does, then read them once more (a word held in two threads
is checked in one). The o and down items release nothing. The last program out of a run zeroes
the counts and the work queue for the next step and moves the epoch on.

Rounds where the batch-1 ops round (models/ops.py, Batch1Ops): the same hidden states to the
accumulation order. Batch1Ops checks each decoder's first run against the layers one by one and
drops one that stalls or disagrees (`disagreement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import nn

from flashstack.engine.kernels.triton_attention import (
    attend_new_token,
    merged_splits,
    rotated_heads,
    rotated_key,
    splits_of,
)
from flashstack.engine.kernels.triton_gemv import input_chunk, row_rstd
from flashstack.engine.models.parallel import RowParallelLinear

if TYPE_CHECKING:
    from flashstack.engine.models.llama import ModelArgs

# A layer's stages, in the order of the work list, each with a count of finished items per layer.
_QKV, _ATTENTION, _O, _GATE_UP, _DOWN = (tl.constexpr(i) for i in range(5))
_LAYER_STAGES = tl.constexpr(5)
# after the layers' counts: the work queue's, the programs that have left, the step's epoch, and
# the waits that gave up; _EXITS and _EPOCH are offsets from the queue's
_EXITS, _EPOCH = tl.constexpr(1), tl.constexpr(2)
# A layer's tensors in the table (int64 addresses), in this order: its weights, then its KV cache.
FIELDS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o",
    "post_norm",
    "gate_up",
    "down",
    "kv_cache",
)
_INPUT_NORM, _QKV_W, _QKV_B, _Q_NORM, _K_NORM, _O_W, _POST_NORM, _GATE_UP_W, _DOWN_W, _KV = (
    tl.constexpr(i) for i in range(len(FIELDS))
)
_TABLE_WIDTH = tl.constexpr(len(FIELDS))
# Weight elements a program multiplies per chunk (rows * chunk; 32 a thread at 4 warps), and how
# many stages deep its chunks after the first stream through shared memory (stages - 1 chunks in
# flight beside the one being multiplied): at batch 1 a program needs ~32 KB in flight for its
# share of the bandwidth. Defaults of `plan_launch`, not yet measured.
ACC_ELEMENTS = 4096
PIPELINE_STAGES = 4
# Splits of each KV head's context (a short context fills only some, SPLIT_TOKENS each): the o
# rows merge every split of every head, so at most this many by default
MAX_SPLITS = 8
MAX_ITEM_ROWS = 64  # a projection item's most rows
SPLIT_TOKENS = 64  # attention tile, and the fewest tokens a split reads
# polls of a count before a wait gives up (~seconds; a wait's usual few polls take ~1 µs each)
_MAX_SPINS = tl.constexpr(1 << 22)
# an item's input prologue
_NORM, _SILU, _MERGE, _NORM_TAGGED = (tl.constexpr(i) for i in range(4))
# Pipeline stages of the o rows: their input is every split's partial and log-sum-exp, 8 bytes a
# column a split (64 at eight splits) against a weight row's 2, so chunks further ahead fill shared
# memory (three stages took Llama-3.2-1B's to 120 KB a program)
_MERGE_STAGES = tl.constexpr(2)
_SPLIT_TOKENS = tl.constexpr(SPLIT_TOKENS)
_LINE_BYTES = 128  # an L1 line: the unit the decoder's buffers are padded to
_TRACE_WIDTH = tl.constexpr(4)  # a traced item: start, end of its wait, end, program


@triton.jit
def _now():
    # the GPU's global nanosecond clock (the same on every SM)
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _finish(count_ptr):
    # The item's writes first, then its count: every thread's stores ordered before the count by
    # the block's barrier, and released to the GPU with it (one thread's release after a barrier,
    # as CUTLASS's semaphores do); a reader that acquires the count sees the writes.
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _wait(count_ptr, target, stall_ptr, waited_ptr, TRACE: tl.constexpr):
    # Until `target` items have finished. Bounded: a wait that never ends (a bug) counts a stall
    # and goes on, so the kernel ends with wrong numbers and `PersistentDecoder.stalls` says so,
    # rather than holding the GPU for good. TRACE: when it ended, at `waited_ptr`.
    done = tl.atomic_add(count_ptr, 0, sem="acquire")
    spins = 0
    while (done < target) & (spins < _MAX_SPINS):
        done = tl.atomic_add(count_ptr, 0, sem="acquire")
        spins += 1
    if done < target:
        tl.atomic_add(stall_ptr, 1)
    if TRACE:
        tl.store(waited_ptr, _now())


@triton.jit
def _tag(values, epoch):
    # values as tagged words: their float32 bits below, the step's epoch above
    bits = values.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return bits | (epoch.to(tl.int64) << 32)


@triton.jit
def _value(words):
    # the float32 values of tagged words
    return (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _late(words, mask, epoch):
    # how many of the words (where `mask`) do not carry this step's epoch yet
    return tl.sum((((words >> 32).to(tl.int32) != epoch) & mask).to(tl.int32), 0)


@triton.jit
def _tagged(ptrs, mask, epoch, stall_ptr, waited_ptr, TRACE: tl.constexpr):
    # The values of the tagged words at `ptrs` once every one (where `mask`) carries this step's
    # epoch. Each word holds its value and its flag, written by one store, so a reader polls the
    # data itself (NCCL's low-latency protocol): no count released after a barrier by the writer.
    # Bounded as _wait is.
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    late = _late(words, mask, epoch)
    spins = 0
    while (late > 0) & (spins < _MAX_SPINS):
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        late = _late(words, mask, epoch)
        spins += 1
    if late > 0:
        tl.atomic_add(stall_ptr, 1)
    # Read once more, now that they are all there: a word a tensor holds in several threads (its
    # layout replicated) was checked in one of them only, and another copy may still be an older
    # step's (the GPU gave wrong tokens without this; Triton's interpreter cannot show it).
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    if TRACE:
        tl.store(waited_ptr, _now())
    return _value(words)


@triton.jit
def _address(entry, field: tl.constexpr, like):
    # A layer's tensor from the table, as a pointer of `like`'s type, 16-byte aligned (checked when
    # the table is made): without that no load from it is vectorized.
    return tl.multiple_of(tl.load(entry + field).to(like.dtype, bitcast=True), 16)


@triton.constexpr_function
def _tile(rows):
    # an item's rows, padded to the power of two its tile takes
    return triton.next_power_of_2(rows)


@triton.jit
def _rows_of(unit, N, K, w_ptr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    # A unit's ROWS rows of a weight [N, K], and its first chunk: loaded before any wait.
    TILE: tl.constexpr = _tile(ROWS)
    r = tl.arange(0, TILE)
    rows = unit * ROWS + r
    rmask = (r < ROWS) & (rows < N)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & (cols < K)[None, :], other=0.0)
    return rows, rmask, w_rows, w


@triton.jit
def _input(x_ptr, g_ptr, lse_ptr, kcols, K, rstd, active, act, PROLOGUE: tl.constexpr, NQ, D, S):
    # the activations one weight chunk multiplies: RMSNorm(x) (of tagged words: _NORM_TAGGED, the
    # row already seen whole), silu(gate) * up, or the merged attention output (x_ptr then holds
    # the splits' partials)
    cmask = kcols < K
    if PROLOGUE == _MERGE:
        # split-major partials [S, NQ * D]: each split's slice of the chunk is one contiguous load
        x = merged_splits(x_ptr, lse_ptr, kcols, cmask, active, S, D, NQ * D, D, NQ, 1, act)
    elif PROLOGUE == _NORM_TAGGED:  # rounds as input_chunk's RMSNorm does
        xf = _value(tl.load(x_ptr + kcols, mask=cmask, other=0))
        g = tl.load(g_ptr + kcols, mask=cmask, other=0.0)
        x = (g * (xf * rstd).to(act)).to(act).to(tl.float32)
    else:
        norm: tl.constexpr = PROLOGUE == _NORM
        silu: tl.constexpr = PROLOGUE == _SILU
        x = input_chunk(x_ptr, g_ptr, kcols, cmask, K, rstd, act, norm, silu)
    return x


@triton.jit
def _stream(
    w,
    w_rows,
    rmask,
    x_ptr,
    g_ptr,
    lse_ptr,
    K,
    rstd,
    active,
    act,
    PROLOGUE: tl.constexpr,
    NQ: tl.constexpr,
    D: tl.constexpr,
    S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # sum over K of W[rows] * input: the first chunk `w` (loaded before the wait), then the rest
    # through shared memory, STAGES - 1 chunks ahead (Triton's pipeliner), as kernels/
    # triton_gemv.py streams long rows
    cols = tl.arange(0, BLOCK_K)
    x = _input(x_ptr, g_ptr, lse_ptr, cols, K, rstd, active, act, PROLOGUE, NQ, D, S)
    acc = w.to(tl.float32) * x[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        kcols = k + cols
        w = tl.load(w_rows + kcols[None, :], mask=rmask[:, None] & (kcols < K)[None, :], other=0.0)
        x = _input(x_ptr, g_ptr, lse_ptr, kcols, K, rstd, active, act, PROLOGUE, NQ, D, S)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _norm_rows(
    unit,
    w_ptr,
    b_ptr,
    g_ptr,
    x_ptr,
    y_ptr,
    eps,
    count_ptr,
    target,
    stall_ptr,
    waited_ptr,
    epoch,
    N,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    TRACE: tl.constexpr,
    TAGGED: tl.constexpr,
):
    # y[rows] = W[rows] @ RMSNorm(x) (+ b): the q/k/v and gate/up items. TAGGED: x is a tagged row
    # of the residual stream, read once all of it is there (no count to wait for).
    rows, rmask, w_rows, w = _rows_of(unit, N, K, w_ptr, ROWS, BLOCK_K)
    act = y_ptr.dtype.element_ty
    if K <= BLOCK_K:
        # One chunk: x read once for its mean square and the product (one L2 round trip, not
        # two), the norm's weight before the wait. Rounds as input_chunk does.
        cols = tl.arange(0, BLOCK_K)
        cmask = cols < K
        g = tl.load(g_ptr + cols, mask=cmask, other=0.0)
        if TAGGED:
            xf = _tagged(x_ptr + cols, cmask, epoch, stall_ptr, waited_ptr, TRACE)
        else:
            _wait(count_ptr, target, stall_ptr, waited_ptr, TRACE)
            xf = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        x = (g * (xf * rstd).to(act)).to(act).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    elif TAGGED:
        # the whole row seen at once for its mean square, then streamed again chunk by chunk
        full = tl.arange(0, _tile(K))
        xf = _tagged(x_ptr + full, full < K, epoch, stall_ptr, waited_ptr, TRACE)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        y = _stream(
            w,
            w_rows,
            rmask,
            x_ptr,
            g_ptr,
            x_ptr,
            K,
            rstd,
            0,
            act,
            _NORM_TAGGED,
            1,
            1,
            1,
            BLOCK_K,
            STAGES,
        )
    else:
        _wait(count_ptr, target, stall_ptr, waited_ptr, TRACE)
        rstd = row_rstd(x_ptr, K, eps, BLOCK_K)
        y = _stream(
            w, w_rows, rmask, x_ptr, g_ptr, x_ptr, K, rstd, 0, act, _NORM, 1, 1, 1, BLOCK_K, STAGES
        )
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(act), mask=rmask)


@triton.jit
def _down_rows(
    unit,
    w_ptr,
    gu_ptr,
    x_ptr,
    out_ptr,
    count_ptr,
    target,
    stall_ptr,
    waited_ptr,
    epoch,
    final_ptr,
    last,
    N: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    TRACE: tl.constexpr,
    TAGGED: tl.constexpr,
):
    # out[rows] = x[rows] + W[rows] @ (silu(gate) * up): the down items (`last` layer's: also
    # into final_ptr, plain, when TAGGED)
    rows, rmask, w_rows, w = _rows_of(unit, N, K, w_ptr, ROWS, BLOCK_K)
    _wait(count_ptr, target, stall_ptr, waited_ptr, TRACE)
    old = _residual_rows(x_ptr, rows, rmask, epoch, stall_ptr, TAGGED)
    act = gu_ptr.dtype.element_ty
    y = _stream(
        w, w_rows, rmask, gu_ptr, gu_ptr, gu_ptr, K, 1.0, 0, act, _SILU, 1, 1, 1, BLOCK_K, STAGES
    )
    new = _add_into(out_ptr, rows, rmask, y, old, act, epoch, TAGGED)
    if TAGGED:
        tl.store(final_ptr + rows, new, mask=rmask & last)


@triton.jit
def _residual_rows(x_ptr, rows, rmask, epoch, stall_ptr, TAGGED: tl.constexpr):
    # x[rows] of the residual stream (tagged words when TAGGED), read right after the item's wait:
    # in flight with its first chunk's input rather than after its last product
    if TAGGED:
        return _tagged(x_ptr + rows, rmask, epoch, stall_ptr, stall_ptr, False)
    return tl.load(x_ptr + rows, mask=rmask, other=0.0).to(tl.float32)


@triton.jit
def _add_into(out_ptr, rows, rmask, y, old, act, epoch, TAGGED: tl.constexpr):
    # out[rows] = old + y (_residual_rows), the projection rounded first, as `proj(x) + residual`
    # rounds; in tagged words when TAGGED
    new = (y.to(act).to(tl.float32) + old).to(act)
    if TAGGED:
        tl.store(out_ptr + rows, _tag(new, epoch), mask=rmask)
    else:
        tl.store(out_ptr + rows, new, mask=rmask)
    return new


@triton.jit
def _o_rows(
    unit,
    w_ptr,
    part_ptr,
    lse_ptr,
    x_ptr,
    out_ptr,
    ctx,
    count_ptr,
    target,
    stall_ptr,
    waited_ptr,
    epoch,
    N: tl.constexpr,
    NQ: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    TRACE: tl.constexpr,
    TAGGED: tl.constexpr,
):
    # out[rows] = x[rows] + W[rows] @ attention: the o items, merging the splits as they read them
    K: tl.constexpr = NQ * D
    rows, rmask, w_rows, w = _rows_of(unit, N, K, w_ptr, ROWS, BLOCK_K)
    _wait(count_ptr, target, stall_ptr, waited_ptr, TRACE)
    old = _residual_rows(x_ptr, rows, rmask, epoch, stall_ptr, TAGGED)
    _, active = splits_of(ctx, _SPLIT_TOKENS, S, _SPLIT_TOKENS)
    act = w_ptr.dtype.element_ty
    y = _stream(
        w,
        w_rows,
        rmask,
        part_ptr,
        part_ptr,
        lse_ptr,
        K,
        1.0,
        active,
        act,
        _MERGE,
        NQ,
        D,
        S,
        BLOCK_K,
        _MERGE_STAGES,
    )
    _add_into(out_ptr, rows, rmask, y, old, act, epoch, TAGGED)


@triton.jit
def _tile_blocks(blocks_ptr, start, hi, block_size):
    # the block-table entries of tokens start .. start + SPLIT_TOKENS (those before hi)
    n = start + tl.arange(0, _SPLIT_TOKENS)
    return tl.load(blocks_ptr + n // block_size, mask=n < hi, other=0)


@triton.jit
def _kv_tile(
    cache_ptr,
    blk,
    start,
    hi,
    hkv,
    d,
    block_size,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
):
    # K and V of tokens start .. start + SPLIT_TOKENS (those before hi) of one KV head, in blocks
    # `blk` (_tile_blocks), and which tokens they are
    n = start + tl.arange(0, _SPLIT_TOKENS)
    nmask = n < hi
    row = blk.to(tl.int64) * stride_cb + (n % block_size) * stride_cs + hkv * stride_ch
    k = tl.load(cache_ptr + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
    v = tl.load(cache_ptr + stride_ckv + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
    return k, v, nmask


@triton.jit
def _attend_tile(q, k, v, nmask, m, row_sum, acc, PREC: tl.constexpr):
    # one tile's online-softmax update of the running maximum, sum and output
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, row_sum, acc


@triton.jit
def _attention_split(
    unit,
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cache_ptr,
    part_ptr,
    lse_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    blocks_ptr,
    ctx,
    scale,
    eps,
    block_size,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    count_ptr,
    target,
    stall_ptr,
    waited_ptr,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    S: tl.constexpr,
    G_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
    PREC: tl.constexpr,
    TRACE: tl.constexpr,
):
    # One KV head's split of the context: its query heads' partial output and log-sum-exp, the new
    # token's k/v rotated and attended from registers, and stored by the split that owns its slot
    # (kernels/triton_attention.py's decode kernel with NewTokens, at batch 1).
    G: tl.constexpr = NQ // NKV
    hkv = unit // S
    split = unit % S
    d = tl.arange(0, D)
    g = tl.arange(0, G_PAD)
    gmask = g < G
    heads = hkv * G + g
    cos = tl.load(cos_ptr + d % (D // 2)).to(tl.float32)
    sin = tl.load(sin_ptr + d % (D // 2)).to(tl.float32)
    tokens_per_split, active = splits_of(ctx, _SPLIT_TOKENS, S, _SPLIT_TOKENS)
    lo = split * tokens_per_split
    last = tl.maximum(ctx, 1) - 1
    hi = tl.minimum(tl.minimum(lo + tokens_per_split, ctx), last)
    owner = split == last // tokens_per_split
    # The first tile of cached K and V depends on nothing this step computes: loaded before the
    # wait, as the projections' first weight chunks are; so are the next tile's block-table
    # entries, and each tile's loads the entries of the one after, so that a tile's K and V wait
    # for one memory latency, not two.
    k0, v0, mask0 = _kv_tile(
        cache_ptr,
        _tile_blocks(blocks_ptr, lo, hi, block_size),
        lo,
        hi,
        hkv,
        d,
        block_size,
        stride_cb,
        stride_ckv,
        stride_cs,
        stride_ch,
    )
    blk = _tile_blocks(blocks_ptr, lo + _SPLIT_TOKENS, hi, block_size)
    _wait(count_ptr, target, stall_ptr, waited_ptr, TRACE)
    act = qkv_ptr.dtype.element_ty
    q = rotated_heads(
        qkv_ptr + heads[:, None] * D, gmask[:, None], d, cos, sin, qw_ptr, eps, D, QK_NORM
    ).to(act)
    k_new = rotated_key(qkv_ptr + (NQ + hkv) * D, d, cos, sin, kw_ptr, eps, D, QK_NORM)
    v_new = tl.load(qkv_ptr + (NQ + NKV + hkv) * D + d[None, :])
    kv = cache_ptr.dtype.element_ty
    slot = tl.load(slot_ptr)
    if owner & (slot >= 0):
        row = (slot // block_size).to(tl.int64) * stride_cb + (slot % block_size) * stride_cs
        row += hkv * stride_ch
        tl.store(cache_ptr + row + d[None, :], k_new.to(kv))
        tl.store(cache_ptr + stride_ckv + row + d[None, :], v_new.to(kv))
    q = (q * scale).to(kv)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if lo < hi:  # a split past the context reads nothing
        m, row_sum, acc = _attend_tile(q, k0, v0, mask0, m, row_sum, acc, PREC)
    for start in range(lo + _SPLIT_TOKENS, hi, _SPLIT_TOKENS):
        k, v, nmask = _kv_tile(
            cache_ptr,
            blk,
            start,
            hi,
            hkv,
            d,
            block_size,
            stride_cb,
            stride_ckv,
            stride_cs,
            stride_ch,
        )
        blk = _tile_blocks(blocks_ptr, start + _SPLIT_TOKENS, hi, block_size)
        m, row_sum, acc = _attend_tile(q, k, v, nmask, m, row_sum, acc, PREC)
    if owner:
        m, row_sum, acc = attend_new_token(q, k_new.to(kv), v_new.to(kv), m, row_sum, acc, 1.0, kv)
    if split < active:
        has = row_sum > 0
        out = acc / tl.where(has, row_sum, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, row_sum, 1.0)), float("-inf"))
        at = split * NQ + heads  # split-major (merged_splits)
        tl.store(part_ptr + at[:, None] * D + d[None, :], out, mask=gmask[:, None])
        tl.store(lse_ptr + at, lse, mask=gmask)


@triton.jit
def _decoder_kernel(
    table_ptr,
    h_ptr,
    x_ptr,
    final_ptr,
    qkv_ptr,
    part_ptr,
    lse_ptr,
    gu_ptr,
    count_ptr,
    queue_ptr,
    stalls_ptr,
    trace_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    blocks_ptr,
    ctx_ptr,
    num_layers,
    dynamic,
    stride_x,
    stride_qkv,
    stride_part,
    stride_lse,
    stride_gu,
    eps,
    scale,
    block_size,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    H: tl.constexpr,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    INTER: tl.constexpr,
    S: tl.constexpr,
    G_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PREC: tl.constexpr,
    ROWS_QKV: tl.constexpr,
    K_QKV: tl.constexpr,
    ROWS_O: tl.constexpr,
    K_O: tl.constexpr,
    ROWS_GU: tl.constexpr,
    K_GU: tl.constexpr,
    ROWS_DOWN: tl.constexpr,
    K_DOWN: tl.constexpr,
    STAGES: tl.constexpr,
    TRACE: tl.constexpr,
    TAGGED: tl.constexpr,
):
    QKV_N: tl.constexpr = (NQ + 2 * NKV) * D
    N_QKV: tl.constexpr = (QKV_N + ROWS_QKV - 1) // ROWS_QKV
    N_ATT: tl.constexpr = NKV * S
    N_O: tl.constexpr = (H + ROWS_O - 1) // ROWS_O
    N_GU: tl.constexpr = (2 * INTER + ROWS_GU - 1) // ROWS_GU
    N_DOWN: tl.constexpr = (H + ROWS_DOWN - 1) // ROWS_DOWN
    PER_LAYER: tl.constexpr = N_QKV + N_ATT + N_O + N_GU + N_DOWN
    total = num_layers * PER_LAYER
    ctx = tl.load(ctx_ptr)  # a step input, written before the kernel
    # this step's tag for the residual stream's words (TAGGED): one more than the last step's,
    # which the last program out of that step's kernel wrote
    epoch = tl.load(queue_ptr + _EPOCH) + 1
    # `dynamic` (the same binary either way, so that its occupancy is known before round-robin)
    if dynamic:
        item = tl.atomic_add(queue_ptr, 1)
    else:
        item = tl.program_id(0)
    while item < total:
        # the trace's row of this item: start, end of its wait, end, program
        waited = trace_ptr + item * _TRACE_WIDTH + 1
        if TRACE:  # when the item starts: before its first weight chunk and its wait
            started = _now()
        layer = item // PER_LAYER
        r = item % PER_LAYER
        entry = table_ptr + layer * _TABLE_WIDTH
        counts = count_ptr + layer * _LAYER_STAGES
        # Every buffer a step writes is written once, in whole lines: each layer has its own
        # slices, and the residual stream a row for each of its states after o and after down
        # (the first layer's input: the embedding row, read only), each padded to 128 bytes. No
        # SM can then hold a stale copy of a value in its L1, whichever way a load is compiled.
        if TAGGED:  # row 0: the embedding row, tagged by the program of item 0
            x_in = x_ptr + (2 * layer) * stride_x
            x_mid = x_in + stride_x
            if item == 0:
                hc = tl.arange(0, _tile(H))
                e = tl.load(h_ptr + hc, mask=hc < H, other=0.0)
                tl.store(x_in + hc, _tag(e, epoch), mask=hc < H)
        else:
            x_mid = x_ptr + (2 * layer) * stride_x
            x_in = tl.where(layer == 0, h_ptr, x_mid - stride_x)
        x_out = x_mid + stride_x
        qkv = qkv_ptr + layer * stride_qkv
        part = part_ptr + layer * stride_part
        lse = lse_ptr + layer * stride_lse
        gu = gu_ptr + layer * stride_gu
        if r < N_QKV:
            # the layer before's down rows, all of them (layer 0: none, its input is the embedding)
            before = count_ptr + tl.maximum(layer - 1, 0) * _LAYER_STAGES + _DOWN
            _norm_rows(
                r,
                _address(entry, _QKV_W, qkv_ptr),
                _address(entry, _QKV_B, qkv_ptr),
                _address(entry, _INPUT_NORM, qkv_ptr),
                x_in,
                qkv,
                eps,
                before,
                tl.where(layer > 0, N_DOWN, 0),
                stalls_ptr,
                waited,
                epoch,
                QKV_N,
                H,
                HAS_BIAS,
                ROWS_QKV,
                K_QKV,
                STAGES,
                TRACE,
                TAGGED,
            )
            _finish(counts + _QKV)
        elif r < N_QKV + N_ATT:
            _attention_split(
                r - N_QKV,
                qkv,
                _address(entry, _Q_NORM, qkv_ptr),
                _address(entry, _K_NORM, qkv_ptr),
                _address(entry, _KV, qkv_ptr),
                part,
                lse,
                cos_ptr,
                sin_ptr,
                slot_ptr,
                blocks_ptr,
                ctx,
                scale,
                eps,
                block_size,
                stride_cb,
                stride_ckv,
                stride_cs,
                stride_ch,
                counts + _QKV,
                N_QKV,
                stalls_ptr,
                waited,
                NQ,
                NKV,
                D,
                S,
                G_PAD,
                QK_NORM,
                PREC,
                TRACE,
            )
            _finish(counts + _ATTENTION)
        elif r < N_QKV + N_ATT + N_O:
            _o_rows(
                r - N_QKV - N_ATT,
                _address(entry, _O_W, qkv_ptr),
                part,
                lse,
                x_in,
                x_mid,
                ctx,
                counts + _ATTENTION,
                N_ATT,
                stalls_ptr,
                waited,
                epoch,
                H,
                NQ,
                S,
                D,
                ROWS_O,
                K_O,
                STAGES,
                TRACE,
                TAGGED,
            )
            if not TAGGED:  # tagged, the rows are what gate/up and down wait for
                _finish(counts + _O)
        elif r < N_QKV + N_ATT + N_O + N_GU:
            _norm_rows(
                r - N_QKV - N_ATT - N_O,
                _address(entry, _GATE_UP_W, qkv_ptr),
                qkv_ptr,
                _address(entry, _POST_NORM, qkv_ptr),
                x_mid,
                gu,
                eps,
                counts + _O,
                N_O,
                stalls_ptr,
                waited,
                epoch,
                2 * INTER,
                H,
                False,
                ROWS_GU,
                K_GU,
                STAGES,
                TRACE,
                TAGGED,
            )
            _finish(counts + _GATE_UP)
        else:
            _down_rows(
                r - N_QKV - N_ATT - N_O - N_GU,
                _address(entry, _DOWN_W, qkv_ptr),
                gu,
                x_mid,
                x_out,
                counts + _GATE_UP,
                N_GU,
                stalls_ptr,
                waited,
                epoch,
                final_ptr,
                layer == num_layers - 1,
                H,
                INTER,
                ROWS_DOWN,
                K_DOWN,
                STAGES,
                TRACE,
                TAGGED,
            )
            if not TAGGED:
                _finish(counts + _DOWN)
        if TRACE:  # (PersistentDecoder.run's `trace`)
            tl.store(waited - 1, started)
            tl.store(waited + 1, _now())
            tl.store(waited + 2, tl.program_id(0).to(tl.int64))
        if dynamic:
            item = tl.atomic_add(queue_ptr, 1)
        else:
            item += tl.num_programs(0)
    # The last program out readies the counts for the next step (no memset before each launch)
    # and hands on the epoch: every other program has left, none reads them any more.
    gone = tl.atomic_add(queue_ptr + _EXITS, 1, sem="acq_rel")
    if gone == tl.num_programs(0) - 1:
        stages = num_layers * _LAYER_STAGES
        for start in range(0, stages, 256):
            c = start + tl.arange(0, 256)
            tl.store(count_ptr + c, tl.zeros([256], tl.int32), mask=c < stages)
        tl.store(queue_ptr, 0)
        tl.store(queue_ptr + _EXITS, 0)
        tl.store(queue_ptr + _EPOCH, epoch)


@dataclass(frozen=True, slots=True)
class DecoderLaunch:
    """How the persistent decoder is launched: its grid, the rows and chunk of each projection's
    items, and the splits of each KV head's context."""

    programs: int
    programs_per_sm: int
    splits: int
    rows: tuple[int, int, int, int]  # an item's rows: q/k/v, o, gate/up, down (any count)
    chunks: tuple[int, int, int, int]
    num_warps: int = 4
    stages: int = PIPELINE_STAGES
    # the residual stream in tagged words, read once they are there (_tagged), instead of after
    # the counts of o's and down's items (KernelOptions.persistent_decoder_tagged)
    tagged: bool = False


def _rows_and_chunk(n: int, k: int, programs: int, acc: int) -> tuple[int, int]:
    # Rows an item: as few rounds of items over the programs as MAX_ITEM_ROWS allows, the rows
    # spread evenly over them, so that every program has its share (rows in powers of two left up
    # to half the SMs without an item: Qwen3-0.6B's gate/up in 96 items of 64 rows on 132); and
    # about `acc` weights multiplied per chunk of the item's tile (its rows padded to a power of
    # two), a row of up to twice that in one chunk (SmolLM2's 576-wide rows: one 1,024-wide chunk,
    # not a second one of 64).
    rounds = triton.cdiv(n, MAX_ITEM_ROWS * programs)
    rows = max(2, triton.cdiv(n, rounds * programs))
    tile = triton.next_power_of_2(rows)
    whole = triton.next_power_of_2(k)
    if tile * whole <= 2 * acc:
        return rows, whole
    return rows, max(64, acc // tile)


def plan_launch(
    args: ModelArgs,
    sm_count: int,
    programs_per_sm: int = 1,
    num_warps: int = 4,
    stages: int = PIPELINE_STAGES,
    acc_elements: int = ACC_ELEMENTS,
    tagged: bool = False,
    splits: int = MAX_SPLITS,
) -> DecoderLaunch:
    """The launch of `programs_per_sm` programs on each of `sm_count` SMs for a model of these
    sizes (`stages`, `acc_elements`, `splits`: see PIPELINE_STAGES, ACC_ELEMENTS and MAX_SPLITS;
    `tagged`: see DecoderLaunch)."""
    programs = sm_count * programs_per_sm
    hidden, heads, kv_heads = args.hidden_size, args.num_heads, args.num_kv_heads
    head_dim, intermediate = args.head_dim, args.intermediate_size
    shapes = (
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    )
    picks = [_rows_and_chunk(n, k, programs, acc_elements) for n, k in shapes]
    return DecoderLaunch(
        programs,
        programs_per_sm,
        splits,
        tuple(r for r, _ in picks),  # type: ignore[arg-type]
        tuple(c for _, c in picks),  # type: ignore[arg-type]
        num_warps,
        stages,
        tagged,
    )


def unsupported(
    args: ModelArgs, layers: nn.ModuleList, kv_caches: list[torch.Tensor]
) -> str | None:
    """Why the persistent decoder cannot run these decoder layers (None: it can)."""
    a = args
    if a.head_dim & (a.head_dim - 1) or a.head_dim < 16:
        return f"head_dim {a.head_dim} is not a power of two of at least 16"
    if a.sliding_window:
        return "sliding-window attention"
    if a.quantization is not None:
        return f"{a.quantization} weights"
    if a.o_bias or a.mlp_bias:
        return "a bias on the o or MLP projections"
    layer = layers[0]
    dtype = layer.self_attn.qkv_proj.weight.dtype
    if any(c.dtype != dtype for c in kv_caches):
        return "a KV cache in another dtype than the weights (fp8)"
    if isinstance(layer.self_attn.o_proj, RowParallelLinear):
        return "tensor parallelism"
    for layer, cache in zip(layers, kv_caches):
        for t in _layer_tensors(layer, cache):
            if t is not None and (t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % 16):
                return "a weight in another dtype, not contiguous or not 16-byte aligned"
    return None


def _layer_tensors(layer: nn.Module, cache: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # a layer's row of the table, in FIELDS' order
    attn, mlp = layer.self_attn, layer.mlp
    norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    return (
        layer.input_layernorm.weight,
        attn.qkv_proj.weight,
        attn.qkv_proj.bias,
        *norms,
        attn.o_proj.weight,
        layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.weight,
        mlp.down_proj.weight,
        cache,
    )


class PersistentDecoder:
    """The decoder layers of one model over its KV caches (`unsupported` says None), for batch-1
    decode steps: `run` takes the embedding row and returns the residual stream after the last
    layer, before the final norm."""

    def __init__(
        self,
        args: ModelArgs,
        layers: nn.ModuleList,
        kv_caches: list[torch.Tensor],
        launch: DecoderLaunch,
    ) -> None:
        a = args
        device = kv_caches[0].device
        self.args, self.launch, self.num_layers = a, launch, len(layers)
        self.dtype = layers[0].self_attn.qkv_proj.weight.dtype
        self.table = torch.tensor(
            [self._addresses(layer, cache) for layer, cache in zip(layers, kv_caches)],
            dtype=torch.int64,
            device=device,
        )
        self.cache_strides = kv_caches[0].stride()[:4]
        self.block_size = kv_caches[0].shape[2]
        self.scale = layers[0].self_attn.scale
        dim, splits = a.head_dim, launch.splits
        # each layer's own slice of every buffer the kernel writes, in whole lines (see
        # _decoder_kernel)
        layers_n, f32 = self.num_layers, torch.float32

        def lines(rows: int, values: int, dtype: torch.dtype) -> torch.Tensor:
            per_line = _LINE_BYTES // dtype.itemsize
            return torch.zeros(rows, -(-values // per_line) * per_line, dtype=dtype, device=device)

        if launch.tagged:  # the embedding row tagged, then each layer's two states, as words
            self.residual = lines(2 * layers_n + 1, a.hidden_size, torch.int64)
        else:
            self.residual = lines(2 * layers_n, a.hidden_size, self.dtype)
        self.final = lines(1, a.hidden_size, self.dtype)  # the last layer's state, tagged runs
        self.qkv = lines(layers_n, (a.num_heads + 2 * a.num_kv_heads) * dim, self.dtype)
        self.part = lines(layers_n, splits * a.num_heads * dim, f32)
        self.lse = lines(layers_n, splits * a.num_heads, f32)
        self.gate_up = lines(layers_n, 2 * a.intermediate_size, self.dtype)
        # the layers' counts of finished items, the work queue's, the programs that have left, the
        # step's epoch (_tagged) and the waits that gave up (_wait): the kernel's last program out
        # readies them for the next step, all but the last, which adds up
        self.counts = torch.zeros(self.num_layers * 5 + 4, dtype=torch.int32, device=device)
        # Round-robin needs every program resident at once: one an SM always is; more only once
        # the compiled kernel's registers and shared memory are known to fit (`run`).
        self.round_robin = launch.programs_per_sm == 1
        self.checked = False  # its first run compared with the layers one by one (Batch1Ops)
        compiled = device.type == "cuda" and not triton.knobs.runtime.interpret
        self._compiled = compiled
        self._options = {"num_warps": launch.num_warps}
        if compiled and launch.programs_per_sm > 1:  # registers for that many programs an SM
            self._options["maxnreg"] = _register_cap(launch.programs_per_sm, launch.num_warps)

    @staticmethod
    def _addresses(layer: nn.Module, cache: torch.Tensor) -> list[int]:
        tensors = _layer_tensors(layer, cache)
        assert len(tensors) == len(FIELDS)
        # an absent bias or norm is never read: any address fills its slot
        return [t.data_ptr() if t is not None else cache.data_ptr() for t in tensors]

    def run(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        eps: float,
        trace: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every decoder layer on one token: the residual stream [1, hidden] after the last layer,
        from `residual` (the embedding row). The result is the decoder's own memory, valid until
        its next run. `trace` (int64 [items, 4], `trace_items`; compiled GPUs only): each item's
        start, the end of its wait and its end on the GPU's nanosecond clock, and its program,
        for bench/engine_persistent.py's timeline."""
        traced = trace is not None
        assert not traced or (trace.shape == (self.trace_items(), 4) and self._compiled)
        a, launch = self.args, self.launch
        assert residual.shape == (1, a.hidden_size) and residual.dtype == self.dtype
        assert residual.is_contiguous() and block_table.stride(-1) == 1
        rows, chunks = launch.rows, launch.chunks
        kernel = _decoder_kernel[(launch.programs,)](
            self.table,
            residual,
            self.residual,
            self.final,
            self.qkv,
            self.part,
            self.lse,
            self.gate_up,
            self.counts,
            self.counts[-4:-3],
            self.counts[-1:],
            trace if traced else self.counts,
            cos,
            sin,
            slot_mapping,
            block_table,
            context_lens,
            self.num_layers,
            0 if self.round_robin else 1,
            *(t.stride(0) for t in (self.residual, self.qkv, self.part, self.lse, self.gate_up)),
            eps,
            self.scale,
            self.block_size,
            *self.cache_strides,
            H=a.hidden_size,
            NQ=a.num_heads,
            NKV=a.num_kv_heads,
            D=a.head_dim,
            INTER=a.intermediate_size,
            S=launch.splits,
            G_PAD=max(16, triton.next_power_of_2(a.num_heads // a.num_kv_heads)),
            QK_NORM=a.qk_norm,
            HAS_BIAS=a.qkv_bias,
            PREC="ieee" if self.dtype == torch.float32 else "tf32",
            ROWS_QKV=rows[0],
            K_QKV=chunks[0],
            ROWS_O=rows[1],
            K_O=chunks[1],
            ROWS_GU=rows[2],
            K_GU=chunks[2],
            ROWS_DOWN=rows[3],
            K_DOWN=chunks[3],
            STAGES=launch.stages,
            TRACE=traced,
            TAGGED=launch.tagged,
            **self._options,
        )
        if not self.round_robin and self._compiled:
            self.round_robin = self._all_resident(kernel, residual.device)
        last = self.final if launch.tagged else self.residual[-1:]
        return last[:, : a.hidden_size]

    def stage_items(self) -> tuple[int, int, int, int, int]:
        """Items of each stage of a layer, in the work list's order: q/k/v, attention, o,
        gate/up, down."""
        a, launch = self.args, self.launch
        rows = launch.rows
        return (
            -(-(a.num_heads + 2 * a.num_kv_heads) * a.head_dim // rows[0]),
            a.num_kv_heads * launch.splits,
            -(-a.hidden_size // rows[1]),
            -(-2 * a.intermediate_size // rows[2]),
            -(-a.hidden_size // rows[3]),
        )

    def trace_items(self) -> int:
        """Items of one run (all layers)."""
        return self.num_layers * sum(self.stage_items())

    def disagreement(self, out: torch.Tensor, want: torch.Tensor) -> str | None:
        """What is wrong with a run's `out` against the layer-by-layer ops' `want` (None: they
        agree to their different summation orders): stalled waits, or a difference past 5 % of
        the largest value. Reads the device."""
        stalls = self.stalls()
        if stalls:
            return f"gave up {stalls} wait(s)"
        err = float((out.float() - want.float()).abs().max())
        scale = float(want.float().abs().max())
        if not err <= 0.05 * scale + 1e-3:  # a NaN fails too
            return f"differs from the layer-by-layer ops by {err:.3g} (largest value {scale:.3g})"
        return None

    def stalls(self) -> int:
        """Waits that gave up since the decoder was made (0 unless it has a bug: its output is
        then wrong). Reads the device: it waits for the last run to finish."""
        return int(self.counts[-1].item())

    def _all_resident(self, kernel: triton.compiler.CompiledKernel, device: torch.device) -> bool:
        # the kernel just launched (from the atomic queue): may its programs take turns instead?
        from flashstack.cuda.torch_interop import device_for

        per_sm = device_for(device).resident_blocks(
            32 * self.launch.num_warps, kernel.n_regs, kernel.metadata.shared
        )
        return per_sm >= self.launch.programs_per_sm


def _register_cap(programs_per_sm: int, num_warps: int) -> int:
    # the most registers a thread may use for that many programs of num_warps on one SM (65,536
    # registers, handed out 256 a warp): a multiple of 8, at most 255
    per_thread = 65536 // (programs_per_sm * num_warps * 32)
    return min(255, per_thread // 8 * 8)
