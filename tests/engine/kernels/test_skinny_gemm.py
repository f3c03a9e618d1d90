"""The skinny GEMM (a few activation rows against a weight stream) against torch's product, and a
decoder's multi-row decode steps with it on and off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from flashstack.engine.config import KernelOptions  # noqa: E402
from flashstack.engine.kernels import triton_elementwise, triton_skinny  # noqa: E402
from flashstack.engine.kernels.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from flashstack.engine.kernels.triton_elementwise import (  # noqa: E402
    rmsnorm_triton,
    silu_and_mul_triton,
)
from flashstack.engine.kernels.triton_skinny import (  # noqa: E402
    SplitK,
    row_tile,
    skinny_applies,
    skinny_config,
    skinny_linear,
)
from flashstack.engine.models import LlamaForCausalLM  # noqa: E402
from flashstack.engine.models.ops import TritonOps  # noqa: E402
from tests.engine.kernels.test_batch1_decoder import _args  # noqa: E402

# (M, N, K, config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) or None for skinny_config)
SHAPES = [
    (3, 70, 200, (32, 64, 1, 4, 2)),  # N not a multiple of the tile, K not one of the chunk
    (5, 100, 384, (32, 64, 3, 4, 3)),  # split-K in three even slices
    (2, 48, 330, (16, 64, 2, 4, 2)),  # split-K, the last slice short and not chunk-aligned
    (17, 64, 512, None),  # past one row tile of 16; the default configuration
    (40, 48, 330, (16, 64, 2, 4, 2)),  # three row tiles, each split along K
    (20, 2100, 64, None),  # over ROW_TILED_MAX_N outputs: every row in one tile of 32
]


@pytest.mark.parametrize("m,n,k,config", SHAPES)
def test_float32_matches_matmul(device, m, n, k, config):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    b = torch.randn(n, generator=g).to(device)
    torch.testing.assert_close(skinny_linear(x, w, b, config), x @ w.T + b, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(skinny_linear(x, w, None, config), x @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,config", SHAPES[:3])
def test_half_precision_accumulates_in_float32(device, dtype, m, n, k, config):
    """One rounding, of the float32 sum: within an ulp or two of the exactly rounded product."""
    g = torch.Generator().manual_seed(k)
    x, w = (torch.randn(*s, generator=g).to(device, dtype) for s in ((m, k), (n, k)))
    b = torch.randn(n, generator=g).to(device, dtype)
    got = skinny_linear(x, w, b, config)
    assert got.dtype == dtype and got.shape == (m, n)
    want = (x.double() @ w.double().T + b.double()).to(dtype)
    torch.testing.assert_close(got, want)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-6) -> None:
    """Bit for bit where the kernels run compiled. The interpreter takes each tile's product with
    numpy's matmul (OpenBLAS), whose summation order follows the tile's shape and the CPU's
    kernels, so tiles of another shape (the gated epilogue's halves) may round a product's last
    bit otherwise: there, within a few units in the last place."""
    if got.is_cuda:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# the interpreter's elementwise kernels take float32 only
GATED_DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# (M, N, K, config): gate/up weights [N, K], one K slice
GATED_SHAPES = [
    (3, 70, 200, (32, 64, 1, 4, 2)),  # N / 2 not a multiple of the half tile, uneven K
    (5, 100, 384, (16, 128, 1, 4, 3)),
    (17, 64, 512, None),  # past one row tile; the default configuration
    (8, 512, 256, None),
    (40, 96, 128, None),  # three row tiles
]


@pytest.mark.parametrize("dtype", GATED_DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m,n,k,config", GATED_SHAPES)
def test_gated_epilogue_is_the_product_then_the_silu_kernel(
    device, dtype, with_bias, m, n, k, config
):
    """silu(gate) * up taken in the gate/up product's epilogue: bit for bit the product rounded,
    then the SiLU-and-mul kernel; and near the float64 reference."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if with_bias else None
    fused = skinny_linear(x, w, b, config, gated=True)
    assert fused.shape == (m, n // 2) and fused.dtype == dtype
    assert_same_bits(fused, silu_and_mul_triton(skinny_linear(x, w, b, config)))
    y = x.double() @ w.double().T + (b.double() if b is not None else 0)
    want = torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2 :]
    torch.testing.assert_close(fused.double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kind", ["fp8", "fp8_w8a16", "q8_0", "q4_k"])
def test_gated_epilogue_of_quantized_weights_is_the_product_then_the_silu_kernel(device, kind):
    """The quantized gate/up weights pair their rows' scales with the rows: the same bits as
    the unfused product and the SiLU-and-mul kernel (fp8 with and without fp8 activations)."""
    from flashstack.engine.quantization import quantize_blocks, quantize_q4_k, quantize_rows

    dtype = GATED_DTYPES[-1]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 256, generator=g).to(device, dtype)
    w = (torch.randn(64, 256, generator=g) / 16).to(device)
    quantize = {"q8_0": quantize_blocks, "q4_k": quantize_q4_k}.get(kind, quantize_rows)
    q, scale = quantize(w)
    act8 = kind == "fp8"
    fused = skinny_linear(x, q, scale=scale, fp8_activations=act8, gated=True)
    unfused = skinny_linear(x, q, scale=scale, fp8_activations=act8)
    assert fused.shape == (5, 32)
    assert_same_bits(fused, silu_and_mul_triton(unfused))


def test_gated_epilogue_refuses_a_split_k(device):
    x, w = torch.ones(2, 64, device=device), torch.ones(32, 64, device=device)
    with pytest.raises(AssertionError):
        skinny_linear(x, w, None, (16, 32, 2, 4, 2), gated=True)


def test_split_k_and_one_pass_agree(device):
    """The K slices' partial sums, added in order by the second kernel, give the one-pass result
    to float32 rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1024, generator=g).to(device)
    w = torch.randn(40, 1024, generator=g).to(device)
    one = skinny_linear(x, w, None, (32, 128, 1, 4, 2))
    four = skinny_linear(x, w, None, (32, 128, 4, 4, 2))
    torch.testing.assert_close(four, one, atol=1e-4, rtol=1e-5)


def test_only_long_rows_split_k_and_only_few_rows_take_it():
    assert skinny_config(8, 4096, 14336)[2] == 2  # down
    assert skinny_config(8, 4096, 4096)[2] == skinny_config(8, 28672, 4096)[2] == 1  # o, gate/up
    assert not skinny_applies(1, 4096, 4096)  # one row: the GEMV
    assert skinny_applies(32, 4096, 4096) and not skinny_applies(33, 4096, 4096)  # o
    assert skinny_applies(64, 4096, 14336) and not skinny_applies(65, 4096, 14336)  # down
    assert not skinny_applies(8, 2048, 2048)  # a small model's weight: cuBLAS unless asked
    assert skinny_applies(2, 2048, 2048, small_weights=True)
    assert skinny_applies(32, 576, 576, small_weights=True)
    assert not skinny_applies(33, 2048, 2048, small_weights=True)
    # the Llama-3.2-1B shape's down: 32 programs of 64 columns, too few: cuBLAS
    assert not skinny_applies(8, 2048, 8192, small_weights=True)


def test_row_tiles_only_for_a_small_weight_of_few_outputs():
    assert row_tile(32, 1024, 2048) == 16  # Qwen3-0.6B's o: 16 column tiles, so two row tiles
    assert row_tile(32, 4096, 1024) == 32  # its q/k/v: 64 column tiles fill the SMs already
    assert row_tile(24, 4096, 4096) == 32  # the 8B's o: every row in one tile
    assert skinny_config(8, 960, 576)[1] == 128  # SmolLM2's short rows: 128-wide chunks
    assert skinny_config(8, 1024, 3072)[1] == 256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 8, 24, 64])
def test_bf16_replays_in_a_cuda_graph(m):
    """The 8B down projection's shape (split-K: two kernels and a workspace from the graph's
    pool), under PDL: captured once, replayed on new inputs, equal to the eager call and to torch's
    product."""
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, 14336, dtype=torch.bfloat16, device="cuda")
    skinny_linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, skinny_linear(x, w), atol=0, rtol=0)
    # float32 sums of 14336 products of ~1 (results up to ~500): errors of ~2e-3 near zero
    torch.testing.assert_close(
        y, (x.double() @ w.double().T).to(torch.bfloat16), atol=1e-2, rtol=0.016
    )


def _model(device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = dataclasses.replace(_args(qk_norm=False), qkv_bias=True)
    model = LlamaForCausalLM(args).to(device)
    with torch.no_grad():  # decisive logits: weights well away from the default's tiny init
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def _decode_meta(contexts: list[int], block: int, device) -> AttentionMetadata:
    """One new token per sequence at position context - 1; sequence i owns blocks i*8, i*8+1, ..."""
    n = len(contexts)
    tables = torch.arange(n * 8, dtype=torch.int32, device=device).reshape(n, 8)
    slots = [
        int(tables[i, (c - 1) // block]) * block + (c - 1) % block for i, c in enumerate(contexts)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        block_size=block,
        max_query_len=1,
        max_context_len=max(contexts),
        query_lens_host=[1] * n,
        context_lens_host=list(contexts),
    )


def _greedy(model, cache, block: int, device, kernels: KernelOptions):
    """Three sequences decoding greedily for four steps through the Triton ops: (tokens, the last
    step's logits)."""
    args = model.args
    ops = TritonOps(get_attention_backend("reference", device, kernels))
    caches = [cache.clone() for _ in range(args.num_layers)]
    ids, contexts, tokens = torch.tensor([3, 17, 41], device=device), [5, 9, 2], []
    for _ in range(4):
        pos = torch.tensor([c - 1 for c in contexts], device=device)
        hidden = model(ids, pos, _decode_meta(contexts, block, device), caches, ops)
        logits = model.compute_logits(hidden, ops)
        ids = logits.argmax(-1)
        tokens.append(ids.tolist())
        contexts = [c + 1 for c in contexts]
    return tokens, logits


@torch.inference_mode()
def test_decode_steps_give_the_same_tokens_with_and_without_it(device, monkeypatch):
    """The skinny GEMM (q/k/v, o, gate/up, down and lm_head) picks the same tokens as the path
    without it."""
    # The tiny model's weights are far below the sizes the GEMM is measured for and taken at.
    monkeypatch.setattr(triton_skinny, "MIN_WEIGHT", 0)
    monkeypatch.setattr(triton_skinny, "MIN_PROGRAMS", 1)
    calls = []  # the ops import it per call: the wrapper sees every product it takes
    skinny = triton_skinny.skinny_linear
    monkeypatch.setattr(
        triton_skinny, "skinny_linear", lambda *a, **k: (calls.append(1), skinny(*a, **k))[1]
    )
    model, block = _model(device), 4
    args = model.args
    cache = torch.randn(3 * 8, 2, block, args.num_kv_heads, args.head_dim, device=device)

    def decode(skinny: bool) -> tuple[list[list[int]], torch.Tensor]:
        kernels = dataclasses.replace(KernelOptions(), skinny_gemm=skinny)
        return _greedy(model, cache, block, device, kernels)

    on, on_logits = decode(True)
    taken = len(calls)
    off, off_logits = decode(False)
    assert taken > 0 and len(calls) == taken  # it ran with the option on, and only then
    assert on == off
    torch.testing.assert_close(on_logits, off_logits, atol=1e-3, rtol=1e-4)


@torch.inference_mode()
def test_down_slices_added_by_the_next_norm_change_no_bit(device, monkeypatch):
    """KernelOptions.split_k_in_norm: every product split in two K slices; o's and down's slices,
    left to the next RMSNorm (the final norm after the last down), give exactly the logits of the
    reducing kernel."""
    monkeypatch.setattr(triton_skinny, "MIN_WEIGHT", 0)
    monkeypatch.setattr(triton_skinny, "MIN_PROGRAMS", 1)
    monkeypatch.setattr(triton_skinny, "skinny_config", lambda m, n, k: (16, 32, 2, 4, 2))
    kept = []
    skinny = triton_skinny.skinny_linear

    def spy(*a, **k):
        y = skinny(*a, **k)
        kept.append(isinstance(y, SplitK))
        return y

    monkeypatch.setattr(triton_skinny, "skinny_linear", spy)
    model, block = _model(device), 4
    args = model.args
    cache = torch.randn(3 * 8, 2, block, args.num_kv_heads, args.head_dim, device=device)
    runs = {
        on: _greedy(model, cache, block, device, KernelOptions(split_k_in_norm=on))
        for on in (True, False)
    }
    # o and down, once a layer a step each, and nothing else: their outputs go to a norm alone
    assert kept.count(True) == 2 * 4 * args.num_layers
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])


