"""A decode graph's first kernel: fetch the step's packed inputs from pinned host memory.

Staging a step's inputs with a copy on the stream costs the device a copy between two replays (the
copy engine waits for the graph before it, the graph after waits for the copy), and so does the
previous step's tokens copied into the inputs on the device. Here the host writes each step's
inputs into a ring of pinned slots (engine/input_ring.py) and the graph's first kernel reads its
slot over the bus itself: nothing runs between two replays. An input id below zero, -1 - j,
stands for row j of the previous graph's tokens, read on the device. The same kernel writes the
context lengths and block tables in the int32 the attention kernels read, which two conversion
kernels did after the copy.

Which slot: the device keeps the sequence number of the inputs it last took (`state[0]`); a
replay takes slot (taken + 1) % slots if that slot's header carries taken + 1, and otherwise
replays on the inputs it has (a benchmark replaying one staged step). The last program to finish
moves the number on, once every program has read it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # values a program copies


@triton.jit
def _fetch_kernel(
    ring_ptr,
    state_ptr,
    packed_ptr,
    tokens_ptr,
    lens_ptr,
    tables_ptr,
    n_values,
    n_ids,
    slot_stride,
    table_values,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    expected = tl.load(state_ptr, volatile=True) + 1
    slot = ring_ptr + (expected % SLOTS) * slot_stride
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_values
    # the header and the values in one round trip over the bus: the values are kept only if the
    # header says they are the step's
    seq = tl.load(slot, volatile=True)
    values = tl.load(slot + 1 + offs, mask=inside, other=0, volatile=True)
    fresh = seq == expected
    from_tokens = fresh & inside & (offs < n_ids) & (values < 0)
    taken = tl.load(tokens_ptr + (-1 - values), mask=from_tokens, other=0)
    tl.store(packed_ptr + offs, tl.where(from_tokens, taken, values), mask=inside & fresh)
    # packed: ids, positions, slots, context lengths (n_ids each), then the block tables
    lens = offs - 3 * n_ids
    tl.store(lens_ptr + lens, values.to(tl.int32), mask=fresh & (lens >= 0) & (lens < n_ids))
    tables = offs - 4 * n_ids
    in_tables = fresh & (tables >= 0) & (tables < table_values)
    tl.store(tables_ptr + tables, values.to(tl.int32), mask=in_tables)
    # every program has read state[0] before it arrives (acq_rel): the last one may move it on
    ticket = tl.atomic_add(state_ptr + 1, 1)
    if ticket == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        if fresh:
            tl.store(state_ptr, expected)


def fetch_step_inputs(
    ring: torch.Tensor,
    state: torch.Tensor,
    packed: torch.Tensor,
    tokens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    n_values: int,
) -> None:
    """packed[:n_values] = the next slot of `ring` [slots, 1 + capacity] (int64, pinned host
    memory on CUDA) when its header is the sequence number after state[0]: a decode graph's
    inputs for len(context_lens) rows (cuda_graphs.py's layout), the ids below zero (-1 - j)
    replaced by tokens[j], and the context lengths and `block_tables` (rows of its width) also
    written as the int32 tensors given. `state`: int64 [2] on the device, zeroed once. A graph
    captures this launch: every argument is read when it runs."""
    slots, width = ring.shape
    rows = context_lens.numel()
    assert n_values < width and ring.dtype == packed.dtype == tokens.dtype == torch.int64
    assert state.shape == (2,) and state.dtype == torch.int64 and ring.is_contiguous()
    assert context_lens.dtype == block_tables.dtype == torch.int32
    assert block_tables.is_contiguous() and block_tables.shape[0] == rows
    _fetch_kernel[(triton.cdiv(n_values, _BLOCK),)](
        ring,
        state,
        packed,
        tokens,
        context_lens,
        block_tables,
        n_values,
        rows,
        width,
        block_tables.numel(),
        SLOTS=slots,
        BLOCK=_BLOCK,
    )
