"""Quantized projection weights, kept quantized in memory and dequantized inside the products.

- "fp8": float8_e4m3fn values with one float32 scale per output row, w = scale[:, None] * q. Made
  at load from a bf16 checkpoint (`quantize_rows`, EngineConfig.quantization = "fp8") or read from
  an fp8 Hugging Face checkpoint in the compressed-tensors format (`checkpoint_quantization`):
  `<proj>.weight` in float8_e4m3fn beside `<proj>.weight_scale`, one scale per output channel
  ([N, 1]) or one for the whole tensor ([1] or []), which the loader spreads over the rows.
- "q8_0": llama.cpp's Q8_0, int8 values with one float16 scale per 32 consecutive weights of a row
  ([N, K / 32]): 1.0625 bytes a weight. A GGUF file's Q8_0 tensors are kept as they are stored
  (bit for bit); any other checkpoint is quantized at load (`quantize_blocks`, ggml's rounding).

Only the weights are quantized: activations stay in the compute dtype (W8A16), so a checkpoint's
`input_scale` (static activation quantization) is not read, and dynamic activation schemes need
nothing. The products: kernels/triton_gemv.py for one row on CUDA (the scales applied to each
row's, or each block's, dot), `dequantized_linear` elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448, e4m3's largest finite value
Q8_BLOCK = 32  # weights per float16 scale in a Q8_0 block
# compressed-tensors formats whose fp8 weights are stored as plain float8_e4m3fn tensors
_FP8_FORMATS = ("float-quantized", "naive-quantized")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float8_e4m3fn, rounded to nearest even and saturated at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): w [N, K] as float8_e4m3fn with one float32 scale per row, the row's largest
    magnitude mapped to fp8's largest (448); an all-zero row gets scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return quantize_fp8(w, scale[:, None]), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an fp8 one stands for, in `dtype` (rounded once, from float32)."""
    return (q.float() * scale[:, None]).to(dtype)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): w [N, K] as Q8_0, int8 [N, K] with float16 scales [N, K / 32], rounded as ggml
    rounds (d = block amax / 127, q = x / d rounded half away from zero), so a GGUF file written
    from the same values holds the same bytes."""
    n, k = w.shape
    if k % Q8_BLOCK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {Q8_BLOCK} weights, not {k}")
    blocks = w.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    d = blocks.abs().amax(dim=2) / 127
    scaled = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))[..., None]
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    return q.reshape(n, k), d.to(torch.float16)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a Q8_0 one stands for, in `dtype` (each value q * d in float32, as ggml's)."""
    n, k = q.shape
    blocks = q.float().reshape(n, k // Q8_BLOCK, Q8_BLOCK) * scale.float()[..., None]
    return blocks.reshape(n, k).to(dtype)


def dequantized_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ w.T (+ bias) in x's dtype, w the weight q and `scale` stand for (fp8 or Q8_0): plain
    torch, any number of rows, any device.

    fp8's q is exact in bf16 and float32 (3 mantissa bits), so its product is taken with q itself
    and scaled after, in float32, as the GEMV does; Q8_0's scales vary along the row, so its weight
    is dequantized first."""
    if q.dtype == torch.int8:
        return nn.functional.linear(x, dequantize_blocks(q, scale, x.dtype), bias)
    y = (nn.functional.linear(x, q.to(x.dtype)) * scale).to(x.dtype)
    return y if bias is None else y + bias


def checkpoint_quantization(hf: dict[str, Any]) -> str | None:
    """'fp8' for a compressed-tensors checkpoint of fp8 weights (per channel or per tensor), None
    for an unquantized one; any other scheme is a ValueError naming it."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported: the engine reads "
            "compressed-tensors fp8 checkpoints, or quantizes a bf16 one at load "
            "(quantization='fp8')"
        )
    fmt = qc.get("format")
    if fmt == "dense":
        return None
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        scheme = (
            f"format {fmt!r}, group {name!r}: {w.get('num_bits')}-bit {w.get('type')} weights "
            f"by {w.get('strategy')}"
        )
        supported = (
            fmt in _FP8_FORMATS
            and w.get("num_bits") == 8
            and w.get("type") == "float"
            and w.get("strategy") in ("channel", "tensor")
            and w.get("symmetric", True)
            and not w.get("dynamic")
        )
        if not supported:
            raise ValueError(
                f"compressed-tensors scheme not supported ({scheme}): the engine reads 8-bit "
                "float weights quantized by channel or by tensor (format 'float-quantized')"
            )
    return "fp8" if groups else None


def resolve_quantization(requested: str | None, hf: dict[str, Any]) -> str | None:
    """What the linear weights are stored as: the checkpoint's fp8, else what was asked for."""
    return checkpoint_quantization(hf) or requested
