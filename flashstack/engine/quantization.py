"""Quantized projection weights, kept quantized in memory and dequantized inside the products.

- "fp8": float8_e4m3fn values with one float32 scale per output row, w = scale[:, None] * q. Made
  at load from a bf16 checkpoint (`quantize_rows`, EngineConfig.quantization = "fp8") or read from
  an fp8 Hugging Face checkpoint in the compressed-tensors format (`checkpoint_quantization`):
  `<proj>.weight` in float8_e4m3fn beside `<proj>.weight_scale`, one scale per output channel
  ([N, 1]) or one for the whole tensor ([1] or []), which the loader spreads over the rows.
- "q8_0": llama.cpp's Q8_0, int8 values with one float16 scale per 32 consecutive weights of a row
  ([N, K / 32]): 1.0625 bytes a weight. A GGUF file's Q8_0 tensors are kept as they are stored
  (bit for bit); any other checkpoint is quantized at load (`quantize_blocks`, ggml's rounding).
- "q4_k": llama.cpp's Q4_K, 4-bit values in super-blocks of 256 weights, each 32 with a 6-bit scale
  and a 6-bit min under the super-block's float16 d and dmin, w = d * sc * q - dmin * m: 4.5 bits
  a weight as stored. Held as the stored values, uint8 [N, K / 2] (two a byte, in ggml's order),
  beside the headers unpacked into int32 words [N, K / 64 + K / 256] (`unpack_q4_k_heads`): first
  one word per 64 weights, the scale and min of its two sub-blocks a byte each, then one word per
  super-block, d and dmin. ggml packs the 6-bit numbers into 12 bytes, which a kernel can only
  take apart with a dozen byte loads per 64 weights; unpacked, it is two word loads, for 4.625 bits
  a weight instead of 4.5, every value unchanged. A GGUF file's Q4_K tensors are kept so; any other
  weight is quantized at load (`quantize_q4_k`, ggml's search for each sub-block's scale and min).
  Rows must be whole super-blocks; a projection whose rows are not (SmolLM2's 576 inputs) takes
  Q8_0 instead, as llama.cpp's own quantizer falls back for such rows.

Activations stay in the compute dtype (W8A16) except in the products of 2 to 128 rows on fp8
weights (KernelOptions.fp8_activations): there each activation row is quantized to e4m3 under its
own scale (`quantize_activations`, dynamic per token, as vLLM's fp8 W8A8) and the product is taken
on the fp8 tensor cores (`fp8_activations_linear` is its plain-torch form). A checkpoint's
`input_scale` (static activation quantization) is not read. The products: kernels/triton_gemv.py
for one row on CUDA (the scales applied to each row's, or each block's, dot),
kernels/triton_skinny.py for a few rows, `dequantized_linear` elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448, e4m3's largest finite value
Q8_BLOCK = 32  # weights per float16 scale in a Q8_0 block
Q4K_BLOCK = 256  # weights per Q4_K super-block
Q4K_HEAD = 16  # bytes of a stored super-block's header: d, dmin (float16), 12 of scales and mins
FP8_ACT_MAX_ROWS = 128  # the most rows a product with fp8 activations has: the skinny GEMM's
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


def _ggml_scales(head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's 6-bit scale and min, int32 [..., 8], from stored headers [..., 16]. Of the
    12 bytes after d and dmin, 0-3 hold sub-blocks 0-3's scales (6 bits) and the top 2 bits of
    4-7's, 4-7 the same for the mins, 8-11 the low 4 bits of sub-blocks 4-7's scale and min."""
    s = head[..., 4:16].int()
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def _q4_k_words(sc: torch.Tensor, mn: torch.Tensor, halves: torch.Tensor) -> torch.Tensor:
    # sc, mn int [N, blocks, 8] and halves int32 [N, blocks] (d | dmin << 16) -> the words
    n = sc.shape[0]
    pairs = (sc | (mn << 8)).reshape(n, -1, 4, 2)
    groups = pairs[..., 0] | (pairs[..., 1] << 16)
    return torch.cat([groups.reshape(n, -1), halves.reshape(n, -1)], dim=1).int().contiguous()