@torch.inference_mode()
def test_gate_up_epilogue_changes_no_bit_and_drops_the_silu_kernel(device, monkeypatch):
    """KernelOptions.gate_up_swiglu: the gate/up products return silu(gate) * up; the decode
    steps give exactly the logits of the SiLU-and-mul kernel, which then no longer runs."""
    monkeypatch.setattr(triton_skinny, "MIN_WEIGHT", 0)
    monkeypatch.setattr(triton_skinny, "MIN_PROGRAMS", 1)
    silu_kernels = []
    kernel = triton_elementwise.silu_and_mul_triton
    monkeypatch.setattr(
        triton_elementwise,
        "silu_and_mul_triton",
        lambda *a, **k: (silu_kernels.append(1), kernel(*a, **k))[1],
    )
    model, block = _model(device), 4
    args = model.args
    cache = torch.randn(3 * 8, 2, block, args.num_kv_heads, args.head_dim, device=device)
    runs = {}
    for on in (True, False):
        silu_kernels.clear()
        runs[on] = _greedy(model, cache, block, device, KernelOptions(gate_up_swiglu=on))
        assert len(silu_kernels) == (0 if on else 4 * args.num_layers)  # 4 steps
    assert runs[True][0] == runs[False][0]
    assert_same_bits(runs[True][1], runs[False][1], tol=1e-5)  # a last bit carried through layers


