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
from flashstack.engine.kv_cache import allocate_kv_cache, resolve_kv_dtype
from flashstack.engine.mixed_graphs import MixedStepGraphs
from flashstack.engine.models import LlamaForCausalLM, ModelArgs
from flashstack.engine.models.ops import select_ops
from flashstack.engine.sampling import (
    SamplingParams,
    draw_seed,
    graph_temperatures,
    needs_host,
    sample,
    sample_on_device,
)
from flashstack.engine.scheduler import ScheduledBatch
from flashstack.engine.sequence import Sequence
from flashstack.engine.staging import to_device, to_device_parts, to_host
from flashstack.engine.step import ShareInputs, StepBroadcast, StepInputs
from flashstack.engine.swap import SwapSpace

if TYPE_CHECKING:
    from flashstack.cuda.torch_interop import HostCopy
    from flashstack.engine.input_ring import TokensRead


def mixed_graph_tokens(config: EngineConfig) -> int:
    """The largest step the mixed-step graphs take (0: none): one GPU only, as a tensor-parallel
    group's ranks run eager steps in lockstep through `execute`."""
    if config.tensor_parallel_size > 1:
        return 0
    return min(config.mixed_step_graph_tokens, config.max_num_batched_tokens)


def slots_of(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """KV slots of positions start..end-1: a range per block, not a division per token."""
    slots: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1 if end > start else 0):
        lo, hi = max(start, b * block_size), min(end, (b + 1) * block_size)
        base = block_table[b] * block_size - b * block_size
        slots.extend(range(base + lo, base + hi))
    return slots


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem


