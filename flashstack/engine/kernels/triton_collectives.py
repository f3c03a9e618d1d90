"""One-shot all-reduce and all-gather over peer memory (NVLink P2P) for a tensor-parallel decode step.

Every rank has staged its values in a buffer that all ranks map (torch symmetric memory). Each
program of these kernels meets its counterparts on the other ranks at a flag barrier, then reads
every rank's copy of its slice, peers' straight over NVLink: the all-reduce sums them in rank order,
so every rank gets the same bits; the all-gather lays them side by side (the vocabulary-parallel
logits).

torch's `symm_mem.one_shot_all_reduce` does the same, but it is not launched with programmatic
dependent launch (kernels/pdl.py): the GEMV after it can only launch, and start streaming its
weights, once the all-reduce has drained. A batch-1 step of a 32-layer model runs 64 of them. This
kernel waits for the GEMV that wrote the partials, then releases the next GEMV at once, so its
launch and first weight chunk overlap the barrier and the peer reads.

The barrier: one thread per peer sets a flag (0 -> 1) in the peer's signal pad, then waits for the
peer's flag in its own pad and clears it (1 -> 0). A flag still set from the previous call makes the
sender wait until the peer has consumed it, so calls pair up in order whatever the ranks' relative
speed, and the pads are all-zero between calls (a CUDA graph can replay the same kernels forever).
The release on the set and the acquire on the clear order the partials' writes before the peer's
reads. Reuse of the partials' buffers across calls is the caller's concern (distributed.py keeps two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.engine.kernels.pdl import pdl_enabled, wait_for_previous_kernel

# PTX for the flag barrier of program `$4 / world`. Thread t < world, t != rank, pairs with rank t:
# it sets slot [$4 + rank] in t's pad (spinning while the previous call's flag is still there),
# then waits for slot [$4 + t] of its own pad to be set and clears it. $1: the device array of the
# ranks' pad addresses, $2: rank, $3: world size. One asm block per kernel: its labels are unique.
_BARRIER_PTX = tl.constexpr("""
{
    .reg .u32 %t, %old, %slot;
    .reg .u64 %off, %addr, %peer_pad, %own_pad;
    .reg .pred %skip, %again;
    mov.u32 %t, %tid.x;
    setp.ge.u32 %skip, %t, $3;
    setp.eq.or.u32 %skip, %t, $2, %skip;
    @%skip bra DONE;
    mul.wide.u32 %off, %t, 8;
    add.u64 %addr, $1, %off;
    ld.global.u64 %peer_pad, [%addr];
    mul.wide.u32 %off, $2, 8;
    add.u64 %addr, $1, %off;
    ld.global.u64 %own_pad, [%addr];
    add.u32 %slot, $4, $2;
    mul.wide.u32 %off, %slot, 4;
    add.u64 %addr, %peer_pad, %off;
SEND:
    atom.global.release.sys.cas.b32 %old, [%addr], 0, 1;
    setp.ne.u32 %again, %old, 0;
    @%again bra SEND;
    add.u32 %slot, $4, %t;
    mul.wide.u32 %off, %slot, 4;
    add.u64 %addr, %own_pad, %off;
WAIT:
    atom.global.acquire.sys.cas.b32 %old, [%addr], 1, 0;
    setp.ne.u32 %again, %old, 1;
    @%again bra WAIT;
DONE:
    mov.u32 $0, 0;
}
""")


@triton.jit
def _barrier(signal_pads, slot_base, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every rank's program with this id has arrived (and its partials are visible) on return."""
    tl.inline_asm_elementwise(_BARRIER_PTX, "=r,l,r,r,r", [signal_pads.to(tl.int64), RANK, WORLD, slot_base],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # the other threads read the peers' partials only after the flag threads


@triton.jit
def _peer_shifts(staged_ptr, buffers, RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Each rank's copy of the staged values as an offset (in values) from ours. The compiler knows
    our pointer's alignment, not that of an address loaded from memory; every buffer starts on a
    page, so loads through these offsets stay 16-byte vectors. The addresses were set at start-up:
    safe to read before waiting for the previous kernel."""
    own = tl.load(buffers + RANK)
    shifts = ()
    for r in tl.static_range(WORLD):
        shifts = shifts + (tl.multiple_of((tl.load(buffers + r) - own) // ELEM_BYTES, 16 // ELEM_BYTES),)
    return shifts


@triton.jit
def _one_shot_all_reduce_kernel(out_ptr, staged_ptr, buffers, signal_pads, n,
                                RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BYTES: tl.constexpr,
                                BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    shifts = _peer_shifts(staged_ptr, buffers, RANK, WORLD, ELEM_BYTES)
    wait_for_previous_kernel(USE_PDL)  # the partials are written; the next kernel may launch now
    mine = tl.load(staged_ptr + offs, mask=mask, other=0.0)
    _barrier(signal_pads, pid * WORLD, RANK, WORLD)
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):  # rank order: the same sum, bit for bit, on every rank
        if r == RANK:
            acc += mine.to(tl.float32)
        else:  # .cg: from the peer's L2 over NVLink, never from a stale line in our L1
            acc += tl.load(staged_ptr + shifts[r] + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_all_gather_kernel(out_ptr, staged_ptr, buffers, signal_pads, n, cols,
                                RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BYTES: tl.constexpr,
                                ONE_ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    shifts = _peer_shifts(staged_ptr, buffers, RANK, WORLD, ELEM_BYTES)
    # value (row i, column j) of rank r's [rows, cols] goes to (i, r * cols + j) of [rows, WORLD * cols]
    dest = offs if ONE_ROW else (offs // cols) * (WORLD * cols) + offs % cols
    wait_for_previous_kernel(USE_PDL)
    tl.store(out_ptr + RANK * cols + dest, tl.load(staged_ptr + offs, mask=mask), mask=mask)
    _barrier(signal_pads, pid * WORLD, RANK, WORLD)
    for r in tl.static_range(WORLD):
        if r != RANK:
            part = tl.load(staged_ptr + shifts[r] + offs, mask=mask, cache_modifier=".cg")
            tl.store(out_ptr + r * cols + dest, part, mask=mask)


def max_programs(signal_pad_bytes: int, world_size: int) -> int:
    """How many programs one call may run: each needs `world_size` 4-byte flags in every pad."""
    return signal_pad_bytes // (4 * world_size)


def one_shot_all_reduce(staged: torch.Tensor, buffers: torch.Tensor, signal_pads: torch.Tensor, rank: int,
                        world_size: int, block: int, num_warps: int = 4) -> torch.Tensor:
    """Sum over ranks of the `staged` values (the first numel of this rank's symmetric buffer), as a
    new tensor.

    `buffers` / `signal_pads`: int64 device tensors of every rank's buffer and signal-pad address
    (rank order). `block`: values per program; the caller keeps the grid within the pads
    (`max_programs`)."""
    n = staged.numel()
    y = torch.empty_like(staged)
    pdl = pdl_enabled(staged.device)
    _one_shot_all_reduce_kernel[(triton.cdiv(n, block),)](
        y, staged, buffers, signal_pads, n, RANK=rank, WORLD=world_size, ELEM_BYTES=staged.element_size(),
        BLOCK=block, USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )
    return y


def one_shot_all_gather(staged: torch.Tensor, buffers: torch.Tensor, signal_pads: torch.Tensor, rank: int,
                        world_size: int, block: int) -> torch.Tensor:
    """Every rank's `staged` [rows, cols] side by side: [rows, world_size * cols] (arguments as for
    `one_shot_all_reduce`)."""
    rows, cols = staged.shape
    y = staged.new_empty((rows, world_size * cols))
    pdl = pdl_enabled(staged.device)
    _one_shot_all_gather_kernel[(triton.cdiv(staged.numel(), block),)](
        y, staged, buffers, signal_pads, staged.numel(), cols, RANK=rank, WORLD=world_size,
        ELEM_BYTES=staged.element_size(), ONE_ROW=rows == 1, BLOCK=block, USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
    return y
