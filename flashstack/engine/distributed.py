"""Tensor-parallel process groups and the per-step broadcast from rank 0 to the other ranks.

One process per rank. Rank 0 (the caller's process) owns the scheduler; each step it posts an int64
header to a shared-memory mailbox (host lengths the attention path needs without a device sync) and
then broadcasts one packed int64 tensor (input ids, positions, slot_mapping, block tables, context
lens, query starts, sampled rows) on the device group: NCCL on GPUs, gloo on CPU. A decode step
replayed from CUDA graphs posts only its graph's key: on GPUs the graph's first kernel copies rank 0's
packed inputs over NVLink (`SymmetricCollectives.broadcast_step_inputs`); elsewhere they follow by
the group's broadcast. Nothing is pickled after start-up.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flashstack.engine.kernels.attention import AttentionMetadata
from flashstack.engine.mailbox import Mailbox
from flashstack.engine.model_runner import StepInputs

if TYPE_CHECKING:  # the kernels import triton: loaded on first use, on GPUs only
    from flashstack.engine.kernels.triton_collectives import Inbox

# NVLink multicast (NVLS) can put a shared host's GPUs out of service: it stays off everywhere.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_OP_STEP, _OP_EXIT, _OP_GRAPH, _OP_CAPTURE = 1, 2, 5, 6
OP_PROFILE, OP_START = 3, 4  # start-up: mirror rank 0's profiling forward; then the KV block count
_HEADER_FIXED = 4  # op, num_tokens, num_seqs, max_blocks (then num_sample, then host lists)


def collective_timeout() -> timedelta:
    """Bound on start-up and device collectives (FLASHSTACK_TP_TIMEOUT_S, default 300 s)."""
    return timedelta(seconds=float(os.environ.get("FLASHSTACK_TP_TIMEOUT_S", "300")))


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
    fast: SymmetricCollectives | None = None  # small all-reduces and gathers over NVLink peer memory

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
            torch.matmul(x, weight.t(), out=staged)  # straight into peer-visible memory: no copy
            return self.fast.reduce(staged)
        y = torch.nn.functional.linear(x, weight)
        dist.all_reduce(y, group=self.group)
        return y

    def enable_fast_all_reduce(self, max_numel: int, dtype: torch.dtype, step_inputs: int = 0) -> None:
        """Collective: set up peer-memory all-reduces of up to `max_numel` values on every rank, and
        room for a decode graph's `step_inputs` packed input values (rank 0's, broadcast inside
        the graph: `SymmetricCollectives.broadcast_step_inputs`).

        NCCL's all-reduce costs ~19 µs per call inside a CUDA graph on 2 H200s (measured), about
        1.2 ms per decode step of a 32-layer model; our push all-reduce over symmetric memory costs
        2.6-2.7 µs per call in the decoder's GEMV chain (bench/tp_all_reduce.py). GPUs only, and
        only where torch's symmetric memory is usable; FLASHSTACK_TP_FAST_ALLREDUCE=0 keeps NCCL for
        everything.
        """
        if self.device.type != "cuda" or os.environ.get("FLASHSTACK_TP_FAST_ALLREDUCE", "1") == "0":
            return
        self.fast = SymmetricCollectives(self.group, max_numel, dtype, self.device, step_inputs)

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

    def linear_gather_to_driver(self, x: torch.Tensor, weight: torch.Tensor, gemv: bool = False) -> torch.Tensor | None:
        """`x @ weight.T` of every rank side by side on rank 0, None elsewhere (the vocabulary-parallel
        head's logits). `gemv`: one-row products run through the Triton batch-1 GEMV."""
        shape = (x.shape[0], weight.shape[0])
        if self.fast is None or not self.fast.fits_shape(shape, x.dtype):
            return self.gather_to_driver(_product(x, weight, gemv))
        staged = self.fast.stage(shape)
        _product(x, weight, gemv, out=staged)  # straight into peer-visible memory
        logits = self.fast.gather(staged)  # every rank takes part in the barrier
        return logits if self.is_driver else None


def _product(x: torch.Tensor, weight: torch.Tensor, gemv: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    if gemv:
        from flashstack.engine.kernels.triton_gemv import linear

        return linear(x, weight, out=out)
    if out is None:
        return torch.nn.functional.linear(x, weight)
    return torch.matmul(x, weight.t(), out=out)


class SymmetricCollectives:
    """All-reduces, all-gathers and the graph steps' input broadcast through memory every rank maps
    (torch symmetric memory, P2P over NVLink; multicast stays off), by our Triton kernels
    (kernels/triton_collectives.py), launched with PDL so the next GEMV overlaps them.

    FLASHSTACK_TP_ALLREDUCE picks how the values move (the benchmarks compare them):
    - `push` (default): each rank writes its values into every peer's inbox, where they are their
      own arrival signal; one NVLink write's one-way trip per call.
    - `pull`: each rank stages its values in its own buffer and reads the peers' after a flag
      barrier; a round trip for the barrier and one for the read.
    - `torch`: torch's `one_shot_all_reduce` (a pull without PDL); gathers pull.

    The staged buffers (`stage`) are where the row-parallel GEMVs write their partials. Two, used
    in turn, for the pull: its barrier only says every rank has *arrived*, so a fast rank may stage
    call k+1 while a slow one still reads call k. By call k+2 the fast rank has passed call k+1's
    barrier, which the slow one reaches only after finishing call k: reuse is safe. Across steps
    the turn order need not alternate (each graph bakes in its own); there the exchange of the
    next step's inputs, which every rank joins after its previous step, separates the uses.
    """

    def __init__(self, group: dist.ProcessGroup, max_numel: int, dtype: torch.dtype,
                 device: torch.device, step_inputs: int = 0) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from flashstack.engine.kernels.triton_collectives import max_programs

        self.group, self.group_name, self.dtype, self.max_numel = group, group.group_name, dtype, max_numel
        self.device = device
        self.buffers = [symm_mem.empty(max_numel, dtype=dtype, device=device) for _ in range(2)]
        handles = [symm_mem.rendezvous(buffer, group) for buffer in self.buffers]
        self.rank, self.world_size = handles[0].rank, handles[0].world_size
        # Every rank's address of each buffer, and of the first buffer's signal pad (the flags of
        # every call), for the Triton kernel.
        self.buffer_ptrs = [torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device) for h in handles]
        self.signal_pads = torch.tensor(handles[0].signal_pad_ptrs, dtype=torch.int64, device=device)
        pad = handles[0].get_signal_pad(self.rank)
        self.max_programs = max_programs(pad.numel() * pad.element_size(), self.world_size)
        # Values and warps per program of our kernels: 2,048 values (a batch-1 hidden state of 4,096
        # in 2 programs) cost 3.8 µs per pulled all-reduce in the 8B decoder's GEMV chain on 2
        # H200s, against 4.6 µs with 1,024 and 7.1 µs with 4,096 (bench/tp_all_reduce.py, which
        # sets these). A push inbox keeps the values per program it was made with.
        self.block_values = int(os.environ.get("FLASHSTACK_TP_ALLREDUCE_BLOCK", "2048"))
        self.warps = int(os.environ.get("FLASHSTACK_TP_ALLREDUCE_WARPS", "4"))
        self.kernel = os.environ.get("FLASHSTACK_TP_ALLREDUCE", "push")
        if self.kernel not in ("push", "pull", "torch"):
            raise ValueError(f"FLASHSTACK_TP_ALLREDUCE={self.kernel!r}: use 'push', 'pull' or 'torch'")
        self.turn = 0  # the same on every rank: every rank makes the same calls in the same order
        self.inbox = self._inbox(max_numel, dtype)
        # The graphs' inputs come by push too; the other kinds keep NCCL's broadcast, which also
        # separates one step's pulls from the next's.
        push_inputs = self.kernel == "push" and step_inputs > 0
        self.step_inbox = self._inbox(step_inputs, torch.int64, senders=1) if push_inputs else None

    def _inbox(self, region: int, dtype: torch.dtype, senders: int | None = None) -> Inbox:
        """Collective: a push inbox of two halves x `senders` (default: every rank) x `region`
        values, sentinel-filled on every rank before any rank can write into it."""
        import torch.distributed._symmetric_memory as symm_mem

        from flashstack.engine.kernels.triton_collectives import Inbox, bits_dtype, sentinel

        bits = bits_dtype(dtype)
        region = -(-region // 64) * 64  # every slot 128-byte aligned: whole-segment vector stores
        slots = symm_mem.empty(2 * (senders or self.world_size) * region, dtype=bits, device=self.device)
        slots.fill_(sentinel(bits))
        handle = symm_mem.rendezvous(slots, self.group)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group, device_ids=[self.device.index])
        counters = torch.zeros(-(-region // self.block_values), dtype=torch.int32, device=self.device)
        addresses = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=self.device)
        return Inbox(slots, addresses, counters, region, self.rank, self.world_size, self.block_values)

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
        if self.kernel == "push":
            return self.reduce(x)
        staged = self.stage(tuple(x.shape))
        staged.copy_(x)
        return self.reduce(staged)

    def reduce(self, staged: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of what each staged, as a new tensor."""
        from flashstack.engine.kernels import triton_collectives as kernels

        if self.kernel == "push":
            return kernels.push_all_reduce(staged, self.inbox, self.warps)
        if self.kernel == "torch":
            return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        return kernels.one_shot_all_reduce(staged, self._buffer_ptrs(staged), self.signal_pads, self.rank,
                                           self.world_size, self.block(staged.numel()), self.warps)

    def gather(self, staged: torch.Tensor) -> torch.Tensor:
        """Every rank's staged [rows, cols] side by side, [rows, world_size * cols], as a new tensor."""
        from flashstack.engine.kernels import triton_collectives as kernels

        if self.kernel == "push":
            return kernels.push_all_gather(staged, self.inbox, self.warps)
        return kernels.one_shot_all_gather(staged, self._buffer_ptrs(staged), self.signal_pads, self.rank,
                                           self.world_size, self.block(staged.numel()))

    def broadcast_step_inputs(self, packed: torch.Tensor) -> None:
        """Rank 0's packed step inputs (int64) into the other ranks' `packed`, in place: the first
        kernel of every rank's decode graph."""
        from flashstack.engine.kernels.triton_collectives import push_broadcast

        assert self.step_inbox is not None, "made without room for step inputs"
        push_broadcast(packed, self.step_inbox)

    def _buffer_ptrs(self, staged: torch.Tensor) -> torch.Tensor:
        return self.buffer_ptrs[0 if staged.data_ptr() == self.buffers[0].data_ptr() else 1]

    def block(self, numel: int) -> int:
        """Values per program of a pull of `numel`: `block_values`, more where the flags would run out."""
        block = self.block_values
        while -(-numel // block) > self.max_programs:
            block *= 2
        return block


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
    group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="nccl")
    return TensorParallel(rank, world_size, device, group)


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


@dataclass(frozen=True, slots=True)
class GraphStep:
    """A decode step replayed from a captured graph: its key (DecodeGraphs: the bucket, or
    SHORT_CONTEXT_KEY), `size` packed int64 inputs."""

    key: int
    size: int


@dataclass(frozen=True, slots=True)
class CaptureGraphs:
    """Capture the decode graphs now, alongside rank 0, for contexts up to `max_model_len`."""

    max_model_len: int


Message = StepInputs | GraphStep | CaptureGraphs


class StepChannel:
    """Rank 0 sends each step's packed inputs; the other ranks receive them."""

    def __init__(self, tp: TensorParallel, block_size: int, mailbox: Mailbox) -> None:
        self.tp, self.block_size, self.mailbox = tp, block_size, mailbox

    @staticmethod
    def header_width(max_num_seqs: int) -> int:
        """int64 values in the largest step header (the mailbox's message width)."""
        return _HEADER_FIXED + 1 + 2 * max_num_seqs

    def send(self, inputs: StepInputs) -> None:
        """Broadcast one step from rank 0 (no host sync on the device side)."""
        meta = inputs.meta
        tables = meta.block_tables
        num_seqs, num_sample = meta.num_seqs, inputs.sample_rows.numel()
        host = [_OP_STEP, inputs.input_ids.numel(), num_seqs, tables.shape[1], num_sample]
        host += meta.query_lens_host + meta.context_lens_host
        self.mailbox.post(host)
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

    def send_graph_step(self, key: int, packed: torch.Tensor) -> None:
        """Broadcast a graph step's packed inputs (already on rank 0's device) to every rank."""
        self.mailbox.post([_OP_GRAPH, key, packed.numel()])
        dist.broadcast(packed, src=0, group=self.tp.group)

    def announce_graph_step(self, key: int, packed: torch.Tensor) -> None:
        """Tell the other ranks to replay graph `key`; its first kernel brings them `packed`."""
        self.mailbox.post([_OP_GRAPH, key, packed.numel()])

    def recv_packed(self, into: torch.Tensor) -> None:
        """Receive a graph step's packed inputs straight into the graphs' input buffer."""
        dist.broadcast(into, src=0, group=self.tp.group)

    def send_capture(self, max_model_len: int) -> None:
        """Have the other ranks capture their decode graphs alongside rank 0."""
        self.send_control(_OP_CAPTURE, max_model_len)

    def send_exit(self) -> None:
        """Tell the other ranks to leave their loops."""
        self.send_control(_OP_EXIT, 0)

    def send_control(self, op: int, value: int) -> None:
        """A start-up or shutdown message: an op code and one integer."""
        self.mailbox.post([op, value])

    def recv_control(self) -> tuple[int, int]:
        """The next start-up message from rank 0."""
        op, value = self.mailbox.take(self.tp.rank)[:2].tolist()
        return op, value

    def recv(self) -> Message | None:
        """The next message: a step's inputs on this rank's device, a graph step (its inputs follow
        through `recv_packed`), a capture request; None when rank 0 says exit."""
        h = self.mailbox.take(self.tp.rank)
        op, n, num_seqs, max_blocks, num_sample = h[: _HEADER_FIXED + 1].tolist()
        if op == _OP_EXIT:
            return None
        if op == _OP_GRAPH:
            return GraphStep(key=n, size=num_seqs)
        if op == _OP_CAPTURE:
            return CaptureGraphs(max_model_len=n)
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
