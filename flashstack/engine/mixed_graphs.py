"""Prefill and mixed steps as CUDA graphs, one per token bucket.

A decode graph (cuda_graphs.py) bakes a whole decode step in. A step that carries prefill chunks
has attention launches that depend on every sequence's query and context lengths; run eagerly, a
28-layer model launches some 250 kernels from Python for it, and the host, not the GPU, sets the
step's time. Here a step of n tokens replays the graph of the smallest bucket of at least n tokens
(its padded rows compute on stale values, row by row, write no KV and are never read), and its
metadata travels in static buffers: block tables, context lengths, query starts, and the map of
(sequence, query tile) pairs that gives the prefill attention kernel a fixed grid
(kernels/triton_attention.prefill_tiles), as vLLM's full CUDA graphs do for mixed batches. The
step's one-token rows (ModelRunner.prepare puts them first) go to the split-KV decode kernel,
launched for as many rows as the bucket can hold sequences.

Steps whose chunks are all long enough for torch's fused attention (attention.sdpa_prefill_applies:
a per-sequence loop, not capturable) replay instead a graph per stretch between two attentions,
with the attentions run eagerly in between (vLLM's piecewise graphs); those stretches depend only on
the number of tokens, and pass the residual stream and the attention inputs and outputs through
static buffers.
"""

from __future__ import annotations

import math

import torch

from flashstack.engine.kernels.attention import (
    SDPA_MIN_QUERY_LEN,
    AttentionMetadata,
    sdpa_prefill_applies,
)
from flashstack.engine.models import LlamaForCausalLM, ModelArgs
from flashstack.engine.models.ops import Ops
from flashstack.engine.staging import to_device_parts

MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ... 256, then steps of half a power of two (384, 512, 768, 1024, 1536, ...), and
    `max_tokens` itself: a step pads by at most a third past 256 tokens."""
    buckets, b = [], MIN_BUCKET
    while b < max_tokens:
        buckets.append(b)
        b = b * 2 if b < 256 else b * 4 // 3 if b & (b - 1) else b * 3 // 2
    return buckets + [max_tokens]


def buffer_bytes(args: ModelArgs, max_tokens: int, dtype: torch.dtype) -> int:
    """Device bytes of the static buffers for steps of up to `max_tokens` tokens."""
    d = args.head_dim
    width = (args.num_heads + 2 * args.num_kv_heads) * d + args.num_heads * d + 2 * args.hidden_size
    elem = torch.empty((), dtype=dtype).element_size()
    # the whole graphs' held outputs: every bucket's hidden states, under 3 × the largest's
    held = 3 * args.hidden_size * elem
    return max_tokens * (width * elem + held + 32)


class MixedStepGraphs:
    """The graphs of one model for every token bucket; `forward` runs a step through them."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        ops: Ops,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        from flashstack.engine.kernels.triton_attention import max_prefill_tiles

        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.block_size, self.max_model_len = block_size, max_model_len
        self.buckets = token_buckets(max(max_tokens, MIN_BUCKET))
        top, a, d = self.buckets[-1], model.args, model.args.head_dim
        self.ops = ops.for_tokens(top)  # the multi-token ops, the same for every bucket
        self.window = a.sliding_window
        self.max_seqs = min(max_num_seqs, top)
        i32, i64 = torch.int32, torch.int64
        # the step's inputs and attention metadata
        self.input_ids = torch.zeros(top, dtype=i64, device=device)
        self.positions = torch.zeros(top, dtype=i64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=i64, device=device)
        width = math.ceil(max_model_len / block_size)
        self.block_tables = torch.zeros(self.max_seqs, width, dtype=i32, device=device)
        self.context_lens = torch.ones(self.max_seqs, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(self.max_seqs + 1, dtype=i32, device=device)
        self.decode_lens = torch.ones(self.max_seqs, dtype=i32, device=device)
        self.tiles = torch.full(
            (2 * max_prefill_tiles(top, self.max_seqs),), -1, dtype=i32, device=device
        )
        # what the stretches pass each other (piecewise graphs)
        qkv_width = (a.num_heads + 2 * a.num_kv_heads) * d
        self.qkv = torch.zeros(top, qkv_width, dtype=dtype, device=device)
        self.heads = torch.zeros(top, a.num_heads * d, dtype=dtype, device=device)
        self.residual = torch.zeros(top, a.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, a.hidden_size, dtype=dtype, device=device)
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}
        self.whole_hidden: dict[int, torch.Tensor] = {}  # each whole graph's output, held
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each bucket's cos / sin
        self.pool = None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _num_tiles(self, n: int) -> int:
        from flashstack.engine.kernels.triton_attention import max_prefill_tiles

        return max_prefill_tiles(n, min(self.max_seqs, n))

    def _meta(self, n: int) -> AttentionMetadata:
        """Bucket n's attention metadata: views of the static buffers, the tile-mapped grid."""
        seqs = min(self.max_seqs, n)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:seqs],
            context_lens=self.context_lens[:seqs],
            query_start_loc=self.query_start_loc[: seqs + 1],
            block_size=self.block_size,
            max_query_len=n,
            max_context_len=self.max_model_len,
            query_lens_host=[n],
            context_lens_host=[n],
            grid_context_len=self.max_model_len,
            prefill_tiles=self.tiles[: 2 * self._num_tiles(n)],
            decode_lens=self.decode_lens[:seqs],
        )

    def _whole(self, n: int) -> None:
        self.whole_hidden[n] = self.model(
            self.input_ids[:n], self.positions[:n], self._meta(n), self.kv_caches, self.ops
        )

    def _first(self, n: int) -> None:
        """Embedding, rotary, the first layer's norm and q/k/v projection."""
        decoder = self.model.model
        h, self.rope[n] = decoder.embed(self.input_ids[:n], self.positions[:n])
        qkv, residual = decoder.layers[0].attention_input(h, None, self.ops)
        self.qkv[:n].copy_(qkv)
        self.residual[:n].copy_(residual)

    def _stretch(self, n: int, i: int) -> None:
        """Layer i after its attention, then layer i + 1 up to its attention (or the final norm)."""
        decoder = self.model.model
        h, residual = decoder.layers[i].after_attention(self.heads[:n], self.residual[:n], self.ops)
        if i + 1 == len(decoder.layers):
            self.hidden[:n].copy_(self.ops.final_norm(decoder.norm, h, residual))
            return
        qkv, residual = decoder.layers[i + 1].attention_input(h, residual, self.ops)
        self.qkv[:n].copy_(qkv)
        self.residual[:n].copy_(residual)

    def _stretches(self, n: int) -> list:
        layers = len(self.model.model.layers)
        return [lambda: self._first(n)] + [lambda i=i: self._stretch(n, i) for i in range(layers)]

    def _capture(self, run) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into `pool` (shared with the decode graphs: only
        one graph runs at a time, and what a graph leaves behind in it, its output and the
        stretches' rotary tables, stays held). Stretches only for buckets a step whose chunks all
        take torch's fused attention can need."""
        self.pool = pool
        piecewise = self.window is None
        for n in reversed(self.buckets):
            runs = [lambda n=n: self._whole(n)]
            if piecewise and n >= SDPA_MIN_QUERY_LEN:
                runs += self._stretches(n)
            for run in runs:  # warm-up: Triton compiles and autotunes outside the capture
                run()
            torch.cuda.synchronize(self.device)
            graphs = [self._capture(run) for run in runs]
            self.whole[n] = graphs[0]
            if len(graphs) > 1:
                self.pieces[n] = graphs[1:]
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Destroy every graph."""
        torch.cuda.synchronize(self.device)
        for graph in [*self.whole.values(), *(g for gs in self.pieces.values() for g in gs)]:
            graph.reset()
        self.whole.clear()
        self.whole_hidden.clear()
        self.pieces.clear()
        self.rope.clear()
        self.pool = None

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a step of n ≤ max_tokens packed tokens."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if sdpa_prefill_applies(meta, self.window):
            return self._piecewise(bucket, n, meta)
        return self._replay_whole(bucket, n, meta)

    def _replay_whole(self, bucket: int, n: int, meta: AttentionMetadata) -> torch.Tensor:
        from flashstack.engine.kernels.triton_attention import prefill_tiles

        seqs, width = meta.block_tables.shape
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)
        self.block_tables[:seqs, :width].copy_(meta.block_tables)
        self.context_lens[:seqs].copy_(meta.context_lens)
        self.query_start_loc[: seqs + 1].copy_(meta.query_start_loc)
        decodes = meta.decode_rows
        tiles = prefill_tiles(meta.query_lens_host, self._num_tiles(bucket), skip=decodes)
        lens = meta.context_lens_host[:decodes]
        pad = min(self.max_seqs, bucket) - decodes
        i32 = torch.int32
        tiles_d, lens_d = to_device_parts([(tiles, i32), (lens + [1] * pad, i32)], self.device)
        self.tiles[: tiles_d.numel()].copy_(tiles_d)
        self.decode_lens[: lens_d.numel()].copy_(lens_d)
        self.whole[bucket].replay()
        return self.whole_hidden[bucket][:n]

    def _piecewise(self, bucket: int, n: int, meta: AttentionMetadata) -> torch.Tensor:
        graphs = self.pieces[bucket]
        cos, sin = self.rope[bucket]
        rope = (cos[:n], sin[:n])
        graphs[0].replay()
        for i, (layer, kv_cache) in enumerate(zip(self.model.model.layers, self.kv_caches)):
            heads = self.ops.attend(layer.self_attn, self.qkv[:n], rope, meta, kv_cache)
            self.heads[:n].copy_(heads)
            graphs[i + 1].replay()
        return self.hidden[:n]
