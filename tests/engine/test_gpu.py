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
