"""A decode step as two micro-batches, so that one half's products run while the other half's
attention reads the KV cache.

A large decode step of a small model is mostly decode attention, which streams every sequence's
KV cache at the copy bandwidth; the rest is products too small to fill the GPU, a few
microseconds each whatever they read (nano-vllm's workload on the Qwen3-0.6B shape: 5.1 of 6.4 ms
a step in attention, 0.9 ms in products whose weights take 0.3 ms to read). Split in two halves,
each half's layers run on a stream of their own and every attention on one shared stream, in the
order A0, B0, A1, B1, ...: while the attention stream reads half B's KV for layer L, half A's o
projection, MLP and next q/k/v run beside it, and the products leave the critical path. The
weights are read twice a step, so this pays only where a step's KV is much larger than its
weights (KernelOptions.decode_overlap_rows).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from flashstack.engine.kernels.attention import AttentionMetadata

if TYPE_CHECKING:
    from flashstack.engine.models.llama import DecoderModel
    from flashstack.engine.models.ops import Ops


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One half of a decode step: its rows' inputs and attention metadata."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def split_decode(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, at: int
) -> tuple[MicroBatch, MicroBatch]:
    """Rows [0, at) and [at, n) of a decode step (one token a sequence) as two micro-batches."""
    n = input_ids.shape[0]
    if not 0 < at < n or meta.max_query_len != 1:
        raise ValueError(f"a decode step of {n} rows cannot split at row {at}")

    def rows(lo: int, hi: int) -> MicroBatch:
        half = replace(
            meta,
            slot_mapping=meta.slot_mapping[lo:hi],
            block_tables=meta.block_tables[lo:hi],
            context_lens=meta.context_lens[lo:hi],
            query_start_loc=meta.query_start_loc[: hi - lo + 1],  # 0, 1, ..., one token a row
            query_lens_host=meta.query_lens_host[lo:hi],
            context_lens_host=meta.context_lens_host[lo:hi],
            decode_rows=min(meta.decode_rows, hi) - min(meta.decode_rows, lo),
            scratch={},
        )
        return MicroBatch(input_ids[lo:hi], positions[lo:hi], half)

    return rows(0, at), rows(at, n)


class OverlapStreams:
    """The streams of an overlapped step: one for each half's layers, one for every attention.
    `priority` 1: the halves' streams at the device's highest priority and attention's at its
    lowest (a product's blocks take the SMs an attention's programs leave first); -1: the other
    way round (attention keeps the SMs, the products fill its last wave); 0: all equal."""

    def __init__(self, device: torch.device, priority: int = 1) -> None:
        low, high = torch.cuda.Stream.priority_range()
        halves, attention = {1: (high, low), -1: (low, high)}.get(priority, (0, 0))
        self.halves = (
            torch.cuda.Stream(device, priority=halves),
            torch.cuda.Stream(device, priority=halves),
        )
        self.attention = torch.cuda.Stream(device, priority=attention)


def overlapped_hidden(
    model: DecoderModel,
    halves: tuple[MicroBatch, MicroBatch],
    kv_caches: list[torch.Tensor],
    ops: Ops,
    streams: OverlapStreams | None,
) -> torch.Tensor:
    """The final hidden states of both halves, in row order, as the current stream sees them:
    the decoder's layers with each half on its own stream and the attentions on one. Without
    `streams` (a CPU) the same work runs in the same order on the current stream."""
    forks = _Forks(streams)
    states = []
    for i, half in enumerate(halves):
        with forks.half(i):
            h, rope = model.embed(half.input_ids, half.positions)
        forks.to_attention(*rope)
        states.append([ops.for_tokens(half.input_ids.shape[0]), h, None, rope])
    for layer, kv_cache in zip(model.layers, kv_caches):
        done = []
        for i, (half, state) in enumerate(zip(halves, states)):
            half_ops, h, residual, rope = state
            with forks.half(i):
                qkv, state[2] = layer.attention_input(h, residual, half_ops)
            with forks.attention(after=i):
                heads = half_ops.attend(layer.self_attn, qkv, rope, half.meta, kv_cache)
            forks.to_attention(qkv)
            done.append((heads, forks.attention_mark()))
        for i, (state, (heads, finished)) in enumerate(zip(states, done)):
            with forks.half(i, after=finished):
                state[1], state[2] = layer.after_attention(heads, state[2], state[0])
            forks.to_half(i, heads)
    hidden = []
    for i, (half_ops, h, residual, _) in enumerate(states):
        with forks.half(i):
            hidden.append(half_ops.final_norm(model.norm, h, residual))
    forks.join(hidden)
    return torch.cat(hidden)


class _Forks:
    """The stream bookkeeping of overlapped_hidden: which stream runs what, the events between
    them, and the allocator told of every tensor one stream makes and another reads (so its
    memory is not reused before the reader is done)."""

    def __init__(self, streams: OverlapStreams | None) -> None:
        self.streams = streams
        if streams is not None:
            self.main = torch.cuda.current_stream()
            for s in (*streams.halves, streams.attention):
                s.wait_stream(self.main)

    def half(self, i: int, after: torch.cuda.Event | None = None):
        if self.streams is None:
            return nullcontext()
        s = self.streams.halves[i]
        if after is not None:
            s.wait_event(after)
        return torch.cuda.stream(s)

    def attention(self, after: int):
        if self.streams is None:
            return nullcontext()
        self.streams.attention.wait_stream(self.streams.halves[after])
        return torch.cuda.stream(self.streams.attention)

    def attention_mark(self) -> torch.cuda.Event | None:
        if self.streams is None:
            return None
        event = torch.cuda.Event()
        event.record(self.streams.attention)
        return event

    def to_attention(self, *tensors: torch.Tensor) -> None:
        if self.streams is not None:
            for t in tensors:
                t.record_stream(self.streams.attention)

    def to_half(self, i: int, *tensors: torch.Tensor) -> None:
        if self.streams is not None:
            for t in tensors:
                t.record_stream(self.streams.halves[i])

    def join(self, outputs: list[torch.Tensor]) -> None:
        if self.streams is not None:
            for t in outputs:
                t.record_stream(self.main)
            for s in self.streams.halves:
                self.main.wait_stream(s)
