"""The batch-1 MLP in one kernel (kernels/triton_mlp.py) against the GEMVs it replaces, and the
readers of its float32 row: the q/k/v GEMV's norm, the o GEMV's residual and the final norm take
it in as the down GEMV would have added it."""

from __future__ import annotations

import pytest
import torch

tm = pytest.importorskip("flashstack.engine.kernels.triton_mlp")
from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton  # noqa: E402
from flashstack.engine.kernels.triton_gemv import gemv_triton  # noqa: E402
from flashstack.engine.kernels.triton_skinny import SplitK  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float32]


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)


def _mlp(hidden: int, inter: int, dtype, device):
    torch.manual_seed(hidden + inter)
    gate_up = torch.randn(2 * inter, hidden, dtype=dtype, device=device) / hidden**0.5
    down = torch.randn(hidden, inter, dtype=dtype, device=device) / inter**0.5
    x = torch.randn(1, hidden, dtype=dtype, device=device)
    g = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    return gate_up, down, x, g


def _stream(x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """The residual stream once the row is in: rounded as the down GEMV's epilogue rounds."""
    return (row.to(x.dtype).float() + x.float()).to(x.dtype)


# SmolLM2-135M's MLP on the GPU only: 30 s in the interpreter
SHAPES = [(64, 96), (72, 40), (1100, 48)] + [(576, 1536)] * torch.cuda.is_available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "inter"), SHAPES, ids=lambda v: str(v))
def test_fused_mlp_is_the_unfused_mlp(device, dtype, hidden, inter):
    """RMSNorm, gate/up, SiLU-and-mul and down in one kernel give the residual stream the GEMVs
    give it: units past the end (40 of them), hidden sizes of several chunks, the last one
    partial."""
    gate_up, down, x, g = _mlp(hidden, inter, dtype, device)
    residual = x.clone()
    gemv_triton(down, gemv_triton(gate_up, x, norm=(g, 1e-5)), silu=True, residual=residual)
    row = torch.zeros(1, hidden, dtype=torch.float32, device=device)
    got = tm.fused_mlp_triton(x, (g, 1e-5), gate_up, down, row)
    assert got is row
    torch.testing.assert_close(_stream(x, row), residual, **_tol(dtype))
    # the kernel adds into the row: a second run doubles it
    tm.fused_mlp_triton(x, (g, 1e-5), gate_up, down, row)
    torch.testing.assert_close(_stream(x, row / 2), residual, **_tol(dtype))


def test_fused_mlp_takes_16_and_32_bit_weights_it_can_hold(device):
    w = torch.empty(2 * 1536, 576, dtype=torch.bfloat16)
    assert tm.fused_mlp_applies(576, w, torch.empty(576, 1536, dtype=torch.bfloat16))
    qwen3 = torch.empty(2 * 3072, 1024, dtype=torch.bfloat16)
    assert tm.fused_mlp_applies(1024, qwen3, torch.empty(1024, 3072, dtype=torch.bfloat16))
    # a down slice past MAX_HELD_DOWN: hidden 2048 (Llama-3.2-1B) keeps its GEMVs
    big = torch.empty(2 * 64, 2048, dtype=torch.bfloat16)
    assert not tm.fused_mlp_applies(2048, big, torch.empty(2048, 64, dtype=torch.bfloat16))
    assert not tm.fused_mlp_applies(576, w, torch.empty(576, 1536, dtype=torch.int8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_readers_take_the_row_in_as_the_down_gemv_would_have(device, dtype):
    """The q/k/v GEMV's RMSNorm prologue, the o GEMV's residual epilogue and the final RMSNorm,
    given the residual and a pending row, give the bits they give on the stream with the row
    added."""
    torch.manual_seed(7)
    hidden, n = 96, 40
    x = torch.randn(1, hidden, dtype=dtype, device=device)
    row = torch.randn(1, hidden, dtype=torch.float32, device=device)
    g = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    stream = _stream(x, row)
    qkv = torch.randn(n, hidden, dtype=dtype, device=device) / hidden**0.5
    exact = dict(atol=0, rtol=0)
    torch.testing.assert_close(
        gemv_triton(qkv, x, norm=(g, 1e-5), pending=row),
        gemv_triton(qkv, stream, norm=(g, 1e-5)),
        **exact,
    )
    o = torch.randn(hidden, n, dtype=dtype, device=device) / n**0.5
    heads = torch.randn(1, n, dtype=dtype, device=device)
    into = x.clone()
    gemv_triton(o, heads, residual=into, pending=row)
    torch.testing.assert_close(into, gemv_triton(o, heads, residual=stream.clone()), **exact)
    normed, new_residual = rmsnorm_triton(SplitK(row[None], dtype), g, 1e-5, x)
    torch.testing.assert_close(normed, rmsnorm_triton(stream, g, 1e-5)[0], **exact)
    torch.testing.assert_close(new_residual, stream, **exact)


def test_a_pending_row_goes_with_one_reader(device):
    w = torch.randn(8, 16, device=device)
    x, row = torch.randn(1, 16, device=device), torch.zeros(1, 16, device=device)
    with pytest.raises(AssertionError, match="pending"):
        gemv_triton(w, x, pending=row)
