"""fp8 activations (W8A8): the activation quantization kernel against its plain-torch form bit for
bit, the skinny GEMM's fp8 tensor-core product against quantization.fp8_activations_linear, and
the ops' choice of it (KernelOptions.fp8_activations) on a decoder's multi-row steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashstack.engine.config import KernelOptions
from flashstack.engine.kernels.attention import get_attention_backend
from flashstack.engine.kernels.triton_skinny import (
    fp8_skinny_config,
    quantize_activations_triton,
    skinny_linear,
)
from flashstack.engine.models.ops import TorchOps, TritonOps
from flashstack.engine.quantization import (
    dequantized_linear,
    fp8_activations_linear,
    quantize_activations,
)
from tests.engine.kernels.test_fp8_weights_gemv import DTYPES, GPU, _fp8, _quantized_model
from tests.engine.kernels.test_skinny_gemm import _decode_meta


def _scaled(m: int, k: int, device) -> torch.Tensor:
    # rows of very different magnitudes: each row's own scale shows
    return torch.randn(m, k, device=device) * torch.logspace(-3, 2, m, device=device)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 576), (3, 2048)])
def test_quantized_activations_are_bit_exact(device, dtype, m, k):
    x = torch.cat([torch.zeros(1, k, device=device), _scaled(m, k, device)]).to(dtype)
    q, scale = quantize_activations_triton(x)
    want_q, want_scale = quantize_activations(x)
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    assert differ == 0, f"{differ} of {q.numel()} values differ"
    assert torch.equal(scale, want_scale)
    assert scale[0] == 1.0  # the all-zero row
    # every other row's largest magnitude lands on e4m3's largest value
    assert (q[1:].float().abs().amax(-1) == 448.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (2, 96, 576, None),  # a chunk past the row's end
        (8, 200, 1024, None),  # a partial column tile
        (17, 64, 300, (32, 128, 1, 4, 2)),  # odd rows, a ragged last chunk
        (33, 130, 512, (64, 256, 2, 4, 2)),  # split K: float32 partial sums, a second kernel
        (128, 64, 256, None),  # the widest row tile
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_product_matches_its_torch_form(device, dtype, m, n, k, config, with_bias):
    torch.manual_seed(0)
    _, q, scale = _fp8(n, k, device)
    x = _scaled(m, k, device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if with_bias else None
    got = skinny_linear(x, q, b, config, scale=scale)
    want = fp8_activations_linear(x, q, scale, b)
    assert got.dtype == dtype and got.shape == (m, n)
    # the same quantized operands; only the order of the float32 sums differs (groups of very
    # different magnitudes: the tolerance is the largest output's)
    size = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol * size, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(2, 96, 576), (33, 130, 512), (128, 64, 300)])
def test_fp8_weights_with_16_bit_activations(device, dtype, m, n, k):
    """fp8_activations off: each weight chunk widened in registers (W8A16), the row scales at the
    end: the dequantized product."""
    torch.manual_seed(3)
    _, q, scale = _fp8(n, k, device)
    x = _scaled(m, k, device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    got = skinny_linear(x, q, b, scale=scale, fp8_activations=False)
    want = dequantized_linear(x.float(), q, scale, b.float())
    size = want.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol * size, rtol=tol)


def test_fp8_activations_cost_only_their_rounding(device):
    """W8A8 against W8A16 on the same fp8 weights: every activation rounded within e4m3's half step
    (2^-4 of its value), so the products differ by a few percent of their size."""
    torch.manual_seed(1)
    _, q, scale = _fp8(256, 1024, device)
    x = torch.randn(8, 1024, device=device)
    w8a8 = fp8_activations_linear(x, q, scale, None)
    w8a16 = dequantized_linear(x, q, scale, None)
    err = (w8a8 - w8a16).abs()
    size = w8a16.abs().mean()
    assert err.max() < 0.0625 * w8a16.abs().max() and err.mean() < 0.05 * size


def test_configurations_fit_the_row_tile():
    # shared memory (one byte a value): narrower pipelines as the activation tile widens
    for m in (2, 16, 32, 64, 128):
        for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)):
            bn, bk, split, warps, stages = fp8_skinny_config(m, n, k)
            assert (bn * bk + bk * max(16, m)) * stages <= 200 * 1024


@torch.inference_mode()
@pytest.mark.parametrize("fp8_activations", [True, False])
def test_multi_row_steps_on_fp8_weights_match_torch_ops(device, fp8_activations):
    """Three sequences' decode step on fp8 weights through the Triton ops (the skinny GEMM's fp8
    product, or with the option off the dequantized one) gives the plain-torch ops' hidden state,
    which quantizes the activations exactly when the option says so."""
    model = _quantized_model(device, "fp8")
    args, block = model.args, 4
    kernels = dataclasses.replace(KernelOptions(), fp8_activations=fp8_activations)
    cache = torch.randn(3 * 8, 2, block, args.num_kv_heads, args.head_dim, device=device)
    ids, contexts = torch.tensor([3, 17, 41], device=device), [5, 9, 2]
    pos = torch.tensor([c - 1 for c in contexts], device=device)

    def hidden(ops) -> torch.Tensor:
        caches = [cache.clone() for _ in range(args.num_layers)]
        return model(ids, pos, _decode_meta(contexts, block, device), caches, ops)

    reference = get_attention_backend("reference", device, kernels)
    want = hidden(TorchOps(reference))
    got = hidden(TritonOps(reference))
    other = dataclasses.replace(kernels, fp8_activations=not fp8_activations)
    gap = (hidden(TorchOps(get_attention_backend("reference", device, other))) - want).abs()
    assert gap.mean() > 1e-3  # the option changes the sums
    # On the CPU interpreter the two agree to float32's last bits. On a GPU the Triton norms and
    # rotary round differently from torch's, and an activation that lands on the other side of an
    # e4m3 rounding boundary moves its products by up to 2^-4: far less than the option's effect.
    err = (got - want).abs()
    if GPU and fp8_activations:
        assert err.mean() < 0.1 * gap.mean(), (err.mean(), gap.mean())
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
