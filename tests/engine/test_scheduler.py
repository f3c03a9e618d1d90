"""Scheduler without a model: budgets, decode first, chunking, preemption, abort, priority."""

from __future__ import annotations

from flashstack.engine.block_manager import BlockManager
from flashstack.engine.config import EngineConfig
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.scheduler import Scheduler
from flashstack.engine.sequence import Sequence, SequenceStatus

EOS = 0


def make(num_blocks: int = 64, block_size: int = 4, **kw) -> Scheduler:
    cfg = EngineConfig(model="unused", block_size=block_size, max_model_len=1024, **kw)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), {EOS})


def seq(n: int, max_tokens: int = 4, priority: int = 0) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), priority=priority)


def step(s: Scheduler, token: int = 7):
    """One scheduler step with a fake model that samples `token` wherever a prefill is complete."""
    batch = s.schedule()
    sampled = [
        token if sq.num_computed_tokens + n == len(sq) else None
        for sq, n in zip(batch.seqs, batch.num_new_tokens)
    ]
    s.postprocess(batch, sampled)
    s.block_manager.check_invariants(s.seqs)
    return batch


def test_token_budget_and_chunked_prefill() -> None:
    s = make(max_num_batched_tokens=5)
    a = seq(12)
    s.add(a)
    sizes = [step(s).num_new_tokens for _ in range(3)]
    assert sizes == [[5], [5], [2]] and a.num_output_tokens == 1
    assert s.num_chunked_prefills == 2


def test_without_chunking_a_prompt_waits_for_a_full_budget() -> None:
    s = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = seq(6), seq(6)
    s.add(a)
    s.add(b)
    batch = step(s)
    assert batch.seqs == [a]  # b does not fit the remaining 2 tokens and is not chunked


def test_decode_first_then_admissions() -> None:
    s = make(max_num_batched_tokens=4)
    a = seq(3, max_tokens=10)
    s.add(a)
    step(s)
    b = seq(8)
    s.add(b)
    batch = step(s)
    assert batch.seqs[0] is a and batch.num_new_tokens == [1, 3]


def test_preemption_recomputes_and_finishes_everything() -> None:
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    seqs = [seq(7, max_tokens=6) for _ in range(2)]
    for q in seqs:
        s.add(q)
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions > 0
    assert all(q.finish_reason == "length" and q.num_output_tokens == 6 for q in seqs)
    assert s.block_manager.num_free_blocks == 5


def test_abort_frees_blocks_immediately() -> None:
    s = make(num_blocks=16)
    a, b = seq(9, max_tokens=50), seq(5, max_tokens=50)
    s.add(a)
    s.add(b)
    step(s)
    assert s.abort(a.request_id) is a
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort" and not a.block_table
    s.block_manager.check_invariants(s.seqs)
    assert s.abort("missing") is None
    s.abort(b.request_id)
    assert s.block_manager.num_free_blocks == 16 and not s.has_unfinished()


def test_priority_policy_admits_lowest_value_first() -> None:
    s = make(max_num_seqs=1, scheduling_policy="priority")
    low, high = seq(3, priority=5), seq(3, priority=-1)
    s.add(low)
    s.add(high)
    assert step(s).seqs == [high]
    fcfs = make(max_num_seqs=1)
    first, second = seq(3, priority=5), seq(3, priority=-1)
    fcfs.add(first)
    fcfs.add(second)
    assert step(fcfs).seqs == [first]


def test_priority_preemption_evicts_lowest_priority() -> None:
    s = make(num_blocks=4, block_size=4, scheduling_policy="priority")
    vip, bulk = seq(7, max_tokens=8, priority=0), seq(7, max_tokens=8, priority=9)
    s.add(vip)
    s.add(bulk)
    step(s)
    while vip.status is not SequenceStatus.FINISHED:
        step(s)
        assert vip.num_preemptions == 0
    assert bulk.num_preemptions > 0