def unpack_q4_k_heads(head: torch.Tensor) -> torch.Tensor:
    """Stored Q4_K headers uint8 [N, K / 16] -> the engine's int32 words [N, K / 64 + K / 256]: per
    64 weights (two sub-blocks, j and j + 1) scale_j | min_j << 8 | scale_j+1 << 16 | min_j+1 << 24,
    then per super-block d | dmin << 16 (their float16 bits)."""
    blocks = head.reshape(head.shape[0], -1, Q4K_HEAD)
    sc, mn = _ggml_scales(blocks)
    return _q4_k_words(sc, mn, blocks[..., 0:4].contiguous().view(torch.int32))


def _q4_k_scales(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) of each sub-block as float32 [N, K / 32], as ggml multiplies them out (d * sc,
    dmin * m), from the engine's words [N, K / 64 + K / 256]."""
    n = words.shape[0]
    blocks = words.shape[1] // 5  # 4 group words and 1 super-block word per 256 weights
    groups = words[:, : 4 * blocks]
    sub = torch.stack([groups & 0xFFFF, (groups >> 16) & 0xFFFF], dim=-1).reshape(n, -1)
    halves = words[:, 4 * blocks :].contiguous().view(torch.float16).float()  # [N, 2 * blocks]
    d = halves[:, 0::2].repeat_interleave(8, dim=1)
    dmin = halves[:, 1::2].repeat_interleave(8, dim=1)
    return d * (sub & 255), dmin * (sub >> 8)


