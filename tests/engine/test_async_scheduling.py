"""Async scheduling: a decode step's successor is queued before the step's tokens are read back.

Every test compares against the same engine with `async_scheduling=False` (one step at a time),
which must produce identical tokens, finish reasons and block accounting, including when
sequences end mid-flight (stop tokens, stop strings, EOS), arrive or are aborted mid-flight,
and when blocks run short.
"""

from __future__ import annotations

import pytest
import torch

from flashstack.engine import LLM, SamplingParams
from flashstack.engine.model_runner import ModelRunner
from tests.engine.helpers import check_engine


def _llm(model_dir, async_scheduling: bool, **kw) -> LLM:
    kw = {"block_size": 4, "device": "cpu", "show_progress": False, **kw}
    return LLM(model_dir, async_scheduling=async_scheduling, **kw)


def _lookaheads(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps queued behind another (launch(..., after=...)), and in [1] the steps
    that start a pipeline (launch without `after`)."""
    count = [0, 0]
    inner = ModelRunner.launch

    def counted(self, batch, after=None):
        step = inner(self, batch, after)
        if step is not None:
            count[0 if after is not None else 1] += 1
        return step

    monkeypatch.setattr(ModelRunner, "launch", counted)
    return count


def _run(llm: LLM, prompts, params):
    llm.step_hook = check_engine
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in outs]


PROMPTS = ["def main():", "hello world, this is", "x = 1\ny = 2\n", "a"]


def test_greedy_identical_and_steps_overlap(tiny_model_dir, monkeypatch) -> None:
    count = _lookaheads(_llm, monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 7, 23, 40)]
    sync = _run(_llm(tiny_model_dir, False), PROMPTS, params)
    assert count[0] == 0
    overlapped = _run(_llm(tiny_model_dir, True), PROMPTS, params)
    assert overlapped == sync
    assert count[0] > 20  # most decode steps were queued behind the one before


def test_stops_mid_flight(tiny_model_dir, tiny_llm) -> None:
    # Stop tokens and strings end a sequence after its successor step was already queued.
    free = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = [
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[0].token_ids[5]]
        ),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[free[1].text[10:13]]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[3].token_ids[12]]
        ),
    ]
    sync = _run(_llm(tiny_model_dir, False), PROMPTS, params)
    overlapped = _run(_llm(tiny_model_dir, True), PROMPTS, params)
    assert overlapped == sync
    assert [r[1] for r in overlapped] == ["stop", "stop", "length", "stop"]


def test_eos_mid_flight(tiny_model_dir, monkeypatch) -> None:
    count = _lookaheads(_llm, monkeypatch)
    results = []
    for flag in (False, True):
        llm = _llm(tiny_model_dir, flag)
        probe = llm.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )[0]
        llm.engine.scheduler.eos_token_ids = {probe.token_ids[8]}
        count[:] = [0, 0]
        results.append(_run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=20)))
    assert results[0] == results[1]
    assert results[1][0][1] == "stop"
    # One pipeline from the first decode step to the last: a sequence ending on EOS while its
    # next step is queued does not break it.
    assert count[1] == 1 and count[0] > 10


def test_seeded_sampling_identical(tiny_model_dir) -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=25, ignore_eos=True)
        for s in range(4)
    ]
    assert _run(_llm(tiny_model_dir, True), PROMPTS, params) == _run(
        _llm(tiny_model_dir, False), PROMPTS, params
    )


def test_arrivals_and_aborts_mid_flight(tiny_model_dir, monkeypatch) -> None:
    count = _lookaheads(_llm, monkeypatch)
    logs = []
    for flag in (False, True):
        engine = _llm(tiny_model_dir, flag).engine
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(PROMPTS[:2])]
        tokens: dict[str, list[int]] = {}
        finish: dict[str, str | None] = {}
        step = 0
        while engine.has_pending_output():
            for d in engine.step():
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
                finish[d.request_id] = d.finish_reason
            check_engine(engine)
            step += 1
            if step == 6:  # arrives while a lookahead step is in flight
                ids.append(engine.add_request(PROMPTS[2], params, request_id="late"))
            if step == 12:  # aborted while its next step is queued
                assert engine.abort_request(ids[0])
        bm = engine.block_manager
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
        logs.append((tokens, finish))
    assert logs[0] == logs[1]
    assert logs[1][1] == {"r0": "abort", "r1": "length", "late": "length"}
    assert count[0] > 0


def test_short_of_blocks_falls_back_and_matches(tiny_model_dir) -> None:
    # So few blocks that sequences get preempted: lookahead must step aside, outputs unchanged.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ample = _run(_llm(tiny_model_dir, False), PROMPTS, params)
    tight = _run(_llm(tiny_model_dir, True, num_kv_blocks=14), PROMPTS, params)
    assert tight == ample


def test_rows_needing_the_host_run_one_step_at_a_time(tiny_model_dir, monkeypatch) -> None:
    count = _lookaheads(_llm, monkeypatch)
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
    ]
    llm = _llm(tiny_model_dir, True)
    outs = llm.generate(PROMPTS[:2], params)
    assert count[0] == 0
    assert all(len(o.token_ids) == 10 for o in outs) and len(outs[0].logprobs) == 10
    sync = _llm(tiny_model_dir, False).generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]


Arrival = tuple[str, SamplingParams]


def _staggered(engine, arrivals: dict[int, Arrival | list[Arrival]]):
    """Run `engine` to the end, adding arrivals[k] (one request or several) after its k-th step;
    tokens and finish reasons per request."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    step = 0
    while engine.has_pending_output() or step in arrivals:
        if step in arrivals:
            batch = arrivals[step]
            for i, (prompt, params) in enumerate(batch if isinstance(batch, list) else [batch]):
                engine.add_request(prompt, params, request_id=f"at{step}.{i}")
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            finish[d.request_id] = d.finish_reason
        check_engine(engine)
        step += 1
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    return tokens, finish


def _admissions_behind(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps queued behind another that also admit prompts (a mixed lookahead)."""
    count = [0]
    inner = ModelRunner.launch

    def counted(self, batch, after=None):
        step = inner(self, batch, after)
        if step is not None and after is not None and len(batch.seqs) > len(batch.lookahead_rows):
            count[0] += 1
        return step

    monkeypatch.setattr(ModelRunner, "launch", counted)
    return count


def _check_arrivals_join(model_dir, monkeypatch, **kw) -> None:
    behind = _admissions_behind(monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)
    arrivals = {0: (PROMPTS[0], greedy), 3: (PROMPTS[1], seeded), 5: (PROMPTS[2] * 6, greedy)}
    arrivals[9] = (PROMPTS[3], greedy)
    logs = []
    for flag in (False, True):
        engine = _llm(model_dir, flag, max_num_batched_tokens=16, **kw).engine
        logs.append(_staggered(engine, arrivals))
    assert logs[0] == logs[1]
    assert set(logs[1][1].values()) == {"length"}
    assert behind[0] >= 2


def test_arrivals_join_the_step_queued_behind(tiny_model_dir, monkeypatch) -> None:
    # A prompt arriving mid-decode is admitted into the step queued behind the running one, with
    # the decodes' ids taken on the device; chunked prompts and seeded sampling included.
    _check_arrivals_join(tiny_model_dir, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_arrivals_join_the_step_queued_behind_on_the_gpu(tiny_model_dir, monkeypatch) -> None:
    # The same through CUDA graphs (decode and mixed steps) and the pinned staging.
    _check_arrivals_join(tiny_model_dir, monkeypatch, device="cuda", dtype="float32", block_size=16)


def test_an_arrival_that_needs_the_host_waits_for_the_next_step(tiny_model_dir, monkeypatch):
    # Its first token needs logprobs: the queued-behind step cannot take it, the next one does.
    count = _lookaheads(_llm, monkeypatch)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    host = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    arrivals = {0: (PROMPTS[0], plain), 3: (PROMPTS[1], host)}
    logs = [_staggered(_llm(tiny_model_dir, flag).engine, arrivals) for flag in (False, True)]
    assert logs[0] == logs[1]
    assert count[0] > 0


def test_a_burst_prefilled_ahead_of_the_decodes_gives_the_same_tokens(tiny_model_dir) -> None:
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]  # 12 prompts, a step's budget 16
    params = [SamplingParams(temperature=0, max_tokens=9 + i, ignore_eos=True) for i in range(12)]
    kw = {"max_num_batched_tokens": 16, "decode_step_prefill_tokens": 4}
    mixed = _run(_llm(tiny_model_dir, True, burst_prefill_steps=0, **kw), prompts, params)
    llm = _llm(tiny_model_dir, True, **kw)
    sat_out = []

    def hook(engine) -> None:
        check_engine(engine)
        sat_out.append(engine.scheduler.burst_steps)

    llm.step_hook = hook
    outs = llm.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in outs] == mixed
    assert max(sat_out) >= 2  # the streams sat out steps in a row while the burst went in


def test_a_bursts_steps_are_queued_one_behind_the_other(tiny_model_dir, monkeypatch) -> None:
    # Each burst step after the first is queued before the one in flight is read back (its
    # chunks start past that one's), and the tokens are those of one step at a time.
    behind = [0]
    inner = ModelRunner.launch

    def counted(self, batch, after=None):
        step = inner(self, batch, after)
        behind[0] += step is not None and after is not None and batch.burst
        return step

    monkeypatch.setattr(ModelRunner, "launch", counted)
    logs = _burst_logs(tiny_model_dir)
    assert logs[0] == logs[1]
    assert behind[0] >= 2


def _burst_logs(model_dir, **kw) -> list:
    """The logs of one step at a time, then of async scheduling: two streams decoding, then 16
    prompts of 7 to 12 tokens arriving together (a burst: a step's budget is 20 tokens), one of
    them and one stream sampled with a seed."""
    prompts = [f"{i} {p} {i}" for i in range(4) for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(16)]
    params[5] = SamplingParams(temperature=0.9, seed=11, max_tokens=9, ignore_eos=True)
    settings = {"max_num_batched_tokens": 20, "decode_step_prefill_tokens": 4, **kw}
    arrivals = {
        0: [(PROMPTS[0], params[0]), (PROMPTS[1], params[5])],
        3: list(zip(prompts, params)),
    }
    return [
        _staggered(_llm(model_dir, flag, **settings).engine, arrivals) for flag in (False, True)
    ]


def test_a_one_token_prompt_admitted_behind_a_chunk_takes_its_own_token(tiny_model_dir) -> None:
    # A long prompt chunked beside the streams spends the step's prompt budget; a one-token
    # prompt still fits and samples, after that chunk, which samples nothing. The step queued
    # behind takes each row's token from the sampled rows only, not by batch position.
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [(PROMPTS[0], greedy), (PROMPTS[1], greedy)]}
    arrivals[3] = [(PROMPTS[2] * 3, greedy), ([5], greedy)]
    kw = {"max_num_batched_tokens": 32, "decode_step_prefill_tokens": 6}
    logs = [_staggered(_llm(tiny_model_dir, flag, **kw).engine, arrivals) for flag in (False, True)]
    assert logs[0] == logs[1]
    assert len(logs[1][0]["at3.1"]) == 12


def _check_streams_after_a_burst(model_dir, monkeypatch, **kw) -> None:
    # The step after a burst's last is queued behind it: the prompts it completes decode their
    # sampled tokens (taken on the device), the streams that sat the burst out decode the
    # host's; the tokens are those of one step at a time.
    behind = [0]
    inner = ModelRunner.launch

    def counted(self, batch, after=None):
        step = inner(self, batch, after)
        if step is not None and after is not None and not batch.burst:
            rows = len(batch.lookahead_rows or [])
            host = zip(batch.seqs[rows:], batch.num_new_tokens[rows:])
            behind[0] += any(n == 1 and seq not in after.batch.seqs for seq, n in host)
        return step

    monkeypatch.setattr(ModelRunner, "launch", counted)
    logs = _burst_logs(model_dir, **kw)
    assert logs[0] == logs[1]
    assert behind[0] >= 1


def test_the_streams_a_burst_left_out_decode_in_the_step_queued_behind_it(
    tiny_model_dir, monkeypatch
) -> None:
    _check_streams_after_a_burst(tiny_model_dir, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_streams_a_burst_left_out_decode_behind_it_on_the_gpu(tiny_model_dir, monkeypatch):
    # The same through CUDA graphs (the decode graph's leading ids from the device) and mixed steps.
    _check_streams_after_a_burst(
        tiny_model_dir, monkeypatch, device="cuda", dtype="float32", block_size=16
    )


def test_a_prompt_chunked_beside_the_decodes_is_queued_behind(tiny_model_dir, monkeypatch):
    # A long prompt arriving mid-decode goes in chunks beside the streams; each chunk after the
    # first is queued behind the step in flight (past that step's chunk), the streams' ids taken
    # on the device, and the tokens are those of one step at a time.
    behind = [0]
    inner = ModelRunner.launch

    def counted(self, batch, after=None):
        step = inner(self, batch, after)
        tail = batch.in_flight is not None and batch.lookahead_rows and not batch.burst
        behind[0] += step is not None and after is not None and bool(tail)
        return step

    monkeypatch.setattr(ModelRunner, "launch", counted)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    arrivals = {0: [(PROMPTS[0], greedy), (PROMPTS[1], seeded)], 4: (PROMPTS[2] * 3, greedy)}
    kw = {"max_num_batched_tokens": 32, "decode_step_prefill_tokens": 6}
    logs = [_staggered(_llm(tiny_model_dir, flag, **kw).engine, arrivals) for flag in (False, True)]
    assert logs[0] == logs[1]
    assert behind[0] >= 3