@dataclass(slots=True)
class PendingStep:
    """A step queued on the device whose tokens the host has not read yet."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # int64 on the device, a row per sampling sequence: next step's input ids
    # the tokens' copy into pinned host memory (or the graph's own write there); None on the CPU
    host: HostCopy | TokensRead | None
    # The batch positions the rows of `tokens` belong to, ascending; None: every sequence's.
    rows: list[int] | None = None

    def wait(self) -> list[int | None]:
        """A token per sequence of the batch (None: its prompt chunk samples nothing), once the
        device has produced them."""
        values = self.host.wait() if self.host is not None else self.tokens.tolist()
        if self.rows is None:
            return values
        sampled: list[int | None] = [None] * len(self.batch.seqs)
        for row, token_id in zip(self.rows, values):
            sampled[row] = token_id
        return sampled


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
        self.kv_cache = allocate_kv_cache(
            (a.num_layers, num_blocks, 2, config.block_size, a.num_kv_heads, a.head_dim),
            resolve_kv_dtype(config.kv_cache_dtype, dtype, device),
            device,
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
            # a group's ranks take rank 0's inputs (share_inputs, or NCCL before each replay)
            fetch_inputs=self.config.kernels.graph_fetches_inputs
            and self.config.tensor_parallel_size == 1,
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
        self, batch: ScheduledBatch, ahead: list[int] | None
    ) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """(ids, positions, slots, context lengths) of a plain decode step, or None when the batch
        is not one. `ahead`: the step after the leading sequences' current one, which computes
        ahead[i] tokens of sequence i; their ids (0 here) come from the device, the slots are
        allocated (Scheduler.lookahead). The sequences past them decode the host's tokens (the
        streams a burst's last step left out)."""
        if batch.in_flight is not None:
            return None  # prompt chunks behind a burst step's
        bs = self.config.block_size
        offsets = ahead or []
        ids, positions, slots, lens = [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            off = offsets[i] if i < len(offsets) else 0
            p = seq.num_computed_tokens + off
            if n != 1 or p + 1 != len(seq.token_ids) + int(off > 0):
                return None
            ids.append(0 if off else seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
        return ids, positions, slots, lens

    def _graph_logits(
        self,
        batch: ScheduledBatch,
        ids_from: torch.Tensor | None = None,
        picks: list[int] | None = None,
        ahead: list[int] | None = None,
        temperatures: list[float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(logits, the graph's tokens or None) from a graph replay (DecodeGraphs.run) when the
        batch is a plain decode step that fits one; the graph draws at `temperatures` where it
        samples, else it takes the argmax."""
        graphs = self.graphs
        if graphs is None or len(batch.seqs) > graphs.max_batch:
            return None
        rows = self._decode_rows(batch, ahead)
        if rows is None:
            return None
        ids, positions, slots, lens = rows
        tables = [s.block_table for s in batch.seqs]
        seed = draw_seed() if temperatures is not None else 0
        return graphs.run(ids, positions, slots, tables, lens, ids_from, temperatures, seed, picks)

    def _graph_temperatures(self, params: list[SamplingParams]) -> list[float] | None:
        """The rows' temperatures where the decode graph draws this step's tokens itself
        (KernelOptions.sample_in_graph); None where it does not, or where every row is greedy
        (the graph then takes the argmax)."""
        graphs = self.graphs
        if graphs is None or not graphs.sample_in_graph or all(p.greedy for p in params):
            return None
        return graph_temperatures(params, self.model.args.vocab_size)

    def _eager_decode_logits(
        self, batch: ScheduledBatch, ids_from: torch.Tensor | None, ahead: list[int] | None
    ) -> torch.Tensor | None:
        if not self.peers.queues_eager_steps:  # the other ranks get eager steps through `execute`
            return None
        rows = self._decode_rows(batch, ahead)
        if rows is None:
            return None
        ids, positions, slots, lens = rows
        i64 = torch.int64
        meta, (ids_d, positions_d) = self._metadata(
            batch.seqs, slots, [1] * len(ids), lens, [(ids, i64), (positions, i64)]
        )
        input_ids = ids_d
        if ids_from is not None and ids_from.shape[0] == len(ids):
            input_ids = ids_from  # every row decodes the previous step's token
        elif ids_from is not None:  # the leading rows do; the rest, the host's tokens
            ids_d[: ids_from.shape[0]].copy_(ids_from)
        hidden = self.model(input_ids, positions_d, meta, self.kv_caches, self.ops)
        return self.model.compute_logits(hidden, self.ops)

    def can_launch(self, batch: ScheduledBatch) -> bool:
        """True when `launch` can queue this batch without reading anything back: no swaps, and
        no row needs the host between steps. A step with prompt chunks only on one GPU: a
        tensor-parallel group's ranks get those through `execute`."""
        return (
            bool(batch.seqs)
            and not (batch.swap_out or batch.swap_in)
            and not any(needs_host(s.params) for s in batch.seqs)
            and (self.peers.queues_eager_steps or all(n == 1 for n in batch.num_new_tokens))
        )

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: PendingStep | None = None) -> PendingStep | None:
        """Queue a step and its sampling on the device without waiting for them; None when the
        batch is not one `can_launch` accepts (then `execute` runs it).

        With `after`, the batch is the step following `after` (Scheduler.lookahead): the input ids
        of its leading sequences are `after`'s sampled tokens, taken on the device, so it is
        queued before the host has read them and the device never waits for the host between
        the two.
        """
        if not self.can_launch(batch):
            return None
        ids_from, picks, ahead = None, None, None
        rows = batch.lookahead_rows if after is not None else None
        if after is not None:
            assert rows is not None, "a step queued behind another comes from Scheduler.lookahead"
        if after is not None and rows:  # none: prompt chunks only, no input waits for `after`
            picks = rows
            if after.rows is not None:  # a token row per sequence `after` sampled, in its order
                index = {row: i for i, row in enumerate(after.rows)}
                picks = [index[row] for row in rows]
            ids_from = after.tokens
            if len(picks) == after.tokens.shape[0]:  # ascending: the same length, every row
                picks = None
            ahead = [after.batch.num_new_tokens[r] for r in rows]
        seqs = batch.seqs
        params = [s.params for s in seqs]
        temperatures = self._graph_temperatures(params)
        replayed = self._graph_logits(batch, ids_from, picks, ahead, temperatures)
        if picks is not None and replayed is None:  # eager steps take the picked rows
            ids_from = ids_from[self._tensor(picks, torch.int64)]
        if replayed is not None:
            logits, tokens = replayed
            if tokens is not None and (temperatures is not None or all(p.greedy for p in params)):
                # the graph drew the tokens, or took the argmax of greedy rows (can_launch leaves
                # no penalties): nothing to launch; with a ring, the graph wrote them to the host
                read = self.graphs.tokens_read(len(tokens)) if self.graphs is not None else None
                return PendingStep(batch, tokens, read or to_host(tokens))
        else:
            logits = self._eager_decode_logits(batch, ids_from, ahead)
        if logits is None:
            return self._launch_mixed(batch, ids_from, ahead)
        tokens = sample_on_device(
            logits, params, lambda i: ([], []), [self._generator(s) for s in seqs]
        )
        return PendingStep(batch, tokens, to_host(tokens))

    def _launch_mixed(
        self, batch: ScheduledBatch, ids_from: torch.Tensor | None, ahead: list[int] | None
    ) -> PendingStep | None:
        """Queue a step with prompt chunks (or an eager decode step of a tensor-parallel group's
        rank 0, which `execute` must run: None)."""
        if not self.peers.queues_eager_steps:
            return None
        inputs = self.prepare(batch, ahead)
        if ids_from is not None:  # the leading rows: the previous step's tokens
            inputs.input_ids[: ids_from.shape[0]].copy_(ids_from)
        hidden = self._forward(inputs)
        seqs = [batch.seqs[i] for i in inputs.sample_seqs]
        if seqs:
            logits = self.model.compute_logits(hidden[inputs.sample_rows], self.ops)
            params, gens = [s.params for s in seqs], [self._generator(s) for s in seqs]
            tokens = sample_on_device(logits, params, lambda i: ([], []), gens)
        else:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        return PendingStep(batch, tokens, to_host(tokens), rows=inputs.sample_seqs)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare(self, batch: ScheduledBatch, ahead: list[int] | None = None) -> StepInputs:
        """Pack the batch's new tokens and attention metadata, the one-token rows first (a mixed
        step's graph gives them to the decode kernel: mixed_graphs.py). `ahead`: the leading
        sequences are a step past their computed tokens by ahead[i] (a lookahead step), their
        ids 0 here (the caller fills them in on the device); `batch.in_flight`: prompt chunks
        that start past a queued step's. Sampled rows in batch order."""
        bs = self.config.block_size
        offsets = ahead or []
        queued = batch.in_flight or [0] * len(batch.seqs)
        input_ids, positions, slot_mapping, samples = [], [], [], []
        query_lens, context_lens = [], []
        lens = batch.num_new_tokens
        order = [i for i, n in enumerate(lens) if n == 1] + [
            i for i, n in enumerate(lens) if n != 1
        ]
        for i in order:
            seq, n = batch.seqs[i], lens[i]
            off = offsets[i] if i < len(offsets) else 0
            start = seq.num_computed_tokens + off + queued[i]
            end = start + n
            input_ids.extend(seq.token_ids[start:end] if not off else [0] * n)
            positions.extend(range(start, end))
            slot_mapping.extend(slots_of(seq.block_table, bs, start, end))
            query_lens.append(n)
            context_lens.append(end)
            # the chunk reaches the last token (ahead: the one being sampled): it picks the next
            if end == len(seq.token_ids) + int(off > 0):
                samples.append((i, len(input_ids) - 1))
        samples.sort()
        sample_seqs = [i for i, _ in samples]
        sample_rows = [row for _, row in samples]
        i64 = torch.int64
        meta, (ids_d, positions_d, sample_rows_d) = self._metadata(
            [batch.seqs[i] for i in order],
            slot_mapping,
            query_lens,
            context_lens,
            [(input_ids, i64), (positions, i64), (sample_rows, i64)],
        )
        meta.decode_rows = query_lens.count(1)
        return StepInputs(ids_d, positions_d, meta, sample_rows_d, sample_seqs)

    def _metadata(
        self,
        seqs: list[Sequence],
        slot_mapping: list[int],
        query_lens: list[int],
        context_lens: list[int],
        extra: list[tuple[list[int], torch.dtype]],
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """Device attention inputs for packed queries (block tables padded with 0 to the
        longest), and the `extra` lists on the device, all through one host-to-device copy."""
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        starts = list(itertools.accumulate(query_lens, initial=0))
        i32 = torch.int32
        parts = [(slot_mapping, torch.int64), (tables, i32), (context_lens, i32), (starts, i32)]
        slots, tables_d, lens_d, starts_d, *rest = to_device_parts(parts + extra, self.device)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables_d,
            context_lens=lens_d,
            query_start_loc=starts_d,
            block_size=self.config.block_size,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )
        return meta, rest

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
        replayed = self._graph_logits(batch)
        if replayed is not None:
            logits = replayed[0]  # sample() below reads the tokens back itself
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