# the interpreter's elementwise kernels take float32 only (tests/engine/kernels/
# test_triton_elementwise.py)
@pytest.mark.parametrize(
    "dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_adds_the_slices_as_the_reducing_kernel_does(device, dtype, with_residual):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 200, generator=g).to(device, dtype)
    w = torch.randn(72, 200, generator=g).to(device, dtype)
    gain = torch.randn(72, generator=g).to(device, dtype)
    residual = torch.randn(5, 72, generator=g).to(device, dtype) if with_residual else None
    split = skinny_linear(x, w, None, (16, 32, 3, 4, 2), keep_slices=True)
    assert isinstance(split, SplitK) and split.slices.shape == (3, 5, 72)
    summed = skinny_linear(x, w, None, (16, 32, 3, 4, 2))
    assert torch.equal(split.summed(), summed)
    got = rmsnorm_triton(split, gain, 1e-5, residual)
    want = rmsnorm_triton(summed, gain, 1e-5, residual)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_slices_are_kept_only_where_there_are_several_and_no_bias(device):
    x, w, b = torch.ones(2, 64, device=device), torch.ones(32, 64, device=device), None
    assert isinstance(skinny_linear(x, w, b, (16, 32, 2, 4, 2), keep_slices=True), SplitK)
    one_pass = skinny_linear(x, w, b, (16, 32, 1, 4, 2), keep_slices=True)
    assert isinstance(one_pass, torch.Tensor)
    with_bias = skinny_linear(
        x, w, torch.ones(32, device=device), (16, 32, 2, 4, 2), keep_slices=True
    )
    assert isinstance(with_bias, torch.Tensor)  # the reducing kernel adds the bias: summed
    assert torch.equal(with_bias, torch.full((2, 32), 65.0, device=device))