def test_eos_and_stop_token_ids_finish() -> None:
    s = make()
    a = seq(3, max_tokens=10)
    s.add(a)
    step(s, token=EOS)
    assert a.finish_reason == "stop" and a.stop_reason == EOS
    b = Sequence([1, 2], SamplingParams(max_tokens=10, stop_token_ids=[42]))
    s.add(b)
    step(s, token=42)
    assert b.finish_reason == "stop" and b.stop_reason == 42
    c = Sequence([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    s.add(c)
    step(s, token=EOS)
    step(s, token=EOS)
    assert c.finish_reason == "length" and c.output_token_ids == [EOS, EOS]


def _decoding(s: Scheduler, n: int, max_tokens: int = 50) -> list[Sequence]:
    """`n` sequences past their prefill, decoding."""
    running = [seq(3, max_tokens=max_tokens) for _ in range(n)]
    for q in running:
        s.add(q)
    step(s)
    assert all(q.num_uncomputed_tokens == 1 for q in running)
    return running


def test_beside_decodes_a_prompt_is_chunked_to_the_decode_step_budget() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=64, decode_step_prefill_tokens=8)
    streams = _decoding(s, 2)
    prompt = seq(20)
    s.add(prompt)
    sizes = []
    while prompt.num_output_tokens == 0:
        batch = step(s)
        assert batch.seqs[:2] == streams  # the streams decode in every step
        sizes.append(batch.num_new_tokens[2:])
    assert sizes == [[8], [8], [4]]
    assert s.num_chunked_prefills == 2


def test_a_prompt_alone_takes_the_whole_budget() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=64, decode_step_prefill_tokens=8)
    prompt = seq(20)
    s.add(prompt)
    assert step(s).num_new_tokens == [20]


def test_a_queue_deeper_than_one_step_takes_the_whole_budget() -> None:
    s = make(
        num_blocks=256,
        max_num_batched_tokens=32,
        decode_step_prefill_tokens=8,
        burst_prefill_steps=0,
    )
    _decoding(s, 2)
    queued = [seq(20), seq(20)]  # 40 prompt tokens: more than one step of 32
    for q in queued:
        s.add(q)
    assert step(s).num_new_tokens == [1, 1, 20, 10]
    # 10 left: the queue fits in a step again, so the (now three) streams get short steps
    assert step(s).num_new_tokens == [1, 1, 1, 8]


def test_a_burst_is_prefilled_while_the_streams_wait() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, decode_step_prefill_tokens=8)
    streams = _decoding(s, 2)
    queued = [seq(20), seq(20)]  # 40 prompt tokens: more than one step of 32
    for q in queued:
        s.add(q)
    computed = [q.num_computed_tokens for q in streams]
    batch = step(s)
    assert batch.seqs == queued and batch.num_new_tokens == [20, 12]  # prompts only
    assert [q.num_computed_tokens for q in streams] == computed  # the streams sat it out
    assert all(q.status == SequenceStatus.RUNNING and q.block_table for q in streams)
    # 8 left: the queue fits in a step again, so every stream decodes beside the capped tail
    assert step(s).num_new_tokens == [1, 1, 1, 8]
    assert s.burst_steps == 0


def test_streams_sit_out_at_most_burst_prefill_steps_in_a_row() -> None:
    s = make(
        num_blocks=512,
        max_num_batched_tokens=16,
        decode_step_prefill_tokens=4,
        burst_prefill_steps=2,
    )
    streams = _decoding(s, 1)
    for i in range(6):  # 96 prompt tokens, six steps' worth, none a cached prefix of another
        s.add(Sequence(list(range(100 * i + 1, 100 * i + 17)), SamplingParams(max_tokens=40)))
    decoded = [streams[0] in step(s).seqs for _ in range(6)]
    assert decoded == [False, False, True, False, False, True]


def test_a_burst_that_cannot_be_admitted_lets_the_streams_decode() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, max_num_seqs=2)
    streams = _decoding(s, 2)  # every slot taken
    for _ in range(3):
        s.add(seq(20))
    batch = step(s)
    assert batch.seqs == streams and batch.num_new_tokens == [1, 1]


def test_a_stream_that_outranks_the_burst_keeps_decoding() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, scheduling_policy="priority")
    vip = _decoding(s, 1)[0]
    vip.priority = -1
    burst = [seq(20, priority=0), seq(20, priority=0)]
    for q in burst:
        s.add(q)
    assert step(s).seqs[0] is vip  # lower value first: the burst waits for vip, not vip for it


