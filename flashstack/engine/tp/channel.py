"""The per-step message from rank 0 to the other ranks of a tensor-parallel group.

Rank 0 (the caller's process) owns the scheduler; each step it posts an int64 header to a
shared-memory mailbox (host lengths the attention path needs without a device sync) and then
broadcasts one packed int64 tensor (input ids, positions, slot_mapping, block tables, context lens,
query starts, sampled rows) on the device group: NCCL on GPUs, gloo on CPU. A decode step replayed
from CUDA graphs posts only its graph's key: on GPUs the graph's first kernel copies rank 0's packed
inputs over NVLink (`SymmetricCollectives.broadcast_step_inputs`); elsewhere they follow by the
group's broadcast. Nothing is pickled after start-up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashstack.engine.kernels.attention import AttentionMetadata
from flashstack.engine.step import CaptureGraphs, GraphStep, StepInputs
from flashstack.engine.tp.group import TensorParallel
from flashstack.engine.tp.mailbox import Mailbox

_OP_STEP, _OP_EXIT, _OP_GRAPH, _OP_CAPTURE = 1, 2, 5, 6
OP_PROFILE, OP_START = 3, 4  # start-up: mirror rank 0's profiling forward; then the KV block count
_HEADER_FIXED = 4  # op, num_tokens, num_seqs, max_blocks (then num_sample, then host lists)

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
