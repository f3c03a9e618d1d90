"""Shared test helpers: run the engine while checking block-manager invariants after every step."""

from __future__ import annotations

from typing import Any

import torch

from flashstack.engine import LLM, SamplingParams
from flashstack.engine.llm import LLMEngine

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def check_engine(engine: LLMEngine) -> None:
    """free + used == total; refcounts match block tables; finished requests own nothing."""
    engine.block_manager.check_invariants(engine.scheduler.seqs)


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding that never stops early."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_checked(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    """Generate with invariant checks after each step; at the end every block must be free."""
    llm.step_hook = check_engine
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    return [o.token_ids for o in outs]


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding, EOS disabled)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
