"""A tensor-parallel rank's place in its process group, and the group's plain collectives.

One process per rank; NCCL on GPUs, gloo on CPU. Small decode-step collectives go through peer
memory instead where `enable_fast_all_reduce` set it up (tp/collectives.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from flashstack.engine.config import DEFAULT_TP_TIMEOUT_S, KernelOptions
from flashstack.engine.tp.collectives import SymmetricCollectives, product

# NVLink multicast (NVLS) can put a shared host's GPUs out of service: it stays off everywhere.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast() -> None:
    """Force NVLink multicast off in NCCL, PyTorch and NVSHMEM for this process and its children."""
    os.environ.update(MULTICAST_OFF)


@dataclass(slots=True)
class TensorParallel:
    """This rank's place in the group; the device collectives go on `group`."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    kernels: KernelOptions = KernelOptions()
    # small all-reduces and gathers over NVLink peer memory
    fast: SymmetricCollectives | None = None

    @property
    def is_driver(self) -> bool:
        """True on rank 0, the rank that schedules and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (the vocabulary-parallel embedding's partial rows)."""
        if self.fast is not None and self.fast.fits(x):
            return self.fast.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` summed over the ranks (a row-parallel layer's output)."""
        shape = (*x.shape[:-1], weight.shape[0])
        if self.fast is not None and self.fast.fits_shape(shape, x.dtype):
            staged = self.fast.stage(shape)
            torch.matmul(x, weight.t(), out=staged)  # straight into the push's input: no copy
            return self.fast.reduce(staged)
        y = torch.nn.functional.linear(x, weight)
        dist.all_reduce(y, group=self.group)
        return y

    def enable_fast_all_reduce(
        self, max_numel: int, dtype: torch.dtype, step_inputs: int = 0
    ) -> None:
        """Collective: set up peer-memory all-reduces of up to `max_numel` values on every rank, and
        room for a decode graph's `step_inputs` packed input values (rank 0's, broadcast inside
        the graph: `SymmetricCollectives.broadcast_step_inputs`).

        NCCL's all-reduce costs ~19 µs per call inside a CUDA graph on 2 H200s (measured), about
        1.2 ms per decode step of a 32-layer model; our push all-reduce over symmetric memory costs
        2.6-2.7 µs per call in the decoder's GEMV chain (bench/tp_all_reduce.py). GPUs only;
        kernels.tp_all_reduce="nccl" keeps NCCL for everything.
        """
        if self.device.type != "cuda" or self.kernels.tp_all_reduce == "nccl":
            return
        self.fast = SymmetricCollectives(
            self.group, max_numel, dtype, self.device, step_inputs, self.kernels
        )

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim on rank 0; None elsewhere."""
        # An all-gather, not a gather: NCCL's gather is point-to-point sends, and a decode graph
        # captures the collective kernel far more cheaply than a group of sends.
        x = x.contiguous()
        parts = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))  # ranks stacked on dim 0
        dist.all_gather_into_tensor(parts, x, group=self.group)
        if not self.is_driver:
            return None
        return torch.cat(parts.chunk(self.world_size), dim=-1)

    def linear_gather_to_driver(
        self, x: torch.Tensor, weight: torch.Tensor, gemv: bool = False
    ) -> torch.Tensor | None:
        """`x @ weight.T` of every rank side by side on rank 0, None elsewhere (the
        vocabulary-parallel head's logits). `gemv`: one-row products run through the Triton batch-1
        GEMV."""
        shape = (x.shape[0], weight.shape[0])
        pdl = self.kernels.pdl
        if self.fast is None or not self.fast.fits_shape(shape, x.dtype):
            return self.gather_to_driver(product(x, weight, gemv, pdl=pdl))
        staged = self.fast.stage(shape)
        product(x, weight, gemv, out=staged, pdl=pdl)  # straight into the push's input
        logits = self.fast.gather(staged)  # every rank takes part in the barrier
        return logits if self.is_driver else None


def init_rank(
    rank: int,
    world_size: int,
    port: int,
    device: torch.device,
    store: dist.Store | None = None,
    kernels: KernelOptions = KernelOptions(),
) -> TensorParallel:
    """Join the group through rank 0's TCP store; NCCL when `device` is CUDA, else gloo."""
    disable_multicast()
    timeout = timedelta(seconds=kernels.tp_timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="nccl")
    return TensorParallel(rank, world_size, device, group, kernels)


def leave_group(timeout_s: float = 10.0) -> None:
    """Destroy this process's groups, waiting at most `timeout_s`.

    NCCL hangs tearing down a communicator whose collectives sit in live CUDA graphs
    (pytorch/pytorch#115388). The ranks free their graphs first, which was enough on 2 H200s; should
    a teardown still stick, it must not hang the caller's shutdown, so it runs in a daemon thread.
    """
    if not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, daemon=True, name="tp-leave-group")
    done.start()
    done.join(timeout_s)


def master_store(world_size: int, timeout_s: float = DEFAULT_TP_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store on a free port (port 0: the OS picks one, so parallel test runs don't
    clash)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r runs on GPU base+r; on CPU every rank shares the host."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)
