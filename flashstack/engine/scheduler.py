"""Continuous batching: decode first, chunked prefill under a token budget, swap or recompute
preemption."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from flashstack.engine.block_manager import BlockManager
from flashstack.engine.config import EngineConfig
from flashstack.engine.sequence import Sequence, SequenceStatus
from flashstack.engine.swap import PreemptionCost


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: sequence i runs `num_new_tokens[i]` tokens from its computed count on."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block copies
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) block copies
    # Set by Scheduler.lookahead: for each sequence, its row in the previous step, whose sampled
    # token is this step's input.
    lookahead_rows: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens this step puts through the model."""
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        # A step may only swap (every running sequence preempted): its copies must still run.
        return bool(self.seqs or self.swap_out or self.swap_in)


class Scheduler:
    """Decides, step by step, which sequences run and how many tokens each computes."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int],
        preemption_cost: PreemptionCost | None = None,  # None: always recompute
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # preempted with their K/V in the host pool
        self.preemption_cost = preemption_cost
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_chunked_prefills = 0

    def _order_key(self, seq: Sequence) -> tuple[int, float, int]:
        prio = seq.priority if self.config.scheduling_policy == "priority" else 0
        return (prio, seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new (or preempted) sequence in policy order."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order_key)

    def has_unfinished(self) -> bool:
        """True while any sequence waits, runs or is swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    @property
    def seqs(self) -> list[Sequence]:
        """Every live sequence."""
        return self.running + self.swapped + self.waiting

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request now and free its blocks; returns it, or None when it is not live."""
        for queue in (self.running, self.swapped, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.finish(seq, "abort", remove=False)
                    return seq
        return None

    def finish(self, seq: Sequence, reason: str, remove: bool = True) -> None:
        """Mark `seq` finished and release its blocks."""
        if remove and seq in self.running:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        if self._should_swap(seq):
            batch.swap_out += self.block_manager.swap_out(seq)
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=self._order_key)
            return
        # Recompute: drop the KV and re-prefill later (full blocks may come back from the cache).
        self.block_manager.free(seq)
        self.add(seq)

    def _should_swap(self, seq: Sequence) -> bool:
        cost, bm = self.preemption_cost, self.block_manager
        if cost is None or not bm.can_swap_out(seq):
            return False
        return cost.prefers_swap(bm.num_computed_blocks(seq), seq.num_computed_tokens)

    def _running_order(self, seq: Sequence) -> tuple[int, int, float, int]:
        prio, arrival, seq_id = self._order_key(seq)
        return (prio, int(seq.num_uncomputed_tokens > 1), arrival, seq_id)

    def schedule(self) -> ScheduledBatch:
        """This step's batch: running sequences (decodes before chunk tails), then admissions."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            budget = self._schedule_swapped(batch, budget)
            # Swapped sequences come back before new ones are admitted, or they could starve.
            if not self.swapped:
                self._schedule_waiting(batch, budget)
        return batch

    def lookahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch`, scheduled while `batch` still runs (its tokens unknown):
        the same sequences, one position further, minus those `batch` certainly finishes (a
        length limit). None whenever the step after could differ from that: sequences wait to be
        admitted or swapped in, `batch` did more than decode everyone running, or a new block
        is not free for every sequence (a preemption may be due).

        The slots are allocated here. A sequence that `batch` ends on a stop token or string
        still runs in the lookahead step; its row is dropped afterwards, and its blocks are only
        reused by work queued after that step.
        """
        if self.waiting or self.swapped or batch.preempted or batch.swap_out or batch.swap_in:
            return None
        if any(n != 1 for n in batch.num_new_tokens):
            return None
        # `batch` may itself be a lookahead step holding rows of sequences that ended meanwhile.
        live = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
        if len(live) != len(self.running):
            return None
        rows = [i for i in live if not self._ends_next(batch.seqs[i])]
        if not rows:
            return None
        seqs = [batch.seqs[i] for i in rows]
        bm = self.block_manager
        # Two tokens past the computed ones: `batch`'s token, then the lookahead step's.
        if sum(bm.num_blocks_needed(seq, 2) for seq in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.append_slots(seq, 2)
        return ScheduledBatch(seqs, [1] * len(seqs), lookahead_rows=rows)

    def _ends_next(self, seq: Sequence) -> bool:
        # True when the token being sampled now ends `seq` by length, whatever it is.
        p = seq.params
        if p.max_tokens is not None and seq.num_output_tokens + 1 >= p.max_tokens:
            return True
        limit = self.config.max_model_len
        return limit is not None and len(seq) + 1 >= limit

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        queue = sorted(self.running, key=self._running_order)
        kept: list[Sequence] = []
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed_tokens, budget)
            while bm.num_blocks_needed(seq, n) > bm.num_free_blocks and queue:
                self._preempt(queue.pop(), batch)  # the lowest-ranked running sequence
            if bm.num_blocks_needed(seq, n) > bm.num_free_blocks:
                self._preempt(seq, batch)
                break
            bm.append_slots(seq, n)
            self._add_to_batch(batch, seq, n)
            kept.append(seq)
            budget -= n
        self.running = kept + queue
        return budget

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        # Never in a step that swaps out: a host block freed here must be read before it is reused.
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_swap_in(seq, n):
                break
            self.swapped.pop(0)
            batch.swap_in += bm.swap_in(seq)
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            n = seq.num_uncomputed_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                bm.free(seq)
                break
            n = min(n, budget)
            if bm.num_blocks_needed(seq, n) > bm.num_free_blocks:
                bm.free(seq)
                break
            bm.append_slots(seq, n)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        if n < seq.num_uncomputed_tokens:
            self.num_chunked_prefills += 1
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance computed counts, append samples, finish on token-level stops; return finished."""
        finished = []
        for seq, n, token_id in zip(batch.seqs, batch.num_new_tokens, sampled):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if token_id is None:
                continue
            seq.token_ids.append(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                seq.stop_reason = token_id
                return "stop"
            if token_id in p.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length"
        if self.config.max_model_len is not None and len(seq) >= self.config.max_model_len:
            return "length"
        return None
