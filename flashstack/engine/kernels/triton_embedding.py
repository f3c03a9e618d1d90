"""A tensor-parallel rank's part of the vocabulary-parallel embedding, in one kernel.

Each rank holds the embedding rows of one vocabulary range and contributes, per token, its row for
an id in that range and zeros otherwise; the all-reduce over ranks sums those into the embedding.
In torch that is ~8 kernels (range tests, a select, the lookup, a mask multiply, the copy into the
all-reduce's buffer); at batch 1, inside a decode graph, each costs a launch. Here one kernel writes
the rank's rows straight into the buffer the all-reduce reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shard_embedding_kernel(
    ids_ptr, w_ptr, out_ptr, start, stop, hidden, stride_w, stride_o, BLOCK: tl.constexpr
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < hidden
    vocab_id = tl.load(ids_ptr + token)
    mine = (vocab_id >= start) & (vocab_id < stop)
    row = tl.where(mine, vocab_id - start, 0).to(tl.int64)
    values = tl.load(w_ptr + row * stride_w + cols, mask=cmask & mine, other=0.0)
    tl.store(out_ptr + token * stride_o + cols, values, mask=cmask)


def shard_embedding_triton(
    ids: torch.Tensor, weight: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[tokens, hidden]: row `id - start` of `weight` for each id in [start, stop), zeros for the
    others (written into `out` if given)."""
    tokens, hidden = ids.numel(), weight.shape[1]
    assert weight.stride(1) == 1
    y = out if out is not None else weight.new_empty((tokens, hidden))
    assert y.shape == (tokens, hidden) and y.stride(1) == 1 and y.dtype == weight.dtype
    block = min(1024, triton.next_power_of_2(hidden))
    _shard_embedding_kernel[(tokens, triton.cdiv(hidden, block))](
        ids.reshape(-1),
        weight,
        y,
        start,
        stop,
        hidden,
        weight.stride(0),
        y.stride(0),
        BLOCK=block,
    )
    return y