def test_a_queue_behind_full_slots_is_admitted_beside_the_decodes() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, max_num_seqs=3)
    streams = _decoding(s, 2)  # one slot left: a loaded server's queue, not a burst
    for _ in range(3):
        s.add(seq(20))
    batch = step(s)
    assert batch.seqs[:2] == streams and batch.num_new_tokens == [1, 1, 20]


def test_the_step_behind_decodes_is_a_bursts_when_one_arrives() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, decode_step_prefill_tokens=8)
    _decoding(s, 2)
    batch = s.schedule()
    assert s.lookahead(batch) is not None  # nothing waits: the step behind is scheduled now
    for flag in (True, False):
        s2 = make(
            num_blocks=256,
            max_num_batched_tokens=32,
            decode_step_prefill_tokens=8,
            burst_lookahead=flag,
        )
        streams = _decoding(s2, 2)
        batch = s2.schedule()
        queued = [seq(20), seq(20)]
        for q in queued:
            s2.add(q)
        ahead = s2.lookahead(batch)  # the next step is the burst's, without these decodes
        if flag:
            assert ahead is not None and ahead.burst and ahead.seqs == queued
            assert ahead.num_new_tokens == [20, 12] and ahead.in_flight == [0, 0]
            assert [q.num_computed_tokens for q in streams] == [3, 3]
        else:
            assert ahead is None


def _burst(s: Scheduler, prompts: int, length: int = 20) -> list[Sequence]:
    """Two streams decoding and `prompts` distinct prompts queued behind them (no shared prefix)."""
    _decoding(s, 2)
    queued = [
        Sequence(list(range(100 * i + 1, 100 * i + 1 + length)), SamplingParams())
        for i in range(prompts)
    ]
    for q in queued:
        s.add(q)
    return queued


def test_a_bursts_next_step_is_scheduled_behind_the_one_in_flight() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, decode_step_prefill_tokens=8)
    queued = _burst(s, 4)  # 80 prompt tokens: two and a half steps
    batch = s.schedule()
    assert batch.burst and batch.num_new_tokens == [20, 12]
    ahead = s.lookahead(batch)
    assert ahead is not None and ahead.burst and ahead.lookahead_rows == []
    # the tail of the prompt chunked in flight first, past its 12 tokens there; then admissions
    assert ahead.seqs == queued[1:] and ahead.num_new_tokens == [8, 20, 4]
    assert ahead.in_flight == [12, 0, 0]
    assert [q.num_computed_tokens for q in queued] == [0, 0, 0, 0]  # nothing counted twice
    assert s.burst_steps == 2
    for b in (batch, ahead):
        s.postprocess(
            b,
            [
                7 if q.num_computed_tokens + n == len(q) else None
                for q, n in zip(b.seqs, b.num_new_tokens)
            ],
        )
        s.block_manager.check_invariants(s.seqs)
    assert [q.num_computed_tokens for q in queued] == [20, 20, 20, 4]


def _run_to_host(s: Scheduler, *batches) -> None:
    """Postprocess `batches` in order, as the engine reads them back: token 7 wherever a prompt's
    last chunk runs or a sequence decodes."""
    for b in batches:
        s.postprocess(
            b,
            [
                7 if q.num_computed_tokens + n == len(q) else None
                for q, n in zip(b.seqs, b.num_new_tokens)
            ],
        )
        s.block_manager.check_invariants(s.seqs)


def test_the_step_behind_a_bursts_last_decodes_every_stream() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, decode_step_prefill_tokens=8)
    streams = _decoding(s, 2)
    queued = [Sequence(list(range(100 * i + 1, 100 * i + 21)), SamplingParams()) for i in range(2)]
    for q in queued:
        s.add(q)  # 40 prompt tokens: after the first step 8 are left, and the streams decode
    batch = s.schedule()
    assert batch.burst and batch.seqs == queued and batch.num_new_tokens == [20, 12]
    ahead = s.lookahead(batch)
    # the prompt the burst completes decodes its sampled token (a row), the streams that sat the
    # burst out decode theirs (the host's), the chunked prompt goes on past its 12 tokens
    assert ahead is not None and not ahead.burst and ahead.lookahead_rows == [0]
    assert ahead.seqs == [queued[0], *streams, queued[1]]
    assert ahead.num_new_tokens == [1, 1, 1, 8] and ahead.in_flight == [0, 0, 0, 12]
    assert s.burst_steps == 0
    _run_to_host(s, batch, ahead)
    assert queued[0].num_output_tokens == 2 and queued[1].num_computed_tokens == 20
    assert [q.num_output_tokens for q in streams] == [2, 2]


