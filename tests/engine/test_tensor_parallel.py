"""Tensor parallelism over 2 ranks (gloo on CPU, NCCL on GPUs) is token-identical to 1 rank and to
transformers; heads, vocabulary and weights split the way the spec says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashstack.engine import LLM
from flashstack.engine.models.parallel import HeadSplit, vocab_range
from tests.engine.helpers import greedy, hf_greedy, run_checked

MAX_TOKENS = 10
_SHARED = [7 + (i * 13) % 300 for i in range(21)]
PROMPTS = [
    _SHARED + [40, 41, 42],
    [3, 4],
    [100 + i for i in range(37)],
    _SHARED + [40, 41, 42],  # shares its prefix blocks with the first prompt
    [9],
]
# Small blocks, a small token budget and a tight cache: chunked prefill, prefix hits and
# preemption all happen, so many differently shaped steps cross the broadcast.
ENGINE = dict(
    device="cpu",
    show_progress=False,
    block_size=4,
    max_num_batched_tokens=16,
    num_kv_blocks=18,
    max_num_seqs=8,
    kernels={"tp_timeout_s": 30},  # a broken rank must fail the test in seconds, not hang it
)


@pytest.fixture(scope="module")
def mqa_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A Llama with one KV head (fewer than ranks) and an odd vocabulary (uneven vocab split)."""
    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.LlamaConfig(
        vocab_size=383,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15) if "norm" not in name else p.uniform_(0.8, 1.2)
    path = tmp_path_factory.mktemp("llama-mqa")
    model.eval().save_pretrained(path, max_shard_size="100KB")
    return path, model


def _generate(path: Path, tp: int) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    if tp > 1:  # every rank has mapped the step mailbox: a crash from here on leaves no file
        assert not llm.engine.workers.mailbox.path.exists()
    try:
        return run_checked(llm, PROMPTS, greedy(MAX_TOKENS)), llm
    finally:
        llm.engine.shutdown()


def _check_identical(path: Path, hf_model: object) -> LLM:
    refs = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    one, _ = _generate(path, 1)
    two, llm = _generate(path, 2)
    assert one == refs, "1 rank differs from transformers"
    for i, (got, ref) in enumerate(zip(two, refs)):
        assert got == ref, f"prompt {i}: 2 ranks {got} != transformers/1 rank {ref}"
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert llm.engine.scheduler.num_chunked_prefills > 0
    assert not any(p.is_alive() for p in llm.engine.workers.procs), "shutdown leaves no rank"
    return llm


def test_llama_kv_heads_split_over_ranks(hf_checkpoints) -> None:
    path, model = hf_checkpoints["llama"]  # 4 query heads, 2 KV heads: one KV head per rank
    llm = _check_identical(path, model)
    attn = llm.engine.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    # q/k/v packed: rank 0's 2 query heads and its KV head's k and v, 16 wide each
    assert attn.qkv_proj.weight.shape == ((2 + 1 + 1) * 16, 64), (
        "rank 0 must hold only its own heads"
    )
    assert llm.engine.runner.kv_cache.shape[4] == 1, "rank 0 caches only its KV head"


def test_llama_kv_heads_replicated_and_vocab_padded(mqa_checkpoint) -> None:
    path, model = mqa_checkpoint  # 1 KV head < 2 ranks: replicated; vocab 383 = 192 + 191
    llm = _check_identical(path, model)
    m = llm.engine.model
    assert m.model.embed_tokens.weight.shape == (192, 64)
    assert m.model.layers[0].mlp.down_proj.weight.shape == (64, 64), "half the intermediate width"


