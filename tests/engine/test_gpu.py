"""The engine on CUDA (reference attention until Triton lands); skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine import LLM, SamplingParams
from tests.engine.helpers import greedy, hf_greedy, run_checked

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_fp32_greedy_matches_transformers(family: str, hf_checkpoints) -> None:
    path, model = hf_checkpoints[family]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 53))]
    refs = [hf_greedy(model, p, 10) for p in prompts]
    llm = LLM(path, block_size=16, device="cuda", dtype="float32", show_progress=False)
    assert run_checked(llm, prompts, greedy(10)) == refs


def test_cuda_bf16_and_seeded_sampling(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir, block_size=256, device="cuda", dtype="bfloat16", show_progress=False)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    out = llm.generate(["def main():", "import os"], greedy(16))
    assert all(len(o.token_ids) == 16 for o in out)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    assert llm.generate("hello", params)[0].token_ids == llm.generate("hello", params)[0].token_ids


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_graphs_and_eager_agree_with_transformers(enforce_eager: bool, hf_checkpoints) -> None:
    path, model = hf_checkpoints["llama"]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 53)), [9] * 40]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    llm = LLM(
        path,
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        enforce_eager=enforce_eager,
        max_num_seqs=8,
    )
    assert (llm.engine.runner.graphs is None) == enforce_eager
    assert llm.engine.runner.backend.name == "triton"
    assert run_checked(llm, prompts, greedy(12)) == refs


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """calls["n"]: how many times the sampler after a replay ran (model_runner.sample_on_device)."""
    from flashstack.engine import model_runner

    counts = {"n": 0}
    sample = model_runner.sample_on_device

    def counted(*a, **kw):
        counts["n"] += 1
        return sample(*a, **kw)

    monkeypatch.setattr(model_runner, "sample_on_device", counted)
    return counts


def test_cuda_graph_argmax_serves_greedy_steps(hf_checkpoints, calls) -> None:
    """With the argmax in the decode graphs, all-greedy decode steps launch no sampling of their
    own and still give transformers' tokens; a sampled row beside greedy ones is sampled from the
    same graph's logits, the greedy rows unchanged."""
    path, model = hf_checkpoints["llama"]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 53))]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    launches = {}
    kw = dict(block_size=16, device="cuda", dtype="float32", show_progress=False, max_num_seqs=8)
    for in_graph in (False, True):  # the last one serves the mixed batch below
        llm = LLM(path, kernels={"argmax_in_graph": in_graph}, **kw)
        calls["n"] = 0
        assert run_checked(llm, prompts, greedy(12)) == refs
        launches[in_graph] = calls["n"]
    assert launches[True] + 10 <= launches[False]  # the decode steps sampled inside the graph
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = llm.generate(prompts[:2], [greedy(12), sampled])
    assert out[0].token_ids == refs[0] and len(out[1].token_ids) == 12