def test_no_step_behind_a_burst_step_without_burst_lookahead() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, burst_prefill_steps=1)
    _burst(s, 4)
    streams = list(s.running)  # the two decoding
    batch = s.schedule()  # the streams may sit out one step only: they decode in the next
    ahead = s.lookahead(batch)
    assert batch.burst and ahead is not None and ahead.seqs[:3] == [batch.seqs[0], *streams]
    s = make(num_blocks=256, max_num_batched_tokens=32, burst_lookahead=False)
    _burst(s, 4)
    assert s.lookahead(s.schedule()) is None


def test_no_step_behind_a_burst_step_when_its_blocks_are_short() -> None:
    # 2 streams hold 2 blocks; the burst's first step takes 8 of the 10 left (20 + 12 tokens):
    # the chunked prompt's tail needs 2 more, free, the next admission then finds none
    s = make(num_blocks=12, max_num_batched_tokens=32)
    queued = _burst(s, 4)
    batch = s.schedule()
    ahead = s.lookahead(batch)
    assert ahead is not None and ahead.seqs == [queued[1]] and ahead.num_new_tokens == [8]
    s = make(num_blocks=11, max_num_batched_tokens=32)  # the tail's 2 blocks are not free: no step
    _burst(s, 4)
    assert s.lookahead(s.schedule()) is None


def test_a_prompt_chunked_beside_decodes_goes_on_in_the_step_behind() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, decode_step_prefill_tokens=8)
    streams = _decoding(s, 2)
    long = seq(30)  # one request: chunked beside the streams, 8 prompt tokens a step
    s.add(long)
    batch = s.schedule()
    assert batch.seqs == [*streams, long] and batch.num_new_tokens == [1, 1, 8]
    ahead = s.lookahead(batch)
    assert ahead is not None and ahead.lookahead_rows == [0, 1]
    assert ahead.seqs == [*streams, long] and ahead.num_new_tokens == [1, 1, 8]
    assert ahead.in_flight == [0, 0, 8] and long.num_computed_tokens == 0
    for b in (batch, ahead):
        s.postprocess(
            b,
            [
                7 if q.num_computed_tokens + n == len(q) else None
                for q, n in zip(b.seqs, b.num_new_tokens)
            ],
        )
        s.block_manager.check_invariants(s.seqs)
    assert long.num_computed_tokens == 16 and all(q.num_output_tokens == 3 for q in streams)


def test_a_lookahead_step_ends_the_run_of_steps_sat_out() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=32, decode_step_prefill_tokens=8)
    _decoding(s, 2)
    batch = s.schedule()
    s.burst_steps = 5  # an earlier burst's steps, the pipeline running since
    assert s.lookahead(batch) is not None  # nothing waits: the decodes run ahead
    assert s.burst_steps == 0


def test_a_negative_burst_prefill_steps_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="burst_prefill_steps"):
        EngineConfig(model="unused", burst_prefill_steps=-1)


def test_the_decode_step_budget_off() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=64, decode_step_prefill_tokens=0)
    _decoding(s, 2)
    s.add(seq(20))
    assert step(s).num_new_tokens == [1, 1, 20]


def test_a_higher_priority_chunk_tail_takes_the_prompt_budget_and_decodes_still_run() -> None:
    s = make(
        num_blocks=256,
        max_num_batched_tokens=64,
        decode_step_prefill_tokens=4,
        scheduling_policy="priority",
    )
    low = _decoding(s, 1)[0]
    low.priority = 9
    vip, other = seq(10, priority=0), seq(10, priority=0)
    s.add(vip)
    s.add(other)
    batch = step(s)
    assert batch.seqs == [low, vip] and batch.num_new_tokens == [1, 4]  # other waits
    batch = step(s)  # vip's tail ranks before low's decode and spends the prompt budget
    assert batch.seqs == [vip, low] and batch.num_new_tokens == [4, 1]
    assert other in s.waiting


def test_a_negative_decode_step_budget_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="decode_step_prefill_tokens"):
        EngineConfig(model="unused", decode_step_prefill_tokens=-1)
