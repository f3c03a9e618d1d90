"""The batch-1 GEMV against F.linear, over each of its launch configurations and with a bias."""

from __future__ import annotations

import pytest
import torch

tg = pytest.importorskip("flashstack.engine.kernels.triton_gemv")
triton = pytest.importorskip("triton")

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float32]


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)


def test_config_per_shape():
    # The Llama-3-8B projections: down, gate/up and lm_head, q/k/v and o.
    assert tg.gemv_config(4096, 14336) == (16, 1024, 8)
    assert tg.gemv_config(28672, 4096) == tg.gemv_config(128256, 4096) == (2, 1024, 4)
    assert tg.gemv_config(6144, 4096) == tg.gemv_config(4096, 4096) == (8, 512, 4)
    # Fused as the decoder runs them: the norm's extra pass (q/k/v, gate/up), SiLU-and-mul (down,
    # weights through shared memory, two chunks ahead), the residual add alone (o, one chunk ahead).
    assert tg.gemv_config(28672, 4096, "norm") == tg.gemv_config(6144, 4096, "norm") == (4, 1024, 4)
    assert tg.gemv_config(4096, 14336, "silu") == (8, 1024, 4, 3)
    assert tg.gemv_config(4096, 4096, "residual") == (4, 1024, 4, 2)
    # Small models' one-chunk rows through shared memory: SmolLM2-135M's q/k/v, gate/up and down,
    # Qwen3-0.6B's o; Llama-3.2-1B's keep the configurations above.
    assert tg.gemv_config(960, 576, "norm") == tg.gemv_config(3072, 576, "norm") == (4, 1024, 4, 2)
    assert tg.gemv_config(576, 1536, "silu") == (4, 2048, 4, 2)
    assert tg.gemv_config(1024, 2048, "residual") == (4, 2048, 4, 2)
    assert tg.gemv_config(2048, 2048, "residual") == (4, 1024, 4, 2)
    assert tg.gemv_config(2048, 8192, "silu") == (8, 1024, 4, 3)
    assert tg.gemv_config(3072, 2048, "norm") == (4, 1024, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config", [(16, 1024, 8), (2, 1024, 4), (8, 512, 4), (4, 1024, 4), (8, 512, 4, 3)]
)
@pytest.mark.parametrize("n,k", [(37, 300), (64, 2100)])  # ragged rows and chunks, several chunks
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(device, dtype, config, n, k, with_bias):
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(1, k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(
        dtype
    )
    torch.testing.assert_close(tg.gemv_triton(w, x, b, config), want, **_tol(dtype))


def test_linear_is_f_linear_for_every_shape(device):
    """What the Triton ops call for every plain projection: the GEMV for one row on CUDA, F.linear
    otherwise; the same product either way."""
    lin = torch.nn.Linear(48, 40, bias=True, device=device)
    x = torch.randn(3, 48, device=device)
    # more than one row: F.linear
    torch.testing.assert_close(tg.linear(x, lin.weight, lin.bias), lin(x))
    torch.testing.assert_close(
        tg.linear(x[:1], lin.weight, lin.bias), lin(x[:1]), atol=1e-4, rtol=1e-4
    )


# (rows, chunk, warps[, stages]): the next chunk in registers, or stages - 1 chunks ahead in shared
# memory
CONFIGS = [(16, 1024, 8), (2, 1024, 4), (8, 512, 4), (4, 1024, 4), (8, 512, 4, 3), (4, 1024, 4, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_norm_prologue_is_rmsnorm_then_gemv(device, dtype, config):
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_reference, rmsnorm_triton

    torch.manual_seed(1)
    n, k = 40, 2100
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(1, k, dtype=dtype, device=device) * 3
    g = torch.rand(k, dtype=dtype, device=device) + 0.5
    fused = tg.gemv_triton(w, x, None, config, norm=(g, 1e-5))
    # Same rounding as the unfused kernels, same accumulation order: the same bits.
    torch.testing.assert_close(
        fused, tg.gemv_triton(w, rmsnorm_triton(x, g, 1e-5)[0], None, config), atol=0, rtol=0
    )
    want = torch.nn.functional.linear(rmsnorm_reference(x, g, 1e-5)[0].float(), w.float()).to(dtype)
    torch.testing.assert_close(fused, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_silu_prologue_is_silu_and_mul_then_gemv(device, dtype, config):
    from flashstack.engine.kernels.triton_elementwise import (
        silu_and_mul_reference,
        silu_and_mul_triton,
    )

    torch.manual_seed(2)
    n, k = 37, 1500
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    gate_up = torch.randn(1, 2 * k, dtype=dtype, device=device)
    fused = tg.gemv_triton(w, gate_up, None, config, silu=True)
    torch.testing.assert_close(
        fused, tg.gemv_triton(w, silu_and_mul_triton(gate_up), None, config), atol=0, rtol=0
    )
    want = torch.nn.functional.linear(silu_and_mul_reference(gate_up).float(), w.float()).to(dtype)
    torch.testing.assert_close(fused, want, **_tol(dtype))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_shared_memory_stream_gives_the_same_bits(device, stages):
    # Weights through shared memory (Triton's pipeliner) or one chunk ahead in registers: the same
    # chunks in the same order, so every prologue and epilogue gives identical bits.
    torch.manual_seed(4)
    n, k = 45, 2100
    dtype = DTYPES[0]
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(1, k, dtype=dtype, device=device)
    gate_up = torch.randn(1, 2 * k, dtype=dtype, device=device)
    g = torch.rand(k, dtype=dtype, device=device) + 0.5
    r = torch.randn(1, n, dtype=dtype, device=device)

    def run(config, inp, residual=False, **kwargs):
        return tg.gemv_triton(
            w, inp, None, config, residual=r.clone() if residual else None, **kwargs
        )

    for config in [(8, 512, 4), (4, 1024, 4)]:
        for inp, kwargs in [
            (x, {}),
            (x, {"norm": (g, 1e-5)}),
            (gate_up, {"silu": True}),
            (gate_up, {"silu": True, "residual": True}),
        ]:
            torch.testing.assert_close(
                run((*config, stages), inp, **kwargs), run(config, inp, **kwargs), atol=0, rtol=0
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_residual_epilogue_adds_in_place(device, dtype, with_bias):
    torch.manual_seed(3)
    n, k = 70, 300
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    gate_up = torch.randn(1, 2 * k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    residual = torch.randn(1, n, dtype=dtype, device=device)
    before = residual.clone()
    out = tg.gemv_triton(w, gate_up, b, silu=True, residual=residual)
    assert out is residual
    # The projection is rounded to the activation dtype before the add, as `down(x) + residual` is.
    torch.testing.assert_close(
        out, tg.gemv_triton(w, gate_up, b, silu=True) + before, atol=0, rtol=0
    )
    # Into another tensor (a tensor-parallel rank's staged partial): same bits, the residual
    # untouched.
    staged = torch.empty_like(before)
    got = tg.gemv_triton(w, gate_up, b, silu=True, residual=before, out=staged)
    assert got is staged
    torch.testing.assert_close(got, out, atol=0, rtol=0)
    torch.testing.assert_close(
        tg.gemv_triton(w, gate_up, b, silu=True, out=staged),
        tg.gemv_triton(w, gate_up, b, silu=True),
        atol=0,
        rtol=0,
    )


def test_one_prologue_per_call(device):
    w = torch.randn(4, 8, device=device)
    with pytest.raises(AssertionError):
        tg.gemv_triton(
            w,
            torch.randn(1, 16, device=device),
            silu=True,
            norm=(torch.ones(8, device=device), 1e-6),
        )


def test_programmatic_dependent_launch_only_where_it_can_run():
    from flashstack.engine.config import KernelOptions
    from flashstack.engine.kernels.pdl import pdl_applies

    assert not pdl_applies(torch.device("cpu"))
    assert not KernelOptions().resolved(torch.device("cpu")).pdl
    if torch.cuda.is_available():
        cuda = torch.device("cuda", 0)
        hopper = torch.cuda.get_device_capability(0) >= (9, 0)
        assert not pdl_applies(cuda, wanted=False)
        assert pdl_applies(cuda) == (hopper and not triton.knobs.runtime.interpret)
        assert KernelOptions().resolved(cuda).pdl == hopper
        assert not KernelOptions(pdl=False).resolved(cuda).pdl


def test_l2_prefetch_plan_spreads_small_contiguous_weights_over_one_program_an_sm():
    w = torch.empty(1000, 576, dtype=torch.bfloat16)  # 1.1 MB, 1152-byte rows
    nbytes = w.numel() * w.element_size()
    assert tg.l2_prefetch_plan(w, programs=250, max_bytes=nbytes, sm_count=132) == 8  # 125 ask
    assert tg.l2_prefetch_plan(w, programs=100, max_bytes=nbytes, sm_count=132) == 10  # all ask
    assert tg.l2_prefetch_plan(w, programs=250, max_bytes=nbytes - 1, sm_count=132) == 0
    assert tg.l2_prefetch_plan(w, programs=250, max_bytes=0, sm_count=132) == 0
    assert tg.l2_prefetch_plan(w[:, :500], 250, nbytes, 132) == 0  # not contiguous
    odd = torch.empty(64, 9, dtype=torch.bfloat16)  # 18-byte rows: not the bulk unit
    assert tg.l2_prefetch_plan(odd, 16, 1 << 20, 132) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bulk prefetch runs on Hopper only")
@pytest.mark.parametrize("fp8", [False, True])
def test_l2_prefetch_gives_the_same_bits(fp8):
    """kernels.gemv_l2_prefetch_bytes asks the L2 for the weight before the PDL wait: a hint, the
    products unchanged, in every prologue."""
    torch.manual_seed(5)
    n, k, dev = 3000, 2048, torch.device("cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k**0.5
    scale = None
    if fp8:
        scale = torch.rand(n, dtype=torch.float32, device=dev) + 0.5
        w = w.to(torch.float8_e4m3fn)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    g = torch.rand(k, dtype=torch.bfloat16, device=dev) + 0.5
    r = torch.randn(1, n, dtype=torch.bfloat16, device=dev)
    for kwargs in [{}, {"norm": (g, 1e-5)}, {"residual": r}]:
        runs = [
            tg.gemv_triton(
                w,
                x,
                scale=scale,
                l2_prefetch_bytes=pf,
                **{**kwargs, "residual": r.clone()} if "residual" in kwargs else kwargs,
            )
            for pf in (0, 64 << 20)
        ]
        torch.testing.assert_close(runs[0], runs[1], atol=0, rtol=0)
