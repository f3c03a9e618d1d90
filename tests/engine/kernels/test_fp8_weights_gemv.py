"""The batch-1 GEMV on fp8 weights (float8_e4m3fn, one scale per row) against the plain-torch
product of the dequantized weight, with each input prologue and output epilogue the decoder uses."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashstack.engine.kernels import triton_gemv as tg
from flashstack.engine.kernels.attention import get_attention_backend
from flashstack.engine.models import LlamaForCausalLM
from flashstack.engine.models.layers import RMSNorm
from flashstack.engine.models.linear import Linear
from flashstack.engine.models.ops import Batch1Ops, TorchOps, TritonOps
from flashstack.engine.quantization import (
    dequantize_rows,
    dequantized_linear,
    quantize_blocks,
    quantize_q4_k,
    quantize_rows,
)
from tests.engine.kernels.test_batch1_decoder import (  # noqa: E402
    BLOCK,
    _args,
    _meta,
    _triton_backend,
)

GPU = torch.cuda.is_available()
DTYPES = [torch.bfloat16, torch.float16] if GPU else [torch.float32, torch.float16]
DTYPE = DTYPES[0]
# (rows, K chunk, warps[, stages]): None (gemv_config's), the bf16 kernel's shapes, one-byte ones
CONFIGS = [None, (16, 1024, 8), (2, 1024, 4), (8, 512, 4, 3), (4, 1024, 4, 2), (4, 2048, 4, 3)]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)


def _fp8(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # rows of very different magnitudes: a missing or misplaced per-row scale shows
    w = torch.randn(n, k, device=device) / k**0.5 * torch.logspace(-2, 1, n, device=device)[:, None]
    q, scale = quantize_rows(w)
    return w, q, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", [(37, 300), (64, 2100)])  # ragged rows and chunks, several chunks
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemv_is_the_dequantized_product(device, dtype, config, n, k, with_bias):
    torch.manual_seed(0)
    w, q, scale = _fp8(n, k, device)
    x = torch.randn(1, k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    want = torch.nn.functional.linear(
        x.float(), dequantize_rows(q, scale, torch.float32), None if b is None else b.float()
    ).to(dtype)
    got = tg.gemv_triton(q, x, b, config, scale=scale)
    torch.testing.assert_close(got, want, **_tol(dtype))
    # and the fp8 weight is close to the weight it came from: the scale is the row's own
    exact = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    assert (got.float() - exact.float()).norm() < 0.08 * exact.float().norm()


@pytest.mark.parametrize("half", [True, False])
def test_fp8_products_in_float16_and_float32_agree(device, half):
    """16-bit activations take the float16 products by default (`half_products`), the float32 ones
    on request: each within 1e-3 of the product's norm (under bf16's own rounding, 2e-3; float16
    sums add ~1.5e-4 to the output's rounding), and a wide input (|x| up to 300: 448 * x is past
    float16's range without the 2^-8 pre-scale) does not overflow."""
    torch.manual_seed(3)
    n, k = 48, 2100
    _, q, scale = _fp8(n, k, device)
    x = (torch.randn(1, k, device=device) * 100).clamp(-300, 300).to(torch.float16)
    want = torch.nn.functional.linear(x.float(), dequantize_rows(q, scale, torch.float32))
    got = tg.gemv_triton(q, x, None, (8, 512, 4, 3), scale=scale, half_products=half)
    assert torch.isfinite(got).all()
    assert (got.float() - want).norm() < 1e-3 * want.norm()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_prologues_and_epilogue(device, dtype):
    """norm, SiLU-and-mul and the residual add on fp8 weights: each the dequantized reference."""
    torch.manual_seed(1)
    n, k = 48, 640
    _, q, scale = _fp8(n, k, device)
    ref = dequantize_rows(q, scale, torch.float32)
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = torch.rand(k, dtype=dtype, device=device) + 0.5
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5)).to(dtype) * g
    want = torch.nn.functional.linear(normed.float(), ref).to(dtype)
    got = tg.gemv_triton(q, x, None, norm=(g, 1e-5), scale=scale)
    torch.testing.assert_close(got, want, **_tol(dtype))

    _, q2, scale2 = _fp8(n, k // 2, device)
    gate_up = torch.randn(1, k, dtype=dtype, device=device)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate.float()).to(dtype) * up).float()
    want = torch.nn.functional.linear(act, dequantize_rows(q2, scale2, torch.float32)).to(dtype)
    residual = torch.randn(1, n, dtype=dtype, device=device)
    before = residual.clone()
    out = tg.gemv_triton(q2, gate_up, None, silu=True, residual=residual, scale=scale2)
    assert out.data_ptr() == residual.data_ptr()  # in place
    torch.testing.assert_close(out, (want.float() + before.float()).to(dtype), **_tol(dtype))


def test_linear_takes_fp8_weights_for_any_rows(device):
    """What the Triton ops call for an fp8 projection: the GEMV for one row on CUDA, the plain-torch
    dequantized product otherwise; the same product either way."""
    torch.manual_seed(2)
    _, q, scale = _fp8(40, 96, device)
    x = torch.randn(5, 96, dtype=DTYPE, device=device)
    b = torch.randn(40, dtype=DTYPE, device=device)
    many = tg.linear(x, q, b, scale=scale)
    torch.testing.assert_close(many, dequantized_linear(x, q, scale, b))
    torch.testing.assert_close(tg.linear(x[:1], q, b, scale=scale), many[:1], **_tol(DTYPE))