def test_cuda_graph_sampler_draws_temperature_steps_itself(hf_checkpoints, calls) -> None:
    """With the sampler in the decode graphs (kernels.sample_in_graph), steps of greedy rows and
    rows at a temperature alone launch no sampling of their own: the greedy rows keep
    transformers' tokens, the draws follow torch's global seed, and a row with a seed of its own
    sends its steps back to the sampler after the replay."""
    path, model = hf_checkpoints["llama"]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 53))]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    kw = dict(block_size=16, device="cuda", dtype="float32", show_progress=False, max_num_seqs=8)
    llm = LLM(path, kernels={"sample_in_graph": True}, **kw)
    hot = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    params = [greedy(12), hot, hot]

    def drawn(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        calls["n"] = 0
        out = [o.token_ids for o in llm.generate(prompts, params)]
        assert calls["n"] <= 2, "decode steps sampled after the replay"  # the prompts' steps
        return out

    first = drawn(1)
    assert first[0] == refs[0]
    assert all(len(t) == 12 and max(t) < model.config.vocab_size for t in first)
    assert drawn(1) == first  # torch's seed fixes the graph's draws
    assert drawn(2)[1:] != first[1:]
    calls["n"] = 0
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, [greedy(12), hot, seeded])
    assert calls["n"] >= 10  # a row with its own generator: sampled after every replay


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("programs_per_sm", [1, 3], ids=["one-an-sm", "three-an-sm"])
@pytest.mark.parametrize("tagged", [True, False], ids=["tagged", "counts"])
def test_persistent_decoder_matches_transformers(
    family: str, programs_per_sm: int, tagged: bool, hf_checkpoints
) -> None:
    """Batch-1 decode steps with every layer in one persistent kernel (kernels.
    persistent_decoder), replayed in CUDA graphs and run eagerly: transformers' greedy tokens.
    Three programs an SM start from the atomic queue, then take turns once the compiled kernel
    is known to fit them all (its registers capped for three); the residual stream in tagged
    words or after counts (the default)."""
    path, model = hf_checkpoints[family]
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 53))]
    refs = [hf_greedy(model, p, 24) for p in prompts]
    kernels = {
        "persistent_decoder": True,
        "persistent_decoder_programs_per_sm": programs_per_sm,
        "persistent_decoder_tagged": tagged,
    }
    for eager in (False, True):
        llm = LLM(
            path,
            block_size=16,
            device="cuda",
            dtype="float32",
            show_progress=False,
            max_num_seqs=1,
            enforce_eager=eager,
            kernels=kernels,
        )
        ops = llm.engine.runner.ops.for_tokens(1)
        assert [run_checked(llm, [p], greedy(24))[0] for p in prompts] == refs
        decoders = [d for d in ops._decoders.values() if d is not None]
        assert decoders, "the decoder never ran"
        assert all(d.round_robin and d.stalls() == 0 for d in decoders)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_multi_row_decode_qkv_matches_transformers(family: str, hf_checkpoints) -> None:
    """Decode steps of several rows whose attention kernel also rotates q/k (Qwen3: after its
    q/k norms) and stores the new k/v (kernels.decode_qkv_rows), in CUDA graphs: transformers'
    greedy tokens, contexts of different lengths in one step."""
    path, model = hf_checkpoints[family]
    prompts = [list(range(10 + i, 17 + 7 * i)) for i in range(5)]
    refs = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(
        path,
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        max_num_seqs=8,
        kernels={"decode_qkv_rows": 8},
    )
    assert run_checked(llm, prompts, greedy(16)) == refs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "option,values",
    [
        ("decode_unmasked_v", (False, True)),
        ("decode_idle_exit", (False, True)),
        ("decode_preload_rows", (0, 3)),
    ],
    ids=["unmasked_v", "idle_exit", "preload"],
)
def test_attention_options_change_no_token(
    family: str, option: str, values: tuple, hf_checkpoints
) -> None:
    """Options that leave decode attention's numbers as they are, off against on, in bf16 with
    graphs (block size 256: TMA tiles) at batch 1 and 3: kernels.decode_unmasked_v (V's tiles
    feed P @ V with their rows past the context as fetched: the engine's zeroed cache holds only
    finite values there, each weighing exactly 0), kernels.decode_idle_exit (splits past the
    context return before the wait) and kernels.decode_preload_rows (each split's first K and V
    tiles fetched before the wait)."""
    path, _ = hf_checkpoints[family]
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 153)), list(range(40, 100))]
    runs = []
    for value in values:
        llm = LLM(
            path,
            block_size=256,  # TMA tiles lie inside a block
            device="cuda",
            dtype="bfloat16",
            show_progress=False,
            max_num_seqs=3,
            kernels={option: value},
        )
        runs.append(
            [run_checked(llm, [prompts[0]], greedy(24))[0], *run_checked(llm, prompts, greedy(24))]
        )
        del llm
    assert runs[0] == runs[1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_mlp_keeps_transformers_tokens(family: str, hf_checkpoints) -> None:
    """kernels.fused_mlp: batch-1 steps (graphs and eager) with each MLP one kernel and its
    float32 row taken in by the next layer: transformers' greedy tokens in float32, and, with
    batch-1 steps beside multi-row ones, every sequence's."""
    path, model = hf_checkpoints[family]
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 53))]
    refs = [hf_greedy(model, p, 16) for p in prompts]
    opts: dict = dict(device="cuda", dtype="float32", show_progress=False, block_size=16)
    llm = LLM(path, max_num_seqs=4, kernels={"fused_mlp": True}, **opts)
    assert [run_checked(llm, [p], greedy(16))[0] for p in prompts] == refs
    assert run_checked(llm, prompts, greedy(16)) == refs
    del llm
    eager = LLM(path, enforce_eager=True, kernels={"fused_mlp": True}, **opts)
    assert run_checked(eager, [prompts[0]], greedy(16))[0] == refs[0]


