"""Tensor-parallel process groups and the per-step broadcast from rank 0 to the other ranks.

One process per rank. Rank 0 (the caller's process) owns the scheduler; each step it broadcasts a
fixed-size int64 header on a gloo group (host lengths the attention path needs without a device
sync) and then one packed int64 tensor (input ids, positions, slot_mapping, block tables, context
lens, query starts, sampled rows) on the device group: NCCL on GPUs, gloo on CPU. Nothing is pickled
after start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from flashstack.engine.kernels.attention import AttentionMetadata
from flashstack.engine.model_runner import StepInputs

# NVLink multicast (NVLS) can put a shared host's GPUs out of service: it stays off everywhere.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_OP_STEP, _OP_EXIT = 1, 2
OP_PROFILE, OP_START = 3, 4  # start-up: mirror rank 0's profiling forward; then the KV block count
_HEADER_FIXED = 4  # op, num_tokens, num_seqs, max_blocks (then num_sample, then host lists)
# An idle server sends no steps for hours: the header wait must not time out (workers watch rank 0
# instead, see worker.py).
_IDLE_TIMEOUT = timedelta(days=365)


def collective_timeout() -> timedelta:
    """Bound on start-up and device collectives (FLASHSTACK_TP_TIMEOUT_S, default 300 s)."""
    return timedelta(seconds=float(os.environ.get("FLASHSTACK_TP_TIMEOUT_S", "300")))


def disable_multicast() -> None:
    """Force NVLink multicast off in NCCL, PyTorch and NVSHMEM for this process and its children."""
    os.environ.update(MULTICAST_OFF)


@dataclass(slots=True)
class TensorParallel:
    """This rank's place in the group: the device collectives go on `group`, step headers on
    `cpu_group`."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup

    @property
    def is_driver(self) -> bool:
        """True on rank 0, the rank that schedules and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (after row-parallel layers)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim on rank 0; None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (start-up agreement, e.g. the KV block count)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.cpu_group)
        return int(t.item())


def init_rank(
    rank: int, world_size: int, port: int, device: torch.device, store: dist.Store | None = None
) -> TensorParallel:
    """Join the group through rank 0's TCP store; NCCL when `device` is CUDA, else gloo."""
    disable_multicast()
    timeout = collective_timeout()
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="nccl")
    return TensorParallel(rank, world_size, device, group, cpu_group)


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free port (port 0: the OS picks one, so parallel test runs don't clash)."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, True, timeout=collective_timeout(), wait_for_workers=False
    )


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r runs on GPU base+r; on CPU every rank shares the host."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class StepChannel:
    """Rank 0 sends each step's packed inputs; the other ranks receive them."""

    def __init__(self, tp: TensorParallel, max_num_seqs: int, block_size: int) -> None:
        self.tp, self.block_size = tp, block_size
        self._header = torch.zeros(_HEADER_FIXED + 1 + 2 * max_num_seqs, dtype=torch.int64)

    def send(self, inputs: StepInputs) -> None:
        """Broadcast one step from rank 0 (no host sync on the device side)."""
        meta = inputs.meta
        tables = meta.block_tables
        num_seqs, num_sample = meta.num_seqs, inputs.sample_rows.numel()
        host = [_OP_STEP, inputs.input_ids.numel(), num_seqs, tables.shape[1], num_sample]
        host += meta.query_lens_host + meta.context_lens_host
        self._header[: len(host)] = torch.tensor(host, dtype=torch.int64)
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)
        parts = (
            inputs.input_ids,
            inputs.positions,
            meta.slot_mapping,
            tables.flatten(),
            meta.context_lens,
            meta.query_start_loc,
            inputs.sample_rows,
        )
        packed = torch.cat([p.to(torch.int64) for p in parts])
        dist.broadcast(packed, src=0, group=self.tp.group)

    def send_exit(self) -> None:
        """Tell the other ranks to leave their loops."""
        self.send_control(_OP_EXIT, 0)

    def send_control(self, op: int, value: int) -> None:
        """A start-up or shutdown message: an op code and one integer."""
        self._header[:2] = torch.tensor([op, value])
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)

    def recv_control(self) -> tuple[int, int]:
        """The next start-up message from rank 0."""
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)
        op, value = self._header[:2].tolist()
        return op, value

    def recv(self) -> StepInputs | None:
        """The next step's inputs on this rank's device; None when rank 0 says exit."""
        h = self._header
        dist.broadcast(h, src=0, group=self.tp.cpu_group)
        op, n, num_seqs, max_blocks, num_sample = h[: _HEADER_FIXED + 1].tolist()
        if op == _OP_EXIT:
            return None
        lens = h[_HEADER_FIXED + 1 : _HEADER_FIXED + 1 + 2 * num_seqs].tolist()
        query_lens, context_lens = lens[:num_seqs], lens[num_seqs:]
        sizes = [n, n, n, num_seqs * max_blocks, num_seqs, num_seqs + 1, num_sample]
        packed = torch.empty(sum(sizes), dtype=torch.int64, device=self.tp.device)
        dist.broadcast(packed, src=0, group=self.tp.group)
        ids, pos, slots, tables, ctx, qstart, rows = packed.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
            context_lens=ctx.to(torch.int32),
            query_start_loc=qstart.to(torch.int32),
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )
        return StepInputs(ids, pos, meta, rows, [])
