"""Greedy LLM.generate is token-identical to transformers for every family and scheduling mode."""

from __future__ import annotations

import pytest

from flashstack.engine import LLM
from tests.engine.helpers import FAMILIES, greedy, hf_greedy, run_checked

MAX_TOKENS = 12
_SHARED = [7 + (i * 13) % 300 for i in range(21)]  # a 21-token system-prompt-like prefix
PROMPTS = [
    _SHARED + [40, 41, 42],
    [3, 4],
    _SHARED + [50, 51, 52, 53, 54, 55, 56, 57, 58],
    [100 + i for i in range(37)],
    _SHARED + [40, 41, 42],  # a duplicate: shares every full block with the first prompt
    [9],
]


@pytest.fixture(scope="module")
def hf_refs(hf_checkpoints) -> dict[str, list[list[int]]]:
    """transformers' greedy outputs per family."""
    return {
        fam: [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
        for fam, (_, model) in hf_checkpoints.items()
    }


MODES = {
    "plain": dict(block_size=8, enable_prefix_caching=False),
    "prefix_cache": dict(block_size=4, enable_prefix_caching=True),
    "preemption": dict(block_size=4, num_kv_blocks=26, max_num_seqs=8),
    "chunked_prefill": dict(block_size=8, max_num_batched_tokens=6, enable_prefix_caching=False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family: str, mode: str, hf_checkpoints, hf_refs) -> None:
    path, _ = hf_checkpoints[family]
    llm = LLM(path, device="cpu", show_progress=False, **MODES[mode])
    got = run_checked(llm, PROMPTS, greedy(MAX_TOKENS))
    for i, (g, ref) in enumerate(zip(got, hf_refs[family])):
        assert g == ref, f"{family}/{mode} prompt {i}: engine {g} != transformers {ref}"
    sched = llm.engine.scheduler
    if mode == "preemption":
        assert sched.num_preemptions > 0, "the KV budget was meant to force preemption"
    if mode == "chunked_prefill":
        assert sched.num_chunked_prefills > 0
    if mode == "prefix_cache":
        # A second pass reuses blocks cached by the first (same step admits can't share) and must
        # stay exact.
        again = run_checked(llm, PROMPTS, greedy(MAX_TOKENS))
        assert again == hf_refs[family]
        assert llm.engine.block_manager.num_prefix_hits > 0, "shared prefixes should hit the cache"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tabulated_rotary_angles_equal_computed_ones(dtype) -> None:
    """The per-position cos/sin table gives exactly the values a step would compute itself."""
    import torch

    from flashstack.engine.models.layers import RotaryEmbedding

    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    tabulated = RotaryEmbedding(128, params, max_positions=4096).to(device)
    computed = RotaryEmbedding(128, params).to(device)
    positions = torch.tensor([0, 1, 577, 4095, 2048, 1], device=device)
    dt = getattr(torch, dtype)
    for got, want in zip(tabulated(positions, dt), computed(positions, dt)):
        assert got.shape == want.shape == (6, 1, 128) and got.dtype == dt
        assert torch.equal(got, want)