@pytest.mark.parametrize("fetch", [True, False], ids=["fetched", "copied"])
@pytest.mark.parametrize("sample_in_graph", [False, True], ids=["argmax", "sampler"])
def test_graphs_fetching_their_inputs_keep_transformers_tokens(
    fetch: bool, sample_in_graph: bool, hf_checkpoints
) -> None:
    """kernels.graph_fetches_inputs: each graph reads its step from the pinned ring and the ids
    from the tokens the graph before took. Rows that leave at different steps make the next
    step's ids a gather of the last tokens; every staged step is taken, in order, and the greedy
    tokens are transformers' (the graph's sampler reads its temperatures from the ring too).
    Off, the copies on the stream (a tensor-parallel group's way) give the same tokens."""
    path, model = hf_checkpoints["llama"]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 53)), [9] * 40]
    lengths = [14, 5, 9, 14]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(
        path,
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        max_num_seqs=8,
        kernels={"graph_fetches_inputs": fetch, "sample_in_graph": sample_in_graph},
    )
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (graphs.ring is not None) == fetch
    params = [greedy(n) for n in lengths]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    assert run_checked(llm, prompts, params) == refs
    hot = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    out = llm.generate(prompts, [greedy(14), hot, hot, greedy(14)])
    assert out[0].token_ids == refs[0] and out[3].token_ids == refs[3]
    assert len(out[1].token_ids) == 10
    if fetch:
        torch.cuda.synchronize()
        assert graphs.ring.written > 20
        assert graphs.ring.state.tolist() == [graphs.ring.written, 0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_launch_completion_edges_keep_transformers_tokens(family: str, hf_checkpoints) -> None:
    """kernels.pdl_on_launch_completion (the default): 40 rows a step (past the skinny GEMM's
    32, so cuBLAS's products sit between PDL kernels), the edges behind them moved in every
    graph, and the greedy tokens still transformers'."""
    path, model = hf_checkpoints[family]
    prompts = [list(range(10 + i, 14 + i + i % 7)) for i in range(40)]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    llm = LLM(
        path,
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        max_num_seqs=40,
        kernels={"pdl_on_launch_completion": True},
    )
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.opened_edges
    assert graphs.opened_edges[graphs.key_for(40, 64)] > 0
    assert run_checked(llm, prompts, greedy(12)) == refs


def test_cuda_preemption_under_memory_pressure_matches(hf_checkpoints) -> None:
    path, model = hf_checkpoints["qwen3"]
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    refs = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(
        path,
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        num_kv_blocks=12,
        max_num_seqs=6,
    )
    assert run_checked(llm, prompts, greedy(16)) == refs


@pytest.mark.parametrize(
    "graph_tokens", [2048, 24, 0], ids=["mixed-graphs", "graphs-then-eager", "mixed-eager"]
)
def test_cuda_mixed_steps_agree_with_transformers(graph_tokens: int, hf_checkpoints) -> None:
    """Prompts arriving while others decode share steps with those decodes (chunked prefill):
    through the mixed-step graphs (their buckets padded), past their largest bucket (eager), or
    with them off, every greedy token is transformers'."""
    path, model = hf_checkpoints["qwen3"]
    prompts = [list(range(10 + i, 17 + 9 * i)) for i in range(6)]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    llm = LLM(
        path,
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        mixed_step_graph_tokens=graph_tokens,
    )
    graphs = llm.engine.runner.mixed_graphs
    assert (graphs is None) == (graph_tokens == 0)
    replayed: list[int] = []
    if graphs is not None:
        assert graphs.max_tokens == min(graph_tokens, 64)
        forward = graphs.forward
        graphs.forward = lambda ids, *a: replayed.append(ids.shape[0]) or forward(ids, *a)
    engine, rids, outs = llm.engine, [], {}
    for p in prompts:  # one new prompt every two steps
        rids.append(engine.add_request(p, greedy(12)))
        for _ in range(2):
            for d in engine.step():
                outs.setdefault(d.request_id, []).extend(d.token_ids)
    while engine.has_unfinished_requests():
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    assert [outs[r] for r in rids] == refs
    if graphs is not None:
        assert replayed and all(n <= graphs.max_tokens for n in replayed)
        assert any(n not in graphs.buckets for n in replayed)  # padded to a bucket


def test_cuda_long_chunks_take_the_piecewise_graphs(tmp_path) -> None:
    """A step whose chunks are all long enough for torch's fused attention replays the graphs
    between attentions instead of the whole-step graph; greedy tokens stay transformers'."""
    from flashstack.engine.kernels.attention import SDPA_MIN_QUERY_LEN
    from tests.engine.conftest import make_hf_model

    model = make_hf_model("qwen3")
    model.config.max_position_embeddings = 2048  # the tiny checkpoints stop at 512 positions
    model.save_pretrained(tmp_path)
    prompts = [[(7 * i + j) % 250 + 3 for i in range(SDPA_MIN_QUERY_LEN + 40)] for j in (0, 1)]
    refs = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(
        str(tmp_path),
        block_size=16,
        device="cuda",
        dtype="float32",
        show_progress=False,
        max_num_seqs=4,
        max_num_batched_tokens=4096,
        mixed_step_graph_tokens=4096,
    )
    graphs = llm.engine.runner.mixed_graphs
    assert graphs is not None and graphs.pieces and graphs.whole
    kinds: list[str] = []
    piecewise, whole = graphs._piecewise, graphs._replay_whole
    graphs._piecewise = lambda *a: kinds.append("pieces") or piecewise(*a)
    graphs._replay_whole = lambda *a: kinds.append("whole") or whole(*a)
    assert run_checked(llm, prompts, greedy(8)) == refs
    assert kinds and set(kinds) == {"pieces"}  # one step of two 1,064-token chunks


def test_cuda_one_sequence_across_the_short_context_graph(tmp_path) -> None:
    """Bucket 1 has a second graph for short contexts; a sequence whose context grows past its
    bound moves to the other graph mid-generation, and its greedy tokens stay transformers'."""
    from flashstack.engine.kernels.triton_attention import SHORT_DECODE_CONTEXT
    from tests.engine.conftest import make_hf_model

    model = make_hf_model("llama")
    model.config.max_position_embeddings = 2048  # the tiny checkpoints stop at 512 positions
    model.save_pretrained(tmp_path)
    prompt = [(7 * i) % 250 + 3 for i in range(SHORT_DECODE_CONTEXT - 12)]
    ref = hf_greedy(model, prompt, 24)
    llm = LLM(
        tmp_path, block_size=16, device="cuda", dtype="float32", show_progress=False, max_num_seqs=4
    )
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.max_model_len > SHORT_DECODE_CONTEXT
    assert graphs.bounds[1] == [SHORT_DECODE_CONTEXT, graphs.max_model_len]
    assert run_checked(llm, [prompt], greedy(24)) == [ref]