def dequantize_q4_k(qs: torch.Tensor, words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] a Q4_K one stands for, in `dtype`: values `qs` [N, K / 2] (in each 32
    bytes the low nibbles are 32 weights and the high ones the next 32) and the unpacked headers
    [N, K / 64 + K / 256] (each value d * sc * q - dmin * m in float32, as ggml's)."""
    n, k = qs.shape[0], qs.shape[1] * 2
    scale, mn = _q4_k_scales(words)
    shifts = torch.tensor([0, 4], device=qs.device)[:, None]
    q = ((qs.reshape(n, k // 64, 1, 32).int() >> shifts) & 15).reshape(n, k // 32, 32).float()
    return (scale[..., None] * q - mn[..., None]).reshape(n, k).to(dtype)


def _nearest(x: torch.Tensor) -> torch.Tensor:
    # ggml's nearest_int: round half to even (it adds 1.5 * 2^23 in float32)
    return torch.round(x).int()


def _sub_block_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx2_quants for 4 bits over sub-blocks x [..., 32]: (scale, min >= 0, values),
    w ~ scale * q - min, the least weighted squared error over 21 trial scales, each refined by
    least squares; weights |x| + rms(x), as quantize_row_q4_K_ref takes them."""
    weights = x.square().mean(-1, keepdim=True).sqrt() + x.abs()
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    span = hi - lo
    flat = span == 0
    span = torch.where(flat, torch.ones_like(span), span)
    sum_w = weights.sum(-1, keepdim=True)
    sum_x = (weights * x).sum(-1, keepdim=True)

    def levels(iscale: torch.Tensor) -> torch.Tensor:
        return _nearest(iscale * (x - lo)).clamp(0, 15).float()

    def error(scale: torch.Tensor, mn: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (weights * (scale * q + mn - x).square()).sum(-1, keepdim=True)

    scale, mn = 1 / (15 / span), lo
    q = levels(15 / span)
    best = error(scale, mn, q)
    for step in range(21):
        # ggml's trial factor, in float32 as it computes it: rmin + rdelta * step + nmax
        factor = float(np.float32(-1) + np.float32(0.1) * np.float32(step) + np.float32(15))
        trial = levels(factor / span)
        sum_l = (weights * trial).sum(-1, keepdim=True)
        sum_l2 = (weights * trial * trial).sum(-1, keepdim=True)
        sum_xl = (weights * trial * x).sum(-1, keepdim=True)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, torch.ones_like(det))
        t_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        t_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = t_min > 0  # the min is held as a non-negative offset: refit the scale alone
        t_scale = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), t_scale)
        t_min = torch.where(positive, torch.zeros_like(t_min), t_min)
        t_err = error(t_scale, t_min, trial)
        better = (det > 0) & (t_err < best) & ~flat & ~(positive & (sum_l2 == 0))
        q = torch.where(better, trial, q)
        best = torch.where(better, t_err, best)
        scale = torch.where(better, t_scale, scale)
        mn = torch.where(better, t_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    q = torch.where(flat, torch.zeros_like(q), q)
    return scale[..., 0], -mn[..., 0], q


def quantize_q4_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qs, words): w [N, K] as Q4_K, values uint8 [N, K / 2] and the unpacked headers int32
    [N, K / 64 + K / 256], by ggml's quantize_row_q4_K_ref (each sub-block's scale and min
    searched, both quantized to 6 bits of the super-block's largest, the values re-rounded against
    them): the bytes a GGUF file of the same weights holds, headers unpacked."""
    n, k = w.shape
    if k % Q4K_BLOCK:
        raise ValueError(f"Q4_K needs rows of a multiple of {Q4K_BLOCK} weights, not {k}")
    x = w.float().reshape(n, k // Q4K_BLOCK, 8, 32)
    scale, mn, q = _sub_block_scales(x)
    max_scale, max_min = scale.amax(-1, keepdim=True), mn.amax(-1, keepdim=True)
    inv_scale = torch.where(max_scale > 0, 63 / max_scale, torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, 63 / max_min, torch.zeros_like(max_min))
    ls = _nearest(inv_scale * scale).clamp(max=63)
    lm = _nearest(inv_min * mn).clamp(max=63)
    d = (max_scale / 63).to(torch.float16)
    dmin = (max_min / 63).to(torch.float16)
    sub_d = d.float() * ls
    sub_m = dmin.float() * lm
    safe = torch.where(sub_d != 0, sub_d, torch.ones_like(sub_d))
    fresh = _nearest((x + sub_m[..., None]) / safe[..., None]).clamp(0, 15)
    # a sub-block whose 6-bit scale came out 0 keeps the values of its search
    q = torch.where((sub_d != 0)[..., None], fresh, q.int())
    packed = q.reshape(n, k // Q4K_BLOCK, 4, 2, 32)
    qs = (packed[:, :, :, 0] | (packed[:, :, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2)
    halves = torch.cat([d, dmin], dim=-1).contiguous().view(torch.int32)
    return qs, _q4_k_words(ls, lm, halves)


def dequantized_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ w.T (+ bias) in x's dtype, w the weight q and `scale` stand for (fp8, Q8_0 or Q4_K's
    values and words): plain torch, any number of rows, any device.

    fp8's q is exact in bf16 and float32 (3 mantissa bits), so its product is taken with q itself
    and scaled after, in float32, as the GEMV does; Q8_0's scales vary along the row, so its weight
    is dequantized first."""
    if q.dtype == torch.uint8:
        return nn.functional.linear(x, dequantize_q4_k(q, scale, x.dtype), bias)
    if q.dtype == torch.int8:
        return nn.functional.linear(x, dequantize_blocks(q, scale, x.dtype), bias)
    y = (nn.functional.linear(x, q.to(x.dtype)) * scale).to(x.dtype)
    return y if bias is None else y + bias


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x [M, K] as float8_e4m3fn [M, K] with one float32 scale per row [M], each row's
    largest magnitude mapped to 448 (an all-zero row gets scale 1)."""
    amax = x.float().abs().amax(dim=1)
    # a tensor divisor: torch's CUDA kernels multiply by the reciprocal of a scalar one, which is
    # not the kernel's correctly rounded quotient
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return quantize_fp8(x, scale[:, None]), scale


def fp8_activations_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ w.T (+ bias) in x's dtype with x quantized as `quantize_activations` does and w the fp8
    weight q with its row scales: the W8A8 product of the skinny GEMM, in plain torch (float32
    sums: every product of two e4m3 values is exact in float32)."""
    xq, xs = quantize_activations(x)
    y = nn.functional.linear(xq.float(), q.float()) * xs[:, None] * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


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
