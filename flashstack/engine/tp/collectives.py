"""Decode-step collectives through memory every rank maps (torch symmetric memory, P2P over NVLink;
multicast stays off), by our push kernels (kernels/triton_collectives.py), launched with PDL so the
next GEMV overlaps them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flashstack.engine.config import KernelOptions

if TYPE_CHECKING:  # the kernels import triton: loaded on first use, on GPUs only
    from flashstack.engine.kernels.triton_collectives import Inbox


def product(
    x: torch.Tensor,
    weight: torch.Tensor,
    gemv: bool,
    out: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """`x @ weight.T` (into `out` if given); `gemv`: one-row products through the Triton GEMV."""
    if gemv:
        from flashstack.engine.kernels.triton_gemv import linear

        return linear(x, weight, out=out, pdl=pdl)
    if out is None:
        return torch.nn.functional.linear(x, weight)
    return torch.matmul(x, weight.t(), out=out)


class SymmetricCollectives:
    """All-reduces, all-gathers and the graph steps' input broadcast of one rank: each rank writes
    its values into every peer's inbox, where they are their own arrival signal (one NVLink
    write's one-way trip per call).

    The staged buffers (`stage`) are where the row-parallel GEMVs write their partials; two, used
    in turn, so a call's staged values are never overwritten by the next call's GEMV while the
    push still reads them.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        max_numel: int,
        dtype: torch.dtype,
        device: torch.device,
        step_inputs: int = 0,
        kernels: KernelOptions = KernelOptions(),
    ) -> None:
        self.group, self.dtype, self.max_numel, self.device = group, dtype, max_numel, device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.buffers = [torch.empty(max_numel, dtype=dtype, device=device) for _ in range(2)]
        # Values and warps per program: 2,048 values (a batch-1 hidden state of 4,096 in 2 programs)
        # and 4 warps measured fastest in the 8B decoder's GEMV chain on 2 H200s
        # (bench/tp_all_reduce.py).
        self.block_values, self.warps, self.pdl = (
            kernels.tp_all_reduce_block,
            kernels.tp_all_reduce_warps,
            kernels.pdl,
        )
        self.turn = 0  # the same on every rank: every rank makes the same calls in the same order
        self.inbox = self._inbox(max_numel, dtype)
        self.step_inbox = (
            self._inbox(step_inputs, torch.int64, senders=1) if step_inputs > 0 else None
        )

    def _inbox(self, region: int, dtype: torch.dtype, senders: int | None = None) -> Inbox:
        """Collective: a push inbox of two halves x `senders` (default: every rank) x `region`
        values, sentinel-filled on every rank before any rank can write into it."""
        import torch.distributed._symmetric_memory as symm_mem

        from flashstack.engine.kernels.triton_collectives import Inbox, bits_dtype, sentinel

        bits = bits_dtype(dtype)
        region = -(-region // 64) * 64  # every slot 128-byte aligned: whole-segment vector stores
        slots = symm_mem.empty(
            2 * (senders or self.world_size) * region, dtype=bits, device=self.device
        )
        slots.fill_(sentinel(bits))
        handle = symm_mem.rendezvous(slots, self.group)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group, device_ids=[self.device.index])
        counters = torch.zeros(
            -(-region // self.block_values), dtype=torch.int32, device=self.device
        )
        addresses = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=self.device)
        return Inbox(
            slots, addresses, counters, region, self.rank, self.world_size, self.block_values
        )

    def fits_shape(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return dtype == self.dtype and math.prod(shape) <= self.max_numel

    def fits(self, x: torch.Tensor) -> bool:
        return self.fits_shape(tuple(x.shape), x.dtype)

    def stage(self, shape: tuple[int, ...]) -> torch.Tensor:
        """This call's buffer viewed as `shape`: write the local part here."""
        buffer = self.buffers[self.turn]
        self.turn ^= 1
        return buffer[: math.prod(shape)].view(shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x` (any tensor that fits), as a new tensor."""
        return self.reduce(x)

    def reduce(self, staged: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of what each staged, as a new tensor."""
        from flashstack.engine.kernels.triton_collectives import push_all_reduce

        return push_all_reduce(staged, self.inbox, self.warps, pdl=self.pdl)

    def gather(self, staged: torch.Tensor) -> torch.Tensor:
        """Every rank's staged [rows, cols] side by side, [rows, world_size * cols], as a new
        tensor."""
        from flashstack.engine.kernels.triton_collectives import push_all_gather

        return push_all_gather(staged, self.inbox, self.warps, pdl=self.pdl)

    def broadcast_step_inputs(self, packed: torch.Tensor) -> None:
        """Rank 0's packed step inputs (int64) into the other ranks' `packed`, in place: the first
        kernel of every rank's decode graph."""
        from flashstack.engine.kernels.triton_collectives import push_broadcast

        assert self.step_inbox is not None, "made without room for step inputs"
        push_broadcast(packed, self.step_inbox)
