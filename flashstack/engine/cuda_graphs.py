"""Decode steps as CUDA graphs: one graph per batch bucket, all sharing one memory pool.

A captured graph replays the whole forward pass (and the logits) with one launch, so the CPU cost of
a step no longer depends on the model's depth. A step's inputs travel as one packed int64 tensor
(ids, positions, slots, context lengths, block-table rows, then the sampler's temperatures and
seed: `bucket * (5 + width) + 1` values): one asynchronous copy from a pooled pinned block
(engine/staging.py), and under tensor parallelism one broadcast to the other ranks. With
KernelOptions.graph_fetches_inputs (one GPU) the graph's first kernel reads them from a ring of
pinned slots instead, and the previous step's tokens from where the graph before wrote them, and
its sampler writes the tokens into the ring for the host (engine/input_ring.py,
kernels/triton_step_inputs.py): nothing is queued between two replays. Each bucket's
graph reads the packed buffer in its own layout and converts the two int32 inputs of the attention
kernels itself. Padded rows write nothing (slot -1), read one harmless slot (context length 1) and
are greedy.

A bucket has one graph per grid bound its attention backend asks for (`decode_grid_bounds`: the
Triton backend gives bucket 1 a short-context launch too, kernels/triton_attention.plan_decode), as
a graph bakes its launches in; a step replays the smallest bound that holds its longest context.
Graphs are keyed by their place in `captures`; tensor-parallel ranks capture the same list, receive
the key and replay the same graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flashstack.cuda.graph_edges import open_at_launch_completion
from flashstack.engine.input_ring import InputRing, TokensRead
from flashstack.engine.kernels.attention import AttentionMetadata
from flashstack.engine.models.ops import Ops
from flashstack.engine.staging import to_device
from flashstack.engine.step import ShareInputs, StepHook

MAX_GRAPH_BATCH = 512
_INPUT_ROWS = 4  # ids, positions, slots, context lengths; the block table and the draws follow


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (at most 512)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    buckets = [b for b in (1, 2, 4, 8) if b <= top]
    buckets += list(range(16, top + 1, 8))
    if buckets[-1] != top:
        buckets.append(top)
    return buckets


@dataclass(slots=True)
class _BucketInputs:
    """Views of the packed buffer in one bucket's layout."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor  # int64; the graph converts it
    block_tables: torch.Tensor  # int64 [bucket, width]; the graph converts it
    temperatures: torch.Tensor  # int64: float32 bit patterns, read by the sampler as they are
    seed: torch.Tensor  # int64 [1]: the step's draws


