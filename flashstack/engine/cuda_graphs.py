"""Decode steps as CUDA graphs: one graph per batch bucket, all sharing one memory pool.

A captured graph replays the whole forward pass (and the logits) with one launch, so the CPU cost of
a step no longer depends on the model's depth. Each bucket reads its inputs from static buffers; a
step copies its real inputs in (asynchronously, from pinned host memory), pads the rest (slot -1
writes nothing, context length 1 reads one harmless slot), replays, and slices off its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashstack.engine.kernels.attention import AttentionBackend, AttentionMetadata

MAX_GRAPH_BATCH = 512


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (at most 512)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    buckets = [b for b in (1, 2, 4, 8) if b <= top]
    buckets += list(range(16, top + 1, 8))
    if buckets[-1] != top:
        buckets.append(top)
    return buckets


@dataclass(slots=True)
class _Static:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor


class DecodeGraphs:
    """Captured decode graphs for a model and its KV cache; `run` replays the right bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 block_size: int, max_model_len: int, max_num_seqs: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        self.buckets = graph_buckets(max_num_seqs)
        top = self.buckets[-1]
        width = math.ceil(max_model_len / block_size)
        self.static = _Static(
            input_ids=torch.zeros(top, dtype=torch.int64, device=device),
            positions=torch.zeros(top, dtype=torch.int64, device=device),
            slot_mapping=torch.full((top,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(top, width, dtype=torch.int32, device=device),
            context_lens=torch.ones(top, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(top + 1, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        s = self.static
        meta = AttentionMetadata(
            slot_mapping=s.slot_mapping[:bs], block_tables=s.block_tables[:bs], context_lens=s.context_lens[:bs],
            query_start_loc=s.query_start_loc[: bs + 1], block_size=self.block_size, max_query_len=1,
            max_context_len=self.max_model_len, query_lens_host=[1] * bs, context_lens_host=[1] * bs,
        )
        # One grid for every step of this bucket: split-KV sized for the longest possible context.
        meta.scratch["graph_max_context_len"] = self.max_model_len
        return meta

    def _forward(self, bs: int) -> torch.Tensor:
        s = self.static
        hidden = self.model(s.input_ids[:bs], s.positions[:bs], self._meta(bs), self.kv_caches, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, on_bucket=None) -> None:
        """Capture every bucket, largest first so the shared pool is sized once."""
        for bs in reversed(self.buckets):
            self._forward(bs)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            if on_bucket is not None:
                on_bucket()
        torch.cuda.synchronize(self.device)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences (n ≤ max_batch)."""
        n = len(input_ids)
        bs = self.bucket_for(n)
        width = self.static.block_tables.shape[1]
        pad = bs - n
        # One host tensor for the whole table: a tensor per row would cost a construction per sequence.
        rows = [row + [0] * (width - len(row)) for row in block_tables] + [[0] * width] * pad
        tables = torch.tensor(rows, dtype=torch.int32, pin_memory=True)
        host = {
            "input_ids": torch.tensor(input_ids + [0] * pad, dtype=torch.int64, pin_memory=True),
            "positions": torch.tensor(positions + [0] * pad, dtype=torch.int64, pin_memory=True),
            "slot_mapping": torch.tensor(slot_mapping + [-1] * pad, dtype=torch.int64, pin_memory=True),
            "context_lens": torch.tensor(context_lens + [1] * pad, dtype=torch.int32, pin_memory=True),
        }
        s = self.static
        for name, value in host.items():
            getattr(s, name)[:bs].copy_(value, non_blocking=True)
        s.block_tables[:bs].copy_(tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
