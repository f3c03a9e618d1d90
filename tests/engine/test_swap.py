"""Swap preemption: host pool accounting, the cost estimate, and exact outputs under KV pressure."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine import LLM
from flashstack.engine.block_manager import BlockManager
from flashstack.engine.config import EngineConfig
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.scheduler import Scheduler
from flashstack.engine.sequence import Sequence, SequenceStatus
from flashstack.engine.swap import HostBlockPool, PreemptionCost, SwapSpace, block_runs
from tests.engine.helpers import check_engine, greedy, hf_greedy, run_checked

MAX_TOKENS = 14
PROMPTS = [[5 + (i * 7 + j * 3) % 300 for j in range(9 + 5 * i)] for i in range(5)]
# Block size 4, 14 blocks: five sequences of up to 43 tokens cannot all stay resident.
TIGHT = dict(block_size=4, num_kv_blocks=14, max_num_seqs=8, device="cpu", show_progress=False)


def always(mode: str, bytes_per_block: int = 64) -> PreemptionCost:
    return PreemptionCost(
        mode, bytes_per_block, params=1000, attn_flops_per_pair=16, bandwidth=1e9, flops=1e9
    )


# ---- units ---------------------------------------------------------------------------------------


def test_host_pool_allocates_releases_and_checks() -> None:
    pool = HostBlockPool(4)
    assert pool.allocate(7, 3) == [0, 1, 2] and pool.num_used_blocks == 3
    with pytest.raises(RuntimeError, match="out of host KV blocks"):
        pool.allocate(8, 2)
    pool.check_invariants()
    assert pool.release(7) == [0, 1, 2] and pool.release(7) == []
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_block_runs_merge_pairs_consecutive_on_both_sides() -> None:
    assert block_runs([(3, 0), (4, 1), (5, 2), (9, 3), (2, 4), (3, 5)]) == [
        (3, 0, 3),
        (9, 3, 1),
        (2, 4, 2),
    ]
    assert block_runs([]) == []


def test_cost_estimate_arithmetic() -> None:
    cost = PreemptionCost(
        "auto", bytes_per_block=1000, params=500, attn_flops_per_pair=8, bandwidth=1e6, flops=1e6
    )
    assert cost.swap_seconds(3) == pytest.approx(2 * 3 * 1000 / 1e6)  # out and back in
    assert cost.recompute_seconds(10) == pytest.approx((2 * 500 * 10 + 8 * 100 / 2) / 1e6)


def test_auto_mode_picks_the_cheaper_side() -> None:
    attn = 4 * 32 * 32 * 128
    base = dict(bytes_per_block=32 << 20, params=8_000_000_000, attn_flops_per_pair=attn)
    # Llama-3-8B shape, 256-token bf16 blocks (32 MiB over all layers): moving 1024 tokens out and
    # back over 50 GB/s (~5 ms) beats recomputing them at 330 TFLOP/s (~50 ms).
    gpu = PreemptionCost("auto", **base, bandwidth=50e9, flops=330e12)
    assert gpu.prefers_swap(num_blocks=4, num_tokens=1024)
    # A slow link against a fast compute side flips the choice.
    slow_link = PreemptionCost("auto", **base, bandwidth=1e3, flops=330e12)
    assert not slow_link.prefers_swap(num_blocks=4, num_tokens=1024)
    # Forced modes ignore the estimate.
    assert PreemptionCost("swap", **base, bandwidth=1e3, flops=1e20).prefers_swap(4, 1024)
    assert not PreemptionCost("recompute", **base, bandwidth=1e20, flops=1).prefers_swap(4, 1024)


def test_config_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(model="x", preemption_mode="sometimes")


def test_cpu_swap_space_copies_blocks_both_ways() -> None:
    kv = torch.randn(3, 6, 2, 4, 2, 8)
    space = SwapSpace(kv, num_blocks=4)
    before = kv.clone()
    space.swap(swap_out=[(1, 0), (2, 1), (5, 3)], swap_in=[])
    assert torch.equal(space.host_cache[:, [0, 1, 3]], before[:, [1, 2, 5]])
    kv.zero_()
    space.swap(swap_out=[], swap_in=[(3, 0), (0, 4), (1, 2)])
    assert torch.equal(kv[:, [0, 4, 2]], before[:, [5, 1, 2]])


# ---- scheduler without a model -------------------------------------------------------------------


def make_scheduler(mode: str, num_blocks: int = 5, num_host: int = 16, **kw) -> Scheduler:
    cfg = EngineConfig(model="unused", block_size=4, max_model_len=1024, **kw)
    bm = BlockManager(num_blocks, 4, num_host_blocks=num_host)
    return Scheduler(cfg, bm, {0}, always(mode))


def sched_step(s: Scheduler):
    batch = s.schedule()
    sampled = [
        7 if q.num_computed_tokens + n == len(q) else None
        for q, n in zip(batch.seqs, batch.num_new_tokens)
    ]
    s.postprocess(batch, sampled)
    s.block_manager.check_invariants(s.seqs)
    return batch


def test_scheduler_swaps_out_and_back_in_and_empties_the_host_pool() -> None:
    s = make_scheduler("swap")
    seqs = [Sequence(list(range(1, 8)), SamplingParams(max_tokens=6)) for _ in range(2)]
    for q in seqs:
        s.add(q)
    swapped_out = swapped_in = 0
    while s.has_unfinished():
        batch = sched_step(s)
        swapped_out += len(batch.swap_out)
        swapped_in += len(batch.swap_in)
        assert not (batch.swap_out and batch.swap_in), "swap-out and swap-in never share a step"
    assert s.num_swap_outs > 0 and swapped_out == swapped_in > 0
    assert all(q.finish_reason == "length" and q.num_output_tokens == 6 for q in seqs)
    assert s.block_manager.host.num_used_blocks == 0
    assert s.block_manager.num_free_blocks == 5


def test_swapped_sequences_come_back_before_new_admissions() -> None:
    s = make_scheduler("swap", num_blocks=4)
    a, b = (Sequence(list(range(1, 8)), SamplingParams(max_tokens=8)) for _ in range(2))
    s.add(a)
    s.add(b)
    while not s.swapped:
        sched_step(s)
    late = Sequence([1, 2], SamplingParams(max_tokens=1))
    s.add(late)
    while late.status is SequenceStatus.WAITING:
        batch = sched_step(s)
        assert late not in batch.seqs or not s.swapped, "admitted while a sequence was swapped"
    assert a.num_preemptions + b.num_preemptions > 0 and not s.swapped


def test_no_host_room_falls_back_to_recompute() -> None:
    s = make_scheduler("swap", num_host=1)  # a victim's 2 computed blocks do not fit
    for _ in range(2):
        s.add(Sequence(list(range(1, 8)), SamplingParams(max_tokens=6)))
    while s.has_unfinished():
        sched_step(s)
    assert s.num_preemptions > 0 and s.num_swap_outs == 0


def test_abort_of_a_swapped_sequence_frees_its_host_blocks() -> None:
    s = make_scheduler("swap")
    seqs = [Sequence(list(range(1, 8)), SamplingParams(max_tokens=6)) for _ in range(2)]
    for q in seqs:
        s.add(q)
    while not s.swapped:
        sched_step(s)
    victim = s.swapped[0]
    assert victim.status is SequenceStatus.SWAPPED and s.block_manager.host.num_used_blocks > 0
    assert s.abort(victim.request_id) is victim
    assert victim.finish_reason == "abort" and s.block_manager.host.num_used_blocks == 0
    s.block_manager.check_invariants(s.seqs)
    while s.has_unfinished():
        sched_step(s)


# ---- the engine on CPU against transformers ------------------------------------------------------


@pytest.fixture(scope="module")
def refs(hf_checkpoints) -> dict[str, list[list[int]]]:
    return {
        fam: [hf_greedy(hf_checkpoints[fam][1], p, MAX_TOKENS) for p in PROMPTS]
        for fam in ("llama", "qwen3")
    }


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_swap_under_pressure_is_exact(family: str, hf_checkpoints, refs) -> None:
    path, _ = hf_checkpoints[family]
    ample = LLM(path, block_size=4, device="cpu", show_progress=False)
    assert run_checked(ample, PROMPTS, greedy(MAX_TOKENS)) == refs[family]
    assert ample.engine.scheduler.num_preemptions == 0
    llm = LLM(path, preemption_mode="swap", **TIGHT)
    assert run_checked(llm, PROMPTS, greedy(MAX_TOKENS)) == refs[family]
    sched, bm = llm.engine.scheduler, llm.engine.block_manager
    assert sched.num_swap_outs > 0, "the KV budget was meant to force swapping"
    assert sched.num_swap_outs == sched.num_preemptions
    assert bm.host.num_used_blocks == 0 and not bm.host.tables


@pytest.mark.parametrize(
    ("knob", "swaps"),
    [
        (dict(swap_bandwidth_gbps=1e-9), False),  # a link this slow makes recompute cheaper
        (dict(recompute_tflops=1e-9), True),  # compute this slow makes swapping cheaper
    ],
)
def test_auto_mode_follows_the_estimate(knob, swaps: bool, hf_checkpoints, refs) -> None:
    path, _ = hf_checkpoints["llama"]
    llm = LLM(path, preemption_mode="auto", **TIGHT, **knob)
    assert run_checked(llm, PROMPTS, greedy(MAX_TOKENS)) == refs["llama"]
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert (sched.num_swap_outs > 0) is swaps
    assert (sched.num_swap_outs == sched.num_preemptions) is swaps


def test_recompute_mode_has_no_host_pool(hf_checkpoints) -> None:
    path, _ = hf_checkpoints["llama"]
    llm = LLM(path, preemption_mode="recompute", **TIGHT)
    assert llm.engine.runner.swap_space is None and llm.engine.block_manager.host.num_blocks == 0
    run_checked(llm, PROMPTS[:3], greedy(4))
    assert llm.engine.scheduler.num_swap_outs == 0


def test_engine_abort_of_swapped_request_frees_host_blocks(hf_checkpoints) -> None:
    path, _ = hf_checkpoints["llama"]
    llm = LLM(path, preemption_mode="swap", **TIGHT)
    engine = llm.engine
    rids = [engine.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
    while not engine.scheduler.swapped:
        assert engine.has_unfinished_requests(), "nothing was swapped out"
        engine.step()
        check_engine(engine)
    victim = engine.scheduler.swapped[0]
    assert engine.block_manager.host.num_used_blocks > 0
    assert engine.abort_request(victim.request_id)
    assert victim.seq_id not in engine.block_manager.host.tables
    check_engine(engine)
    finals = {}
    while engine.has_pending_output():
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = delta.finish_reason
        check_engine(engine)
    assert finals[victim.request_id] == "abort"
    assert all(finals[r] == "length" for r in rids if r != victim.request_id)
    assert engine.block_manager.host.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_swap_under_memory_pressure_matches_ample_memory(
    enforce_eager: bool, hf_checkpoints
) -> None:
    path, model = hf_checkpoints["qwen3"]
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    common = dict(
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        max_num_seqs=6,
        enforce_eager=enforce_eager,
    )
    ample = run_checked(LLM(path, **common), prompts, greedy(24))
    assert ample == [hf_greedy(model, p, 24) for p in prompts]
    llm = LLM(path, num_kv_blocks=12, preemption_mode="swap", swap_space_gb=0.01, **common)
    assert llm.engine.runner.swap_space.host_cache.is_pinned()
    assert run_checked(llm, prompts, greedy(24)) == ample
    assert llm.engine.scheduler.num_swap_outs > 0
    assert llm.engine.block_manager.host.num_used_blocks == 0