def test_qwen3_tied_embeddings(hf_checkpoints) -> None:
    path, model = hf_checkpoints["qwen3"]  # q/k norm, head_dim 32, tied lm_head
    llm = _check_identical(path, model)
    m = llm.engine.model
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_head_split_respects_gqa() -> None:
    # 32 q heads / 8 KV heads over 2 ranks: each rank owns a contiguous half of both.
    assert HeadSplit.of(32, 8, 1, 2) == HeadSplit(16, 16, 4, 4)
    # 8 q heads / 2 KV heads over 4 ranks: ranks 0,1 share KV head 0; ranks 2,3 share KV head 1.
    assert [HeadSplit.of(8, 2, r, 4).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert all(HeadSplit.of(8, 2, r, 4).num_kv == 1 for r in range(4))
    with pytest.raises(ValueError, match="KV heads"):
        HeadSplit.of(12, 6, 0, 4)
    with pytest.raises(ValueError, match="attention heads"):
        HeadSplit.of(6, 2, 0, 4)


def test_vocab_range_covers_vocabulary_once() -> None:
    parts = [vocab_range(383, r, 3) for r in range(3)]
    assert [(a, b) for a, b, _ in parts] == [(0, 128), (128, 256), (256, 383)]
    assert {size for *_, size in parts} == {128}


def test_cli_tp_option() -> None:
    from flashstack.cli import _parser  # the gateway's settings stack: not needed by the engine

    args = _parser().parse_args(["engine", "serve", "--model", "m", "--tp", "2"])
    assert args.tp == 2


def test_bad_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("unused", tensor_parallel_size=0, **ENGINE)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_two_gpus_match_one(hf_checkpoints) -> None:
    path, model = hf_checkpoints["llama"]
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    kw = {**ENGINE, "device": "cuda", "dtype": "float32"}
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.runner.graphs is not None, "decode graphs are captured on every rank"
        assert run_checked(llm, PROMPTS, greedy(MAX_TOKENS)) == refs
        # One sequence alone: batch-1 steps, whose row-parallel GEMVs carry the residual into the
        # all-reduce (models/ops.py, Batch1Ops.project_add).
        assert run_checked(llm, [PROMPTS[2]], greedy(MAX_TOKENS)) == [refs[2]]
    finally:
        llm.engine.shutdown()


def _graph_step_rank1(port: int, mailbox_path: str, width: int, results: object) -> None:
    from flashstack.engine.config import KernelOptions
    from flashstack.engine.tp.channel import StepChannel
    from flashstack.engine.tp.group import init_rank, leave_group
    from flashstack.engine.tp.mailbox import Mailbox

    mailbox = Mailbox.attach(mailbox_path, 1, width)
    tp = init_rank(1, 2, port, torch.device("cpu"), kernels=KernelOptions(tp_timeout_s=30))
    channel = StepChannel(tp, 4, mailbox)
    capture, step = channel.recv(), channel.recv()
    received = torch.zeros(step.size, dtype=torch.int64)
    channel.recv_packed(received)
    results.put((capture, step, received.tolist(), channel.recv()))
    leave_group()
    mailbox.close()


def test_graph_step_protocol_over_gloo() -> None:
    """The messages that drive the other ranks' decode graphs (GPU-only in the engine) cross a real
    2-rank group: a capture request, then a graph step whose packed inputs land in the receiver's
    buffer, then exit."""
    import multiprocessing as mp

    from flashstack.engine.config import KernelOptions
    from flashstack.engine.step import CaptureGraphs, GraphStep
    from flashstack.engine.tp.channel import StepChannel
    from flashstack.engine.tp.group import init_rank, leave_group, master_store
    from flashstack.engine.tp.mailbox import Mailbox

    width = StepChannel.header_width(8)
    store = master_store(2, timeout_s=30)
    mailbox = Mailbox.create(1, width)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (store.port, str(mailbox.path), width, results)
    rank1 = ctx.Process(target=_graph_step_rank1, args=args)
    rank1.start()
    try:
        tp = init_rank(0, 2, store.port, torch.device("cpu"), store, KernelOptions(tp_timeout_s=30))
        channel = StepChannel(tp, 4, mailbox)
        channel.send_capture(4096)
        packed = torch.arange(3 * 9, dtype=torch.int64) * 7  # bucket 3 of a 5-block-wide table
        channel.send_graph_step(3, packed)
        channel.send_exit()
        capture, step, received, last = results.get(timeout=60)
        assert capture == CaptureGraphs(max_model_len=4096)
        assert step == GraphStep(key=3, size=27)
        assert received == packed.tolist()
        assert last is None, "exit ends the rank's loop"
    finally:
        rank1.join(timeout=30)
        leave_group()
        mailbox.close()
    assert rank1.exitcode == 0


def _all_reduce_rank(rank: int, port: int, errors: object) -> None:
    """Stage rank-dependent values, all-reduce them and compare with the rank-order sum, gather them
    and compare with the ranks' values side by side; eagerly and replayed from a CUDA graph, where
    the buffers, inboxes and flags are reused over and over. The push also broadcasts a graph
    step's inputs from rank 0, new ones before every replay."""
    from flashstack.engine.tp.group import init_rank, leave_group

    device = torch.device("cuda", rank)
    tp = init_rank(rank, 2, port, device)
    tp.enable_fast_all_reduce(4096 * 40, torch.bfloat16, step_inputs=1000)

    def parts(numel: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator(device).manual_seed(seed)
        return [
            torch.randn(numel, generator=gen, device=device).to(torch.bfloat16) for _ in range(2)
        ]

    def expected(numel: int, seed: int) -> torch.Tensor:
        a, b = parts(numel, seed)
        return (a.float() + b.float()).to(torch.bfloat16)

    try:
        # eager, odd sizes, many programs
        for i, numel in enumerate([4096, 1000, 4096 * 40, 4096 * 40 - 3] * 5):
            x = parts(numel, i)[rank]
            got = tp.all_reduce(x.clone())
            if not torch.equal(got, expected(numel, i)):
                errors.put(f"rank {rank}, eager call {i} ({numel} values): wrong sum")
        # -0.0 is the push inbox's "not written yet": a rank sending it must not stall the others.
        x = (
            -torch.zeros(4096, dtype=torch.bfloat16, device=device)
            if rank == 0
            else parts(4096, 7)[1]
        )
        if not torch.equal(tp.all_reduce(x), parts(4096, 7)[1]):
            errors.put(f"rank {rank}: wrong sum with -0.0 values")
        for i, (rows, cols) in enumerate([(1, 64128), (3, 1000), (1, 1000), (5, 4096 * 8)]):
            both = [p.view(rows, cols) for p in parts(rows * cols, 100 + i)]
            staged = tp.fast.stage((rows, cols))
            staged.copy_(both[rank])
            if not torch.equal(tp.fast.gather(staged), torch.cat(both, dim=-1)):
                errors.put(f"rank {rank}, gather {rows}x{cols}: wrong values")

        # A decode graph's pattern: many calls in a row, each fed from the one before, each with
        # different values (a read of a buffer's previous contents would show).
        def call_input(h: torch.Tensor, k: int, r: int) -> torch.Tensor:
            return h * 0.5 + float(k % 7 + 1) * (r + 1)

        xs = parts(4096, 99)
        packed = torch.zeros(777, dtype=torch.int64, device=device)

        def step_inputs(replay: int) -> torch.Tensor:
            # negatives like the padding's -1
            return torch.arange(777, device=device) * (replay + 3) - 5

        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                tp.fast.broadcast_step_inputs(packed)
                h = xs[rank].clone()
                for k in range(16):
                    staged = tp.fast.stage((4096,))
                    staged.copy_(call_input(h, k, rank))
                    h = tp.fast.reduce(staged)
                staged = tp.fast.stage((2, 2048))
                staged.copy_(h.view(2, 2048) + rank)
                gathered = tp.fast.gather(staged)
        hs = xs
        for k in range(16):
            a, b = (call_input(hs[r], k, r) for r in range(2))
            ref = (a.float() + b.float()).to(torch.bfloat16)
            hs = [ref, ref]
        ref_gathered = torch.cat([ref.view(2, 2048) + r for r in range(2)], dim=-1)
        for replay in range(50):
            packed.copy_(step_inputs(replay) if rank == 0 else torch.full_like(packed, -1))
            graph.replay()
            torch.cuda.synchronize(device)
            if not (torch.equal(h, ref) and torch.equal(gathered, ref_gathered)):
                errors.put(f"rank {rank}, graph replay {replay}: wrong values")
                break
            if not torch.equal(packed, step_inputs(replay)):
                errors.put(f"rank {rank}, graph replay {replay}: wrong step inputs")
                break
    finally:
        leave_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_peer_all_reduce_two_gpus() -> None:
    """The push all-reduce over symmetric memory gives both ranks the exact rank-order sum; the
    all-gather gives both the ranks' values side by side; the push broadcast gives rank 1 rank 0's
    step inputs."""
    import multiprocessing as mp

    from flashstack.engine.tp.group import master_store

    store = master_store(2)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    ranks = [ctx.Process(target=_all_reduce_rank, args=(r, store.port, errors)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert [p.exitcode for p in ranks] == [0, 0]
