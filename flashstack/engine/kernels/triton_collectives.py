"""One-shot all-reduce, all-gather and broadcast over peer memory (NVLink P2P) for a
tensor-parallel decode step.

Every rank maps every other rank's inbox (torch symmetric memory). Each rank writes its values
straight into its slot of every peer's *inbox*, then waits in its own inbox until every peer's
values have landed, sums them in rank order (every rank gets the same bits) or lays them side by
side, and resets its inbox. A value has arrived when its bits differ from the sentinel the inbox
is filled with (-0.0 for floats, the most negative integer for step inputs); senders write -0.0 as
+0.0, which sums the same. No flags and no barrier: a value is its own arrival signal, so a call
costs one NVLink write's one-way trip. Each program keeps a call counter; its parity picks one of
two inbox halves, so a fast rank's next call never writes over values a slow rank has not read yet
(it can only get two calls ahead of a slot after that slot's owner has sent, and so finished
reading, the call between).

The kernels wait for the GEMV that wrote the partials, then release the next GEMV at once
(programmatic dependent launch, kernels/pdl.py), so its launch and first weight chunk overlap the
exchange. A pull over a flag barrier and torch's `one_shot_all_reduce` measured slower and are gone
(docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashstack.engine.kernels.pdl import pdl_applies, wait_for_previous_kernel


@triton.jit
def _peer_shifts(
    staged_ptr, buffers, RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BYTES: tl.constexpr
):
    """Each rank's inbox as an offset (in values) from ours. The compiler knows our pointer's
    alignment, not that of an address loaded from memory; every inbox starts on a page, so stores
    through these offsets stay 16-byte vectors. The addresses were set at start-up:
    safe to read before waiting for the previous kernel."""
    own = tl.load(buffers + RANK)
    shifts = ()
    for r in tl.static_range(WORLD):
        shifts = shifts + (
            tl.multiple_of((tl.load(buffers + r) - own) // ELEM_BYTES, 16 // ELEM_BYTES),
        )
    return shifts


@triton.jit
def _gather_dest(offs, cols, WORLD: tl.constexpr, ONE_ROW: tl.constexpr):
    """Where value `offs` of a rank's [rows, cols] goes in [rows, WORLD * cols], less the rank's
    `r * cols`: (row i, column j) of rank r lands at (i, r * cols + j)."""
    return offs if ONE_ROW else (offs // cols) * (WORLD * cols) + offs % cols


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def sentinel(bits: torch.dtype) -> int:
    """The inbox's "nothing here yet": the most negative integer, -0.0 as a float's bits."""
    return torch.iinfo(bits).min


@dataclass(frozen=True, slots=True)
class Inbox:
    """This rank's side of a push exchange.

    `slots` is this rank's inbox, 2 halves x world_size senders x `region` values (sentinel-filled
    at rest), `addresses` every rank's inbox address (int64, rank order), `counters` one call count
    per program (int32, local). A call of n values runs cdiv(n, block) programs; program p always
    covers values [p * block, (p + 1) * block), so its counter tracks every use of its slots.
    """

    slots: torch.Tensor
    addresses: torch.Tensor
    counters: torch.Tensor
    region: int
    rank: int
    world_size: int
    block: int

    def check(self, numel: int) -> None:
        if numel > self.region:
            raise ValueError(f"{numel} values do not fit an inbox region of {self.region}")


@triton.jit
def _post(slots_ptr, shifts, slot, bits, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Write `bits` at `slot` of every peer's inbox."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            tl.store(slots_ptr + shifts[r] + slot, bits, mask=mask)


@triton.jit
def _collect(slots_ptr, slot, mask, SENTINEL: tl.constexpr):
    """The values a peer posted at `slot` of our inbox, once every one has landed; the slot is left
    sentinel-filled for the call after next. Volatile loads: each poll reads L2, where NVLink
    writes land, never a stale L1 line."""
    bits = tl.load(slots_ptr + slot, mask=mask, other=0, volatile=True)
    while tl.max((bits == SENTINEL).to(tl.int32), axis=0) > 0:
        bits = tl.load(slots_ptr + slot, mask=mask, other=0, volatile=True)
    tl.store(slots_ptr + slot, tl.full(bits.shape, SENTINEL, bits.dtype), mask=mask)
    return bits


@triton.jit
def _push_all_reduce_kernel(
    out_ptr,
    bits_ptr,
    slots_ptr,
    addresses,
    counters,
    n,
    region,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    SENTINEL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    shifts = _peer_shifts(slots_ptr, addresses, RANK, WORLD, ELEM_BYTES)
    wait_for_previous_kernel(USE_PDL)  # the partials are written; the next kernel may launch now
    count = tl.load(counters + pid)
    bits = tl.load(bits_ptr + offs, mask=mask, other=0)
    # -0.0 -> +0.0: same sums, never the sentinel
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)
    half = (count % 2) * WORLD * region
    _post(slots_ptr, shifts, half + RANK * region + offs, bits, mask, RANK, WORLD)
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):  # rank order: the same sum, bit for bit, on every rank
        if r == RANK:
            acc += bits.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        else:
            got = _collect(slots_ptr, half + r * region + offs, mask, SENTINEL)
            acc += got.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(counters + pid, count + 1)


@triton.jit
def _push_all_gather_kernel(
    out_ptr,
    bits_ptr,
    slots_ptr,
    addresses,
    counters,
    n,
    cols,
    region,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    SENTINEL: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    shifts = _peer_shifts(slots_ptr, addresses, RANK, WORLD, ELEM_BYTES)
    dest = _gather_dest(offs, cols, WORLD, ONE_ROW)
    wait_for_previous_kernel(USE_PDL)
    count = tl.load(counters + pid)
    bits = tl.load(bits_ptr + offs, mask=mask, other=0)
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)  # every rank stores the same bits
    half = (count % 2) * WORLD * region
    _post(slots_ptr, shifts, half + RANK * region + offs, bits, mask, RANK, WORLD)
    tl.store(out_ptr + RANK * cols + dest, bits, mask=mask)
    for r in tl.static_range(WORLD):
        if r != RANK:
            got = _collect(slots_ptr, half + r * region + offs, mask, SENTINEL)
            tl.store(out_ptr + r * cols + dest, got, mask=mask)
    tl.store(counters + pid, count + 1)


@triton.jit
def _push_broadcast_kernel(
    values_ptr,
    slots_ptr,
    addresses,
    counters,
    n,
    region,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    SENTINEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    count = tl.load(counters + pid)
    half = (count % 2) * region  # only rank 0 sends: one sender's slots per half
    if RANK == 0:
        shifts = _peer_shifts(slots_ptr, addresses, RANK, WORLD, ELEM_BYTES)
        _post(
            slots_ptr, shifts, half + offs, tl.load(values_ptr + offs, mask=mask), mask, RANK, WORLD
        )
    else:
        tl.store(values_ptr + offs, _collect(slots_ptr, half + offs, mask, SENTINEL), mask=mask)
    tl.store(counters + pid, count + 1)


def push_all_reduce(
    values: torch.Tensor, inbox: Inbox, num_warps: int = 4, pdl: bool = True
) -> torch.Tensor:
    """Sum over ranks of every rank's `values` (any device memory), as a new tensor. `pdl`: launch
    with programmatic dependent launch where the device has it."""
    n = values.numel()
    inbox.check(n)
    bits = values.view(inbox.slots.dtype)
    y = torch.empty_like(values)
    pdl = pdl_applies(values.device, pdl)
    _push_all_reduce_kernel[(triton.cdiv(n, inbox.block),)](
        y,
        bits,
        inbox.slots,
        inbox.addresses,
        inbox.counters,
        n,
        inbox.region,
        RANK=inbox.rank,
        WORLD=inbox.world_size,
        ELEM_BYTES=values.element_size(),
        SENTINEL=sentinel(bits.dtype),
        BLOCK=inbox.block,
        USE_PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return y


def push_all_gather(
    values: torch.Tensor, inbox: Inbox, num_warps: int = 4, pdl: bool = True
) -> torch.Tensor:
    """Every rank's `values` [rows, cols] side by side: [rows, world_size * cols]."""
    rows, cols = values.shape
    inbox.check(values.numel())
    bits = values.reshape(-1).view(inbox.slots.dtype)
    y = values.new_empty((rows, inbox.world_size * cols))
    pdl = pdl_applies(values.device, pdl)
    _push_all_gather_kernel[(triton.cdiv(values.numel(), inbox.block),)](
        y.view(inbox.slots.dtype),
        bits,
        inbox.slots,
        inbox.addresses,
        inbox.counters,
        values.numel(),
        cols,
        inbox.region,
        RANK=inbox.rank,
        WORLD=inbox.world_size,
        ELEM_BYTES=values.element_size(),
        SENTINEL=sentinel(bits.dtype),
        ONE_ROW=rows == 1,
        BLOCK=inbox.block,
        USE_PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return y


def push_broadcast(values: torch.Tensor, inbox: Inbox) -> None:
    """Rank 0's `values` (int64; never the sentinel) into every other rank's `values`, in place."""
    n = values.numel()
    inbox.check(n)
    _push_broadcast_kernel[(triton.cdiv(n, inbox.block),)](
        values,
        inbox.slots,
        inbox.addresses,
        inbox.counters,
        n,
        inbox.region,
        RANK=inbox.rank,
        WORLD=inbox.world_size,
        ELEM_BYTES=values.element_size(),
        SENTINEL=sentinel(values.dtype),
        BLOCK=inbox.block,
        num_warps=4,
    )


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type an inbox of `dtype` values is polled as."""
    return _BITS[dtype.itemsize]
