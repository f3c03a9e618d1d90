"""Runs a scheduled batch: packs tokens, slot_mapping, block_tables; runs the model; samples."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashstack.engine.config import EngineConfig
from flashstack.engine.cuda_graphs import DecodeGraphs
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend
from flashstack.engine.kv_cache import resolve_kv_dtype
from flashstack.engine.mixed_graphs import MixedStepGraphs
from flashstack.engine.models import LlamaForCausalLM, ModelArgs
from flashstack.engine.models.ops import select_ops
from flashstack.engine.sampling import needs_host, sample, sample_on_device
from flashstack.engine.scheduler import ScheduledBatch
from flashstack.engine.sequence import Sequence
from flashstack.engine.staging import to_device, to_host
from flashstack.engine.step import ShareInputs, StepBroadcast, StepInputs
from flashstack.engine.swap import SwapSpace

if TYPE_CHECKING:
    from flashstack.cuda.torch_interop import HostCopy


def mixed_graph_tokens(config: EngineConfig) -> int:
    """The largest step the mixed-step graphs take (0: none): one GPU only, as a tensor-parallel
    group's ranks run eager steps in lockstep through `execute`."""
    if config.tensor_parallel_size > 1:
        return 0
    return min(config.mixed_step_graph_tokens, config.max_num_batched_tokens)


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem


@dataclass(slots=True)
class PendingStep:
    """A decode step queued on the device whose tokens the host has not read yet."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # [len(batch.seqs)] int64 on the device: the next step's input ids
    host: HostCopy | None  # the tokens' copy into pinned host memory; None on the CPU

    def wait(self) -> list[int]:
        """The sampled tokens, once the device has produced them."""
        return self.host.wait() if self.host is not None else self.tokens.tolist()


class ModelRunner:
    """Owns the model and the KV cache; turns a ScheduledBatch into sampled token ids. `peers`:
    where each step goes for the other ranks of a tensor-parallel group (by default none)."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        peers: StepBroadcast | None = None,
    ) -> None:
        self.config, self.model, self.device, self.dtype = config, model, device, dtype
        self.peers = peers if peers is not None else StepBroadcast()
        weakref.finalize(self, self.peers.close)
        a = model.args
        # [layers, blocks, K|V, block_size, kv_heads, head_dim]: one block of one layer is
        # contiguous. fp8 (kv_cache_dtype): each layer's scales are on its attention module.
        self.kv_cache = torch.zeros(
            a.num_layers,
            num_blocks,
            2,
            config.block_size,
            a.num_kv_heads,
            a.head_dim,
            dtype=resolve_kv_dtype(config.kv_cache_dtype, dtype, device),
            device=device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.backend = get_attention_backend(config.attention_backend, device, config.kernels)
        self.ops = select_ops(device, self.backend, model.args.head_dim)  # once per device
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedStepGraphs | None = None
        self.swap_space: SwapSpace | None = None

    def enable_swap(self, num_host_blocks: int) -> None:
        """Give the runner a host KV pool of `num_host_blocks` blocks for swap preemption."""
        self.swap_space = SwapSpace(self.kv_cache, num_host_blocks)

    def capture_graphs(
        self, max_model_len: int, on_bucket=None, share_inputs: ShareInputs | None = None
    ) -> None:
        """Capture decode CUDA graphs for every batch bucket (CUDA and a graph-safe backend only),
        on every rank of a group at once. `share_inputs`: the first kernel of every graph (a
        tensor-parallel group's input broadcast; a rank other than 0 passes it, rank 0 gets it from
        its peers)."""
        if share_inputs is None:
            share_inputs = self.peers.before_capture(self, max_model_len)
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.ops,
            self.config.block_size,
            max_model_len,
            self.config.max_num_seqs,
            self.device,
        )
        self.graphs.share_inputs = share_inputs
        self.graphs.capture(on_bucket)
        self.graphs.before_replay = self.peers.replay_hook(share_inputs)
        tokens = mixed_graph_tokens(self.config)
        if tokens:
            self.mixed_graphs = MixedStepGraphs(
                self.model,
                self.kv_caches,
                self.ops,
                tokens,
                self.dtype,
                self.device,
                self.config.block_size,
                max_model_len,
                self.config.max_num_seqs,
            )
            self.mixed_graphs.capture(self.graphs.pool)

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel group, if any."""
        self.peers.close()

    def release_graphs(self) -> None:
        """Free the decode graphs (back to eager); a tensor-parallel group can then be torn down."""
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
            self.mixed_graphs = None
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _decode_rows(
        self, batch: ScheduledBatch, ahead: int
    ) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """(ids, positions, slots, context lengths) of a plain decode step, or None when the batch
        is not one. `ahead` = 1: the step after the sequences' current one, whose ids (0 here)
        come from the device; its slots must already be allocated (Scheduler.lookahead)."""
        bs = self.config.block_size
        ids, positions, slots, lens = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            p = seq.num_computed_tokens + ahead
            if n != 1 or p + 1 != len(seq.token_ids) + ahead:
                return None
            ids.append(0 if ahead else seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
        return ids, positions, slots, lens

    def _graph_logits(
        self, batch: ScheduledBatch, ids_from: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Logits from a graph replay when the batch is a plain decode step that fits one."""
        graphs = self.graphs
        if graphs is None or len(batch.seqs) > graphs.max_batch:
            return None
        rows = self._decode_rows(batch, ahead=int(ids_from is not None))
        if rows is None:
            return None
        ids, positions, slots, lens = rows
        return graphs.run(
            ids, positions, slots, [s.block_table for s in batch.seqs], lens, ids_from=ids_from
        )

    def _eager_decode_logits(
        self, batch: ScheduledBatch, ids_from: torch.Tensor | None
    ) -> torch.Tensor | None:
        if not self.peers.queues_eager_steps:  # the other ranks get eager steps through `execute`
            return None
        rows = self._decode_rows(batch, ahead=int(ids_from is not None))
        if rows is None:
            return None
        ids, positions, slots, lens = rows
        meta = self._metadata(batch.seqs, slots, [1] * len(ids), lens)
        input_ids = ids_from if ids_from is not None else self._tensor(ids, torch.int64)
        hidden = self.model(
            input_ids, self._tensor(positions, torch.int64), meta, self.kv_caches, self.ops
        )
        return self.model.compute_logits(hidden, self.ops)

    def can_launch(self, batch: ScheduledBatch) -> bool:
        """True when `launch` can queue this batch without reading anything back: a decode step
        (one token per sequence, no swaps) whose rows need no host between steps."""
        return (
            bool(batch.seqs)
            and not (batch.swap_out or batch.swap_in)
            and all(n == 1 for n in batch.num_new_tokens)
            and not any(needs_host(s.params) for s in batch.seqs)
        )

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: PendingStep | None = None) -> PendingStep | None:
        """Queue a decode step and its sampling on the device without waiting for them; None
        when the batch is not one `can_launch` accepts (then `execute` runs it).

        With `after`, the batch is the step following `after` (Scheduler.lookahead): its input ids
        are `after`'s sampled tokens, taken on the device, so it is queued before the host has
        read them and the device never waits for the host between the two.
        """
        if not self.can_launch(batch):
            return None
        ids_from = None
        if after is not None:
            assert batch.lookahead_rows is not None, (
                "a step queued behind another comes from Scheduler.lookahead"
            )
            ids_from = after.tokens
            if len(batch.lookahead_rows) != len(after.batch.seqs):
                ids_from = after.tokens[self._tensor(batch.lookahead_rows, torch.int64)]
        logits = self._graph_logits(batch, ids_from)
        if logits is None:
            logits = self._eager_decode_logits(batch, ids_from)
        if logits is None:
            return None
        seqs = batch.seqs
        tokens = sample_on_device(
            logits, [s.params for s in seqs], lambda i: ([], []), [self._generator(s) for s in seqs]
        )
        return PendingStep(batch, tokens, to_host(tokens))

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the batch's new tokens and attention metadata, the one-token rows first (a mixed
        step's graph gives them to the decode kernel: mixed_graphs.py)."""
        bs = self.config.block_size
        input_ids, positions, slot_mapping, sample_rows, sample_seqs = [], [], [], [], []
        query_lens, context_lens = [], []
        lens = batch.num_new_tokens
        order = [i for i, n in enumerate(lens) if n == 1] + [
            i for i, n in enumerate(lens) if n != 1
        ]
        for i in order:
            seq, n = batch.seqs[i], lens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            # the chunk reaches the last token: its logits pick the next one
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(i)
        meta = self._metadata(
            [batch.seqs[i] for i in order], slot_mapping, query_lens, context_lens
        )
        meta.decode_rows = query_lens.count(1)
        return StepInputs(
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(sample_rows, torch.int64),
            sample_seqs,
        )

    def _metadata(
        self,
        seqs: list[Sequence],
        slot_mapping: list[int],
        query_lens: list[int],
        context_lens: list[int],
    ) -> AttentionMetadata:
        """Device attention inputs for packed queries: block tables padded with 0 to the longest."""
        width = max(len(s.block_table) for s in seqs)
        return AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            block_tables=self._tensor(
                [s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32
            ),
            context_lens=self._tensor(context_lens, torch.int32),
            query_start_loc=self._tensor(
                list(itertools.accumulate(query_lens, initial=0)), torch.int32
            ),
            block_size=self.config.block_size,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of a step that is not a plain decode: through the mixed-step graphs when
        it fits them, else the model's eager forward pass."""
        graphs = self.mixed_graphs
        if graphs is not None and inputs.input_ids.shape[0] <= graphs.max_tokens:
            return graphs.forward(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, self.ops)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    @staticmethod
    def _matcher(seq: Sequence):
        """The sequence's grammar walker, made on its first sample (its params carry the guide)."""
        if seq.params.guide is None:
            return None
        if seq.matcher is None:
            seq.matcher = seq.params.guide.matcher()
        return seq.matcher

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
            self.peers.send(inputs)
            hidden = self._forward(inputs)
            sample_seqs = inputs.sample_seqs
            if sample_seqs:
                logits = self.model.compute_logits(hidden[inputs.sample_rows], self.ops)
        sampled: list[int | None] = [None] * len(batch.seqs)
        if not sample_seqs:
            return sampled
        seqs = [batch.seqs[i] for i in sample_seqs]
        result = sample(
            logits,
            [s.params for s in seqs],
            lambda i: (seqs[i].prompt_token_ids, seqs[i].output_token_ids),
            [self._generator(s) for s in seqs],
            [self._matcher(s) for s in seqs],
        )
        for i, seq, token_id, lp in zip(sample_seqs, seqs, result.token_ids, result.logprobs):
            sampled[i] = token_id
            if lp is not None:
                seq.logprobs.append(lp)
        return sampled