class DecodeGraphs:
    """Captured decode graphs for a model and its KV cache; `run` replays the right bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        ops: Ops,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        fetch_inputs: bool = False,
    ) -> None:
        self.model, self.kv_caches, self.ops = model, kv_caches, ops
        backend = ops.backend
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        self.buckets = graph_buckets(max_num_seqs)
        top = self.buckets[-1]
        self.width = math.ceil(max_model_len / block_size)
        self.packed = torch.zeros(
            self.packed_capacity(max_model_len, block_size, max_num_seqs),
            dtype=torch.int64,
            device=device,
        )
        # fetch_inputs: each graph's first kernel takes its inputs from `ring`, and the tokens of
        # every graph go to `last_tokens`, where the next step's ids are read
        self.ring = InputRing(self.packed.numel(), device, rows=top) if fetch_inputs else None
        self._slot = 0  # the ring slot the last `stage` wrote
        self.last_tokens = torch.zeros(top, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, self.width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        # (bucket, grid bound) of every graph, largest bucket first so the shared pool is sized
        # once; a graph's key is its index here.
        self.captures = [
            (bs, bound)
            for bs in reversed(self.buckets)
            for bound in sorted(backend.decode_grid_bounds(bs, max_model_len), reverse=True)
        ]
        self.keys = {capture: key for key, capture in enumerate(self.captures)}
        self.bounds = {bs: sorted(b for c, b in self.captures if c == bs) for bs in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor | None] = {}
        # Each graph's tokens, taken inside it: the logits' argmax (KernelOptions.
        # argmax_in_graph), or draws at the staged temperatures, greedy rows at 0
        # (sample_in_graph). A step whose rows the graph's tokens serve then launches nothing after
        # the replay but their copy to the host. None where the graph has no logits (a TP rank
        # other than 0).
        self.sample_in_graph = ops.kernels.sample_in_graph
        self.tokens_in_graph = ops.kernels.argmax_in_graph or self.sample_in_graph
        self.tokens: dict[int, torch.Tensor | None] = {}
        # KernelOptions.pdl_on_launch_completion: each graph's edges opened at their source's
        # launch completion, by key (a graph without PDL launches has none to move)
        self.launch_edges = ops.kernels.pdl_on_launch_completion
        self.opened_edges: dict[int, int] = {}
        self.pool = None
        # rank 0 of a tensor-parallel group announces the step
        self.before_replay: StepHook | None = None
        # Under tensor parallelism: the graphs' first kernel gives every rank rank 0's packed
        # inputs.
        self.share_inputs: ShareInputs | None = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @staticmethod
    def packed_capacity(max_model_len: int, block_size: int, max_num_seqs: int) -> int:
        """Values in the largest bucket's packed inputs."""
        return _packed_size(graph_buckets(max_num_seqs)[-1], math.ceil(max_model_len / block_size))

    def packed_size(self, bs: int) -> int:
        """Values in bucket `bs`'s packed inputs."""
        return _packed_size(bs, self.width)

    def _views(self, bs: int) -> _BucketInputs:
        p = self.packed
        ids, pos, slots, ctx = (p[i * bs : (i + 1) * bs] for i in range(_INPUT_ROWS))
        tables_end = (_INPUT_ROWS + self.width) * bs
        tables = p[_INPUT_ROWS * bs : tables_end].view(bs, self.width)
        temps, seed = p[tables_end : tables_end + bs], p[tables_end + bs : tables_end + bs + 1]
        return _BucketInputs(ids, pos, slots, ctx, tables, temps, seed)

    def _meta(self, bs: int, slot_mapping: torch.Tensor, max_context_len: int) -> AttentionMetadata:
        # One grid for every step of this graph: split-KV sized for the longest context it serves.
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            block_size=self.block_size,
            max_query_len=1,
            max_context_len=max_context_len,
            query_lens_host=[1] * bs,
            context_lens_host=[1] * bs,
            grid_context_len=max_context_len,
        )

    def _forward(self, bs: int, max_context_len: int) -> torch.Tensor | None:
        if self.share_inputs is not None:
            self.share_inputs(self.packed[: self.packed_size(bs)])
        v = self._views(bs)
        if self.ring is not None:  # the fetch writes the int32 inputs too
            from flashstack.engine.kernels.triton_step_inputs import fetch_step_inputs

            ring = self.ring
            lens, tables = self.context_lens[:bs], self.block_tables[:bs]
            n = self.packed_size(bs)
            fetch_step_inputs(ring.host, ring.state, self.packed, self.last_tokens, lens, tables, n)
        else:
            self.context_lens[:bs].copy_(v.context_lens)
            self.block_tables[:bs].copy_(v.block_tables)
        meta = self._meta(bs, v.slot_mapping, max_context_len)
        hidden = self.model(v.input_ids, v.positions, meta, self.kv_caches, self.ops)
        # None on ranks other than a group's rank 0
        return self.model.compute_logits(hidden, self.ops)

    def _tokens(self, bs: int, logits: torch.Tensor | None) -> torch.Tensor | None:
        if logits is None or not self.tokens_in_graph:
            return None
        from flashstack.engine.kernels.triton_sampling import argmax_triton, sample_triton

        ring = self.ring
        out = self.last_tokens[:bs] if ring is not None else None
        host = (ring.tokens, ring.state) if ring is not None else None
        if not self.sample_in_graph:
            return argmax_triton(logits, out, host)
        v = self._views(bs)
        return sample_triton(logits, v.temperatures, v.seed, out=out, host_ring=host)

    def _pad(self, bs: int) -> None:
        """Fill bucket `bs`'s inputs with padding rows (what warm-up and capture run on)."""
        v = self._views(bs)
        for t, value in (
            (v.input_ids, 0),
            (v.positions, 0),
            (v.slot_mapping, -1),
            (v.context_lens, 1),
            (v.block_tables, 0),
            (v.temperatures, 0),
            (v.seed, 0),
            (self.context_lens[:bs], 1),  # a fetch writes these itself: none in a warm-up
            (self.block_tables[:bs], 0),
        ):
            t.fill_(value)

    @torch.inference_mode()
    def capture(self, on_bucket=None) -> None:
        """Capture every bucket, largest first so the shared pool is sized once.

        Under tensor parallelism every rank calls this at once: warm-ups and captures issue the
        same collectives in the same order on every rank.
        """
        for key, (bs, max_context_len) in enumerate(self.captures):
            self._pad(bs)
            # warm-up: Triton compiles and autotunes outside the capture
            self._tokens(bs, self._forward(bs, max_context_len))
            torch.cuda.synchronize(self.device)
            # kept uninstantiated when its edges are to be moved before the first replay
            graph = torch.cuda.CUDAGraph(keep_graph=self.launch_edges)
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[key] = logits = self._forward(bs, max_context_len)
                self.tokens[key] = self._tokens(bs, logits)
            if self.launch_edges:
                self.opened_edges[key] = open_at_launch_completion(graph.raw_cuda_graph())
                graph.instantiate()
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
            if on_bucket is not None and max_context_len == self.max_model_len:
                on_bucket()
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Destroy every graph and drop the pool."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
        self.tokens.clear()
        self.pool = None

    def key_for(self, bs: int, longest: int) -> int:
        """The graph of bucket `bs` with the smallest grid bound that holds a `longest`-token
        context."""
        return self.keys[bs, next(b for b in self.bounds[bs] if b >= longest)]

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        ids_from: torch.Tensor | None = None,
        temperatures: list[float] | None = None,
        seed: int = 0,
        picks: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, vocab] of one decode step of n sequences (n ≤ max_batch), and the graph's
        tokens [n] (int64) when it takes them (else None): drawn at `temperatures` (one a row, 0:
        greedy) from `seed` where the graph samples (sample_in_graph), else the logits' argmax.
        Both are the graph's own memory, valid until its next replay: what reads them must be
        queued before that. `ids_from`, a device tensor [k], replaces the first k `input_ids`
        (the previous step's samples, never read back); with `picks`, its rows `picks` replace
        the first len(picks)."""
        # the graph first: a step staged in the ring and never replayed would be the next
        # replay's inputs
        key = self.key_for(self.bucket_for(len(input_ids)), max(context_lens))
        if ids_from is not None and self.ring is not None:
            input_ids = self._ids_from_last_tokens(input_ids, ids_from, picks)
            ids_from = None
        elif ids_from is not None and picks is not None:
            ids_from = ids_from[to_device(picks, torch.int64, self.device)]
        bs = self.stage(
            input_ids, positions, slot_mapping, block_tables, context_lens, temperatures, seed
        )
        if ids_from is not None:
            self.packed[: ids_from.shape[0]].copy_(ids_from)
        if self.before_replay is not None:
            self.before_replay(key, self.packed[: self.packed_size(bs)])
        self.graphs[key].replay()
        if self.ring is not None:
            self.ring.queued(self._slot)
        logits, tokens = self.logits[key], self.tokens[key]
        assert logits is not None, "only the rank that samples replays through run()"
        n = len(input_ids)
        return logits[:n], (tokens[:n] if tokens is not None else None)

    def stage(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        temperatures: list[float] | None = None,
        seed: int = 0,
    ) -> int:
        """Pack one step's inputs, padded to its bucket, into `packed` (with a ring: into its
        next slot, which the next replay takes); returns the bucket. Without `temperatures` every
        row is greedy. An input id -1 - j (a ring only): row j of the tokens the last graph took."""
        n = len(input_ids)
        bs = self.bucket_for(n)
        pad, width = bs - n, self.width
        values = input_ids + [0] * pad
        values += positions + [0] * pad
        values += slot_mapping + [-1] * pad
        values += context_lens + [1] * pad
        for row in block_tables:
            values += row
            values += [0] * (width - len(row))
        values += [0] * (width * pad)
        values += float32_bits(temperatures) if temperatures else [0] * n
        values += [0] * pad
        values.append(seed)
        if self.ring is not None:
            self._slot = self.ring.write(values)
        else:
            to_device(values, torch.int64, self.device, out=self.packed)
        return bs

    def tokens_read(self, n: int) -> TokensRead | None:
        """With a ring, the host's read of the last `run`'s n tokens (which the graph's sampler
        wrote into the ring: no copy back to queue); else None."""
        return self.ring.tokens_read(n) if self.ring is not None else None

    def _ids_from_last_tokens(
        self, input_ids: list[int], ids_from: torch.Tensor, picks: list[int] | None
    ) -> list[int]:
        """`input_ids` with its leading ids as references to the last graph's tokens, which the
        next graph reads on the device: row picks[i] of them (every row, in order, without
        `picks`). Tokens from anywhere else (an eager step's sampler, a gather) are picked and
        copied there first."""
        if ids_from.data_ptr() == self.last_tokens.data_ptr() and ids_from.is_contiguous():
            rows = picks if picks is not None else range(ids_from.shape[0])
        else:
            if picks is not None:
                ids_from = ids_from[to_device(picks, torch.int64, self.device)]
            rows = range(ids_from.shape[0])
            self.last_tokens[: len(rows)].copy_(ids_from)
        return [-1 - j for j in rows] + list(input_ids[len(rows) :])

    def replay_received(self, key: int) -> None:
        """Replay graph `key` (rank 0's choice) on inputs another rank has just written into
        `packed` (a TP rank)."""
        self.graphs[key].replay()


def _packed_size(bs: int, width: int) -> int:
    # the inputs' rows and the block table, a temperature a row, the seed
    return bs * (_INPUT_ROWS + width + 1) + 1


def float32_bits(values: list[float]) -> list[int]:
    """Floats as their float32 bit patterns (signed 32-bit integers): how the packed int64 inputs
    carry the sampler's temperatures (kernels/triton_sampling.py reads them back bit for bit)."""
    return np.asarray(values, dtype=np.float32).view(np.int32).tolist()
