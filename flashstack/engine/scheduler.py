"""Continuous batching: decode first, chunked prefill under a token budget (a smaller one beside
running decodes; a burst's prompts ahead of the decodes), swap or recompute preemption."""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Iterator
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
    # Set by Scheduler.lookahead: for each of the leading sequences, its row in the previous step,
    # whose sampled token is this step's input (the sequences after them are admissions).
    lookahead_rows: list[int] | None = None
    # Set by Scheduler.lookahead over a prompt chunk in flight: per sequence, the prompt tokens
    # that the step queued before this one computes first; its chunk starts past them.
    in_flight: list[int] | None = None
    burst: bool = False  # prompts only, the running decodes sitting it out (burst_prefill_steps)

    @property
    def num_tokens(self) -> int:
        """Tokens this step puts through the model."""
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        # A step may only swap (every running sequence preempted): its copies must still run.
        return bool(self.seqs or self.swap_out or self.swap_in)


@dataclass(slots=True)
class StepBudget:
    """What a step may still take: tokens in all, and of those, prompt tokens (chunks of more than
    one token; a decode is one)."""

    tokens: int
    prefill: int

    def allows(self, wanted: int) -> int:
        """How many of the `wanted` tokens of one sequence fit (0: none)."""
        return min(wanted, self.tokens if wanted == 1 else min(self.tokens, self.prefill))

    def take(self, wanted: int, n: int) -> None:
        """Spend `n` tokens on a sequence that wanted `wanted`."""
        self.tokens -= n
        if wanted > 1:
            self.prefill -= n

    def __bool__(self) -> bool:
        return self.tokens > 0


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
        self.burst_steps = 0  # steps in a row the running decodes sat out (burst_prefill_steps)

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
        """This step's batch: running sequences (decodes before chunk tails), then admissions; in
        a burst, prompts only (see `burst_prefill_steps`)."""
        decoding = any(seq.num_uncomputed_tokens == 1 for seq in self.running)
        queued = sum(n for seq in self.running if (n := seq.num_uncomputed_tokens) > 1)
        if decoding and self._in_burst(queued):
            batch = self._schedule_burst()
            if batch:
                self.burst_steps += 1
                batch.burst = True
                return batch
        self.burst_steps = 0
        batch = ScheduledBatch()
        tokens = self.config.max_num_batched_tokens
        budget = StepBudget(tokens, self._prefill_budget(decoding, queued))
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            budget = self._schedule_swapped(batch, budget)
            # Swapped sequences come back before new ones are admitted, or they could starve.
            if not self.swapped:
                self._schedule_waiting(batch, budget)
        return batch

    def _in_burst(self, queued: int) -> bool:
        """True when the next step may leave the running decodes out: two or more waiting
        requests have free slots (a single long prompt is chunked beside the streams), the
        prompts queued (chunk tails' `queued` and the waiting ones a slot can take) are over one
        full step, nothing is swapped out, no stream outranks the queue (priority policy), and
        the streams have not yet sat out `burst_prefill_steps` steps in a row."""
        cfg = self.config
        # Only the requests a free slot can take count: one admission at a time (a loaded
        # server's queue behind full slots) rides along with the decodes instead.
        free = cfg.max_num_seqs - len(self.running)
        if min(len(self.waiting), free) < 2 or self.swapped:
            return False
        if self.burst_steps >= cfg.burst_prefill_steps:
            return False
        if cfg.scheduling_policy == "priority" and self._outranked_by_running():
            return False
        return self._queue_over(queued, cfg.max_num_batched_tokens, free)

    def _outranked_by_running(self) -> bool:
        # A stream served before the queue's first request never waits for that queue. (0
        # uncomputed: a prompt that a step in flight completes, a stream from then on.)
        head = self.waiting[0].priority
        return any(seq.priority < head for seq in self.running if seq.num_uncomputed_tokens <= 1)

    def _queue_over(self, queued: int, tokens: int, first: int | None = None) -> bool:
        # Of the `first` waiting requests (None: all); stops at `tokens`: a burst's queue is long.
        for seq in itertools.islice(self.waiting, first):
            queued += seq.num_uncomputed_tokens
            if queued > tokens:
                return True
        return queued > tokens

    def _schedule_burst(self) -> ScheduledBatch:
        """A step of prompts only: chunk tails, then admissions, under the whole token budget.
        Empty when none can run (no free slot or block): the decodes then run as usual."""
        batch = ScheduledBatch()
        tokens = self.config.max_num_batched_tokens
        decodes = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        self.running = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        budget = self._schedule_running(batch, StepBudget(tokens, tokens))
        self.running += decodes  # they keep their blocks and run again once the burst is in
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _prefill_budget(self, decoding: bool, queued: int) -> int:
        """Prompt tokens a step may take (`queued`: prompt tokens of running chunk tails; the
        waiting queue's are added here). Beside decodes, `decode_step_prefill_tokens` while the
        queued prompts fit in one full step: a new prompt then costs the streams a few short steps
        instead of one long one (their inter-token tail), as Sarathi-Serve's token budget does. A
        deeper queue (a burst) gets the whole budget: there, throughput and the queued requests'
        first tokens come first."""
        cfg = self.config
        cap, full = cfg.decode_step_prefill_tokens, cfg.max_num_batched_tokens
        if not cap or cap >= full or not cfg.enable_chunked_prefill or not decoding:
            return full
        return full if self._queue_over(queued, full) else cap

    def lookahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step after `batch`, scheduled while `batch` still runs (its tokens unknown): every
        sequence `batch` samples for decodes one position further, less those `batch` certainly
        finishes (a length limit), a prompt `batch` leaves unfinished takes its next chunk past
        the one in flight (`in_flight`), and waiting sequences are admitted into what budget is
        left. None whenever the step after could differ from that: a chunk tail sits `batch` out,
        sequences are swapped out, or a new block is not free for every sequence (a preemption
        may be due). Where the step after is a burst's (prompts only), it is that step
        (`_burst_ahead`); where `batch` is a burst's last, the streams that sat it out decode in
        the step after too, their inputs the host's tokens (both with `burst_lookahead`).

        The slots are allocated here. A sequence that `batch` ends on a stop token or string
        still runs in the lookahead step; its row is dropped afterwards, and its blocks are only
        reused by work queued after that step.
        """
        if self.swapped or batch.preempted or batch.swap_out or batch.swap_in:
            return None
        if self._burst_next(batch):  # the next step takes the burst's prompts, not these decodes
            return self._burst_ahead(batch) if self.config.burst_lookahead else None
        if (batch.burst and not self.config.burst_lookahead) or self._in_burst(0):
            return None  # (a burst's prompts without decodes: schedule() gives them every token)
        # `batch` may itself be a lookahead step holding rows of sequences that ended meanwhile.
        live = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
        sat_out = self._sat_out(batch, live)
        if sat_out is None:
            return None
        # A sequence whose chunk reaches its last token samples in `batch` and decodes next, its
        # input the token sampled (a row); one whose prompt goes on (a chunk tail) takes its next
        # chunk past the one in flight, its ids the prompt's.
        rows, tails = [], []
        for i in live:
            seq = batch.seqs[i]
            if batch.num_new_tokens[i] < seq.num_uncomputed_tokens:
                tails.append(seq)
            elif not self._ends_next(seq):
                rows.append(i)
        if not rows and not tails and not sat_out:
            return None
        seqs = [batch.seqs[i] for i in rows]
        tokens = self.config.max_num_batched_tokens - len(seqs) - len(sat_out)
        budget = StepBudget(tokens, self._prefill_budget(True, 0))
        chunks: list[tuple[Sequence, int]] = []
        if tails:
            with _computed(batch):
                queued = sum(seq.num_uncomputed_tokens for seq in tails)
                budget = StepBudget(tokens, self._prefill_budget(True, queued))
                chunks = _next_chunks(tails, budget)
        # Past the computed tokens: `batch`'s, then the lookahead step's.
        ahead = [batch.num_new_tokens[i] + 1 for i in rows]
        sent = _sent(batch) if chunks else {}
        needed = list(zip(seqs, ahead)) + [(seq, 1) for seq in sat_out]
        needed += [(seq, sent[seq.seq_id] + n) for seq, n in chunks]
        if not self._allocate(needed):
            return None
        # the rows first: their ids are `batch`'s samples, the leading inputs (ModelRunner.launch)
        step = ScheduledBatch(seqs, [1] * len(seqs), lookahead_rows=rows)
        for seq in sat_out:
            self._add_to_batch(step, seq, 1)
        if chunks:
            with _computed(batch):
                for seq, n in chunks:
                    self._add_to_batch(step, seq, n)
        self.burst_steps = 0  # the streams decode in it: their steps sat out are no longer in a row
        if self.waiting:
            self._schedule_waiting(step, budget)
        if chunks:  # the rows' offsets are `ahead`, passed to the runner by `launch`
            tail_ids = {seq.seq_id for seq, _ in chunks}
            step.in_flight = [sent[s.seq_id] if s.seq_id in tail_ids else 0 for s in step.seqs]
        return step

    def _allocate(self, needed: list[tuple[Sequence, int]]) -> bool:
        """Slots for (sequence, tokens past its computed ones) each, or none at all and False
        where the free blocks do not hold them all."""
        bm = self.block_manager
        if sum(bm.num_blocks_needed(seq, n) for seq, n in needed) > bm.num_free_blocks:
            return False
        for seq, n in needed:
            bm.append_slots(seq, n)
        return True

    def _burst_next(self, batch: ScheduledBatch) -> bool:
        """Whether schedule() makes the step after `batch` a burst's (prompts only), `batch`'s
        tokens counted as computed."""
        if len(self.waiting) < 2:
            return False  # no burst (_in_burst), and the decode steps' lookahead costs no more
        with _computed(batch):
            decoding = any(seq.num_uncomputed_tokens <= 1 for seq in self.running)
            queued = sum(n for seq in self.running if (n := seq.num_uncomputed_tokens) > 1)
            return decoding and self._in_burst(queued)

    def _sat_out(self, batch: ScheduledBatch, live: list[int]) -> list[Sequence] | None:
        """The running sequences `batch` leaves out (`live`: its rows still running): the streams
        a burst's step leaves to decode after it, their next input known to the host. None where
        one is a chunk tail waiting a step, which schedule() places."""
        if len(live) == len(self.running):
            return []  # every running sequence is in `batch`: the decode steps' path
        ids = {batch.seqs[i].seq_id for i in live}
        sat_out = [seq for seq in self.running if seq.seq_id not in ids]
        if len(sat_out) + len(live) != len(self.running):
            return None
        return sat_out if all(seq.num_uncomputed_tokens == 1 for seq in sat_out) else None

    def _burst_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step after `batch` where it is a burst's (`_burst_next`), scheduled while `batch`
        still runs: none of its inputs is a token `batch` samples (the sequences `batch` samples
        for sit it out with the other streams), so it can be queued behind it. Its chunk tails
        start past `batch`'s chunks (`in_flight`). None where a chunk tail needs blocks that are
        not free (a preemption may be due)."""
        with _computed(batch):
            tokens = self.config.max_num_batched_tokens
            budget = StepBudget(tokens, tokens)
            tails = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
            chunks = _next_chunks(sorted(tails, key=self._running_order), budget)
            if not self._allocate(chunks):
                return None
            step = ScheduledBatch(lookahead_rows=[], burst=True)
            for seq, n in chunks:
                self._add_to_batch(step, seq, n)
            self._schedule_waiting(step, budget)
        if not step.seqs:
            return None
        self.burst_steps += 1
        sent = _sent(batch)
        step.in_flight = [sent.get(seq.seq_id, 0) for seq in step.seqs]
        return step

    def _ends_next(self, seq: Sequence) -> bool:
        # True when the token being sampled now ends `seq` by length, whatever it is.
        p = seq.params
        if p.max_tokens is not None and seq.num_output_tokens + 1 >= p.max_tokens:
            return True
        limit = self.config.max_model_len
        return limit is not None and len(seq) + 1 >= limit

    def _schedule_running(self, batch: ScheduledBatch, budget: StepBudget) -> StepBudget:
        bm = self.block_manager
        queue = sorted(self.running, key=self._running_order)
        kept: list[Sequence] = []
        idle: list[Sequence] = []  # chunk tails past this step's prompt tokens: they wait a step
        while queue and budget:
            seq = queue.pop(0)
            wanted = seq.num_uncomputed_tokens
            n = budget.allows(wanted)
            if n == 0:
                idle.append(seq)
                continue
            while bm.num_blocks_needed(seq, n) > bm.num_free_blocks and queue:
                self._preempt(queue.pop(), batch)  # the lowest-ranked running sequence
            if bm.num_blocks_needed(seq, n) > bm.num_free_blocks:
                self._preempt(seq, batch)
                break
            budget.take(wanted, n)
            bm.append_slots(seq, n)
            self._add_to_batch(batch, seq, n)
            kept.append(seq)
        self.running = kept + idle + queue
        return budget

    def _schedule_swapped(self, batch: ScheduledBatch, budget: StepBudget) -> StepBudget:
        # Never in a step that swaps out: a host block freed here must be read before it is reused.
        bm = self.block_manager
        while self.swapped and budget and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            wanted = seq.num_uncomputed_tokens
            n = budget.allows(wanted)
            if n == 0 or not bm.can_swap_in(seq, n):
                break
            budget.take(wanted, n)
            self.swapped.pop(0)
            batch.swap_in += bm.swap_in(seq)
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        bm = self.block_manager
        while self.waiting and budget and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            wanted = seq.num_uncomputed_tokens
            n = budget.allows(wanted)
            if n == 0 or (n < wanted and not self.config.enable_chunked_prefill):
                bm.free(seq)
                break
            if bm.num_blocks_needed(seq, n) > bm.num_free_blocks:
                bm.free(seq)
                break
            budget.take(wanted, n)
            bm.append_slots(seq, n)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)

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


@contextlib.contextmanager
def _computed(batch: ScheduledBatch) -> Iterator[None]:
    """While inside, `batch`'s chunks count as computed (a step scheduled behind it sees the state
    it leaves; the tokens it samples are not known yet)."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    try:
        yield
    finally:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens -= n


def _next_chunks(tails: list[Sequence], budget: StepBudget) -> list[tuple[Sequence, int]]:
    """Each prompt's next chunk, in order, while `budget` lasts (spending it)."""
    chunks = []
    for seq in tails:
        if n := budget.allows(seq.num_uncomputed_tokens):
            budget.take(seq.num_uncomputed_tokens, n)
            chunks.append((seq, n))
    return chunks


def _sent(batch: ScheduledBatch) -> dict[int, int]:
    """Tokens `batch` computes, by sequence id."""
    return dict(zip((seq.seq_id for seq in batch.seqs), batch.num_new_tokens))
