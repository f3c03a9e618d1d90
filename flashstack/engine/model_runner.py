"""Runs a scheduled batch: packs tokens, slot_mapping, block_tables; runs the model; samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashstack.engine.config import EngineConfig
from flashstack.engine.cuda_graphs import DecodeGraphs
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend
from flashstack.engine.models import LlamaForCausalLM, ModelArgs
from flashstack.engine.sampling import sample
from flashstack.engine.scheduler import ScheduledBatch
from flashstack.engine.sequence import Sequence
from flashstack.engine.swap import SwapSpace


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem


@dataclass(slots=True)
class StepInputs:
    """Device tensors for one forward pass, plus which rows get sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the packed tokens whose logits are sampled
    sample_seqs: list[int]  # positions in batch.seqs that sample this step


class ModelRunner:
    """Owns the model and the KV cache; turns a ScheduledBatch into sampled token ids."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config, self.model, self.device, self.dtype = config, model, device, dtype
        a = model.args
        # [layers, blocks, K|V, block_size, kv_heads, head_dim]: one block of one layer is
        # contiguous.
        self.kv_cache = torch.zeros(
            a.num_layers,
            num_blocks,
            2,
            config.block_size,
            a.num_kv_heads,
            a.head_dim,
            dtype=dtype,
            device=device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.backend = get_attention_backend(config.attention_backend, device)
        self.graphs: DecodeGraphs | None = None
        self.swap_space: SwapSpace | None = None

    def enable_swap(self, num_host_blocks: int) -> None:
        """Give the runner a host KV pool of `num_host_blocks` blocks for swap preemption."""
        self.swap_space = SwapSpace(self.kv_cache, num_host_blocks)

    def capture_graphs(self, max_model_len: int, on_bucket=None) -> None:
        """Capture decode CUDA graphs for every batch bucket (CUDA and a graph-safe backend only)."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.config.block_size,
                                   max_model_len, self.config.max_num_seqs, self.device)
        self.graphs.capture(on_bucket)

    def release_graphs(self) -> None:
        """Free the decode graphs (back to eager); a tensor-parallel group can then be torn down."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _graph_logits(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Logits from a graph replay when the batch is a plain decode step that fits one."""
        graphs = self.graphs
        if graphs is None or len(batch.seqs) > graphs.max_batch or any(n != 1 for n in batch.num_new_tokens):
            return None
        bs = self.config.block_size
        ids, positions, slots, tables, lens = [], [], [], [], []
        for seq in batch.seqs:
            p = seq.num_computed_tokens
            if p + 1 != len(seq.token_ids):
                return None
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
            lens.append(p + 1)
        return graphs.run(ids, positions, slots, tables, lens)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the batch's new tokens and attention metadata."""
        bs = self.config.block_size
        input_ids, positions, slot_mapping, sample_rows, sample_seqs = [], [], [], [], []
        query_start, query_lens, context_lens = [0], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            query_start.append(query_start[-1] + n)
            if end == len(
                seq.token_ids
            ):  # the chunk reaches the last token: its logits pick the next one
                sample_rows.append(query_start[-1] - 1)
                sample_seqs.append(i)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            query_start_loc=self._tensor(query_start, torch.int32),
            block_size=bs,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )
        return StepInputs(
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(sample_rows, torch.int64),
            sample_seqs,
        )

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run the batch; a sampled token per sequence whose prefill is complete, else None."""
        if batch.swap_out or batch.swap_in:
            assert self.swap_space is not None, "the scheduler swapped without a host pool"
            self.swap_space.swap(batch.swap_out, batch.swap_in)
        if not batch.seqs:
            return []
        logits = self._graph_logits(batch)
        if logits is not None:
            sample_seqs = list(range(len(batch.seqs)))
        else:
            inputs = self.prepare(batch)
            hidden = self.model(
                inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, self.backend
            )
            sample_seqs = inputs.sample_seqs
            if sample_seqs:
                logits = self.model.compute_logits(hidden[inputs.sample_rows])
        sampled: list[int | None] = [None] * len(batch.seqs)
        if not sample_seqs:
            return sampled
        seqs = [batch.seqs[i] for i in sample_seqs]
        result = sample(
            logits,
            [s.params for s in seqs],
            lambda i: (seqs[i].prompt_token_ids, seqs[i].output_token_ids),
            [self._generator(s) for s in seqs],
        )
        for i, seq, token_id, lp in zip(sample_seqs, seqs, result.token_ids, result.logprobs):
            sampled[i] = token_id
            if lp is not None:
                seq.logprobs.append(lp)
        return sampled
