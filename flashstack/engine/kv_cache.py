"""The KV cache's element type: the model's dtype ("auto"), or float8 e4m3 with scales ("fp8"); and
its allocation (`allocate_kv_cache`).

An fp8 cache (vLLM's kv_cache_dtype="fp8") holds K / k_scale and V / v_scale, with one k_scale and
one v_scale per layer, fixed for the engine's life: a cached block means the same to every later
step (prefix caching, swap), and a CUDA graph reads the scales from memory. They are calibrated once
at start-up: the model runs a fixed text through a cache in its own dtype, and each layer's scale is
its largest |K| (|V|) times HEADROOM over 448, e4m3's largest value. A value past that range at run
time saturates at +-448 * scale. e4m3 keeps its 3 mantissa bits over 2^-6..448, so the headroom
costs only the smallest values, which move a dot product least.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flashstack.cuda.torch_interop import device_for
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend
from flashstack.engine.models.ops import TorchOps
from flashstack.engine.quantization import FP8, FP8_MAX

# Calibration's largest |K| and |V| times this is what the scales can hold. Over
# bench/engine_fp8_kv.py's texts (a novel's first chapter, 16 chats) the trained SmolLM2's largest
# |K| reaches 1.32 and its largest |V| 1.71 times calibration's (layer by layer), so nothing
# saturates; with scales 16 times larger one chat's 16 teacher-forced picks all stayed the same.
HEADROOM = 2.0

CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers "
    "that changed physics: on the photoelectric effect, Brownian motion, special relativity and "
    "the equivalence of mass and energy, E = mc^2.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "User: What is the capital of Japan, and how many people live there?\n"
    "Assistant: The capital of Japan is Tokyo. About 14 million people live in the city proper, "
    "and close to 37 million in the greater Tokyo area, the largest metropolitan area on Earth.\n"
    "| year | revenue | margin |\n| 2021 | $4.2M | 12.5% |\n| 2022 | $5.9M | 14.1% |\n"
    "Les feuilles tombent en automne; el invierno es frio; der Sommer ist warm. "
    "東京は日本の首都です。"
)


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed KV cache. On the CPU its pages are committed as blocks are first written, not all
    at start-up: calloc's zeroed mapping (through numpy; torch.zeros writes every page), so an
    engine that sizes its cache by kv_cache_memory_gb holds the memory its sequences fill."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device):
    """The cache's torch dtype: the model's for "auto", float8_e4m3fn for "fp8" (CPU, and GPUs
    that convert fp8 in hardware)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if device.type == "cuda":
        cc = device_for(device).compute_capability
        if cc < (8, 9):
            raise ValueError(
                f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or later (Ada, "
                f"Hopper); this one is {cc[0]}.{cc[1]}: use kv_cache_dtype='auto'"
            )
    return FP8


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The calibration text's tokens (a fixed spread of ids for a model without a tokenizer)."""
    if tokenizer is not None:
        return tokenizer.encode(CALIBRATION_TEXT)
    return [(i * 7919 + 13) % vocab_size for i in range(256)]


@torch.inference_mode()
def calibrate_kv_scales(model, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[layers, 2] fp32: each layer's k_scale and v_scale from one forward of `token_ids` through
    a cache in `dtype` (plain torch ops)."""
    a, device, n = model.args, model.lm_head.weight.device, len(token_ids)
    caches = [
        torch.zeros(1, 2, n, a.num_kv_heads, a.head_dim, dtype=dtype, device=device)
        for _ in range(a.num_layers)
    ]
    ops = TorchOps(get_attention_backend("reference", device))
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    model(
        ids,
        torch.arange(n, device=device),
        AttentionMetadata.whole_prefill(n, n, device),
        caches,
        ops,
    )
    amax = torch.stack([c[0].abs().float().amax(dim=(1, 2, 3)) for c in caches])  # [layers, K|V]
    # an all-zero layer (a checkpoint's dead head) still gets a scale that divides
    return (amax * HEADROOM / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def set_kv_scales(model, scales: torch.Tensor) -> None:
    """Give each attention layer its [k_scale, v_scale] row of `scales` ([layers, 2])."""
    for layer, row in zip(model.model.layers, scales.float().contiguous()):
        layer.self_attn.kv_scale = row