_QUANTIZERS = {"fp8": quantize_rows, "q8_0": quantize_blocks, "q4_k": quantize_q4_k}


def _quantized_model(device, quantization: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = replace(_args(qk_norm=False), quantization=quantization)
    if quantization == "q4_k":  # every projection's rows whole 256-weight super-blocks
        args = replace(args, hidden_size=256, intermediate_size=256, head_dim=64)
    model = LlamaForCausalLM(args).to(device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear) and module.weight_scale is not None:
                n, k = module.out_features, module.in_features
                w = torch.randn(n, k, device=device) * 0.2
                q, scale = _QUANTIZERS[module.quantization](w)
                module.weight.copy_(q)
                module.weight_scale.copy_(scale)
            elif isinstance(module, RMSNorm):
                module.weight.uniform_(0.8, 1.2)
            elif isinstance(module, (Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.2)
    return model.eval()


@torch.inference_mode()
@pytest.mark.parametrize(
    "quantization,stored",
    [("fp8", torch.float8_e4m3fn), ("q8_0", torch.int8), ("q4_k", torch.uint8)],
)
def test_batch1_step_on_quantized_weights_matches_torch_ops(device, quantization, stored):
    """A decode step through the batch-1 ops (every projection an fp8, Q8_0 or Q4_K GEMV with its
    prologue or epilogue) gives the plain-torch ops' hidden state on the same weights."""
    model = _quantized_model(device, quantization)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == stored
    ops = TritonOps(_triton_backend()).for_tokens(1)
    assert isinstance(ops, Batch1Ops)
    args, context = model.args, 7
    caches = [
        torch.randn(3, 2, BLOCK, args.num_kv_heads, args.head_dim, device=device)
        for _ in range(args.num_layers)
    ]
    batch1_caches = [c.clone() for c in caches]
    ids, pos = torch.tensor([11], device=device), torch.tensor([context - 1], device=device)
    reference = TorchOps(get_attention_backend("reference", device))
    want = model(ids, pos, _meta(context, device), caches, reference)
    got = model(ids, pos, _meta(context, device), batch1_caches, ops)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_prescaled_float16_input_is_the_silu_prologue_bit_for_bit(device):
    """The down projection on a SiLU-and-mul kernel's float16 output, pre-scaled by 2^-8
    (`prescaled`), gives the fused SiLU prologue's result to the last bit: the same input values,
    rounded where the prologue rounds them, summed in the same order (one chunk a row here;
    different chunk widths would sum in another order)."""
    from flashstack.engine.kernels.triton_elementwise import silu_and_mul_triton

    torch.manual_seed(4)
    n, k = 48, 640
    dtype = torch.bfloat16 if GPU else torch.float16  # the interpreter's bf16 SiLU gives NaN
    _, q, scale = _fp8(n, k, device)
    gate_up = torch.randn(1, 2 * k, device=device).to(dtype) * 3
    residual = torch.randn(1, n, device=device).to(dtype)
    fused = tg.gemv_triton(q, gate_up, silu=True, residual=residual.clone(), scale=scale)
    x = silu_and_mul_triton(gate_up, out_dtype=torch.float16, out_scale=tg.HALF_INPUT_SCALE)
    assert x.dtype == torch.float16
    apart = tg.gemv_triton(q, x, residual=residual.clone(), scale=scale, prescaled=True)
    assert apart.dtype == dtype and torch.isfinite(apart).all()
    torch.testing.assert_close(apart, fused, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prescaled_input_needs_fp8_weights_and_float16(device, dtype):
    """`prescaled` is the fp8 float16 products' input: any other is refused, not misread."""
    _, q, scale = _fp8(16, 64, device)
    residual = torch.zeros(1, 16, dtype=dtype, device=device)
    x = torch.randn(1, 64, device=device).to(dtype)
    if dtype == torch.float16:
        with pytest.raises(AssertionError):  # the result needs the residual's or out's dtype
            tg.gemv_triton(q, x, scale=scale, prescaled=True)
        w = torch.randn(16, 64, device=device, dtype=dtype)
        with pytest.raises(AssertionError):
            tg.gemv_triton(w, x, residual=residual, prescaled=True)
    else:
        with pytest.raises(AssertionError):
            tg.gemv_triton(q, x, residual=residual, scale=scale, prescaled=True)


@torch.inference_mode()
def test_batch1_down_projection_with_and_without_the_silu_kernel(device):
    """Batch1Ops's fp8 down projection with its input from a SiLU-and-mul kernel of its own
    (KernelOptions.fp8_silu_kernel, the default) and with the GEMV's SiLU prologue: the same
    residual stream, bit for bit (16-bit activations; float32 ones take neither path's float16)."""
    from dataclasses import replace as dc_replace

    from flashstack.engine.config import KernelOptions

    torch.manual_seed(5)
    dtype = torch.bfloat16 if GPU else torch.float16
    n, k = 64, 256
    proj = Linear(k, n, bias=False, quantization="fp8").to(device)
    q, scale = quantize_rows(torch.randn(n, k, device=device) * 0.1)
    with torch.no_grad():
        proj.weight.copy_(q)
        proj.weight_scale.copy_(scale)
    gate_up = torch.randn(1, 2 * k, device=device).to(dtype)
    residual = torch.randn(1, n, device=device).to(dtype)
    results = []
    for on in (True, False):
        backend = dc_replace(_triton_backend(), kernels=KernelOptions(fp8_silu_kernel=on))
        ops = Batch1Ops(backend)
        _, out = ops.project_add(proj, gate_up, residual.clone(), silu=True)
        results.append(out)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)
