"""fp8 KV cache kernels (store, decode, prefill) against plain torch on the dequantized cache."""

from __future__ import annotations

import math

import pytest
import torch

from flashstack.engine.kernels import triton_attention as tk
from flashstack.engine.kernels.attention import (
    paged_attention_reference,
    paged_prefill_sdpa,
    store_kvcache_reference,
)
from flashstack.engine.quantization import FP8, quantize_fp8
from tests.engine.kernels.test_triton_attention import _meta, _tables

ON_GPU = torch.cuda.is_available()
# q's dtype: the dot products run in it on dequantized tiles
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if ON_GPU else dict(atol=2e-4, rtol=2e-4)
KV_SCALE = [0.02, 0.005]  # K spans about +-5, V about +-1.2: both well inside e4m3 after scaling


def _fp8_cache(num_blocks, block_size, kv_heads, dim, kv_scale, device):
    """A random cache, quantized as the store kernels quantize."""
    k = torch.randn(num_blocks, 1, block_size, kv_heads, dim, device=device) * 2
    v = torch.randn(num_blocks, 1, block_size, kv_heads, dim, device=device) * 0.5
    return torch.cat([quantize_fp8(k, kv_scale[0]), quantize_fp8(v, kv_scale[1])], dim=1)


def _case(kv_heads, dim, block_size, ctx, device):
    """A decode step's fp8 cache (random, quantized), block tables and metadata for `ctx`."""
    kv_scale = torch.tensor(KV_SCALE, device=device)
    num_blocks = sum(math.ceil(c / block_size) for c in ctx) + 2
    cache = _fp8_cache(num_blocks, block_size, kv_heads, dim, kv_scale, device)
    tables = _tables(ctx, block_size, num_blocks, device)
    return kv_scale, cache, tables, _meta([1] * len(ctx), ctx, tables, block_size, device)


def _dequantized(cache, kv_scale, dtype):
    """The oracle's cache: every value as the fp8 cache means it, in q's dtype."""
    scale = kv_scale.view(1, 2, 1, 1, 1)
    return (cache.float() * scale).to(dtype)


def test_quantize_saturates_and_rounds_to_nearest(device):
    scale = torch.tensor(0.5, device=device)
    x = torch.tensor([1000.0, -1000.0, 3.99, 0.3, 0.0], device=device)
    got = quantize_fp8(x, scale).float().tolist()
    # 1000 / 0.5 saturates at 448; 7.98 rounds up across the binade to 8; 0.6 -> 0.625
    assert got == [448.0, -448.0, 8.0, 0.625, 0.0]


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_quantizes_as_torch_does_and_skips_padding(device, block_size):
    """The Triton store writes exactly torch's quantized values (saturation, the round-up across a
    binade, subnormals included) and nothing for slot -1."""
    torch.manual_seed(0)
    kv_heads, dim, n = 2, 64, 40
    kv_scale = torch.tensor([0.01, 0.002], device=device)
    spread = torch.logspace(-6, 1, kv_heads * dim, device=device).view(kv_heads, dim)
    k = (torch.randn(n, kv_heads, dim, device=device) * spread).to(DTYPE)
    v = (torch.randn(n, kv_heads, dim, device=device) * spread * 0.2).to(DTYPE)
    k[0, 0, 0] = 100.0  # past 448 * k_scale: saturates
    slots = torch.randperm(4 * block_size, device=device)[:n]
    slots[3] = -1
    got = torch.zeros(4, 2, block_size, kv_heads, dim, dtype=FP8, device=device)
    want = torch.zeros_like(got)
    tk.store_kvcache_triton(k, v, got, slots, kv_scale)
    keep = slots >= 0
    store_kvcache_reference(k[keep], v[keep], want, slots[keep], kv_scale)
    assert torch.equal(got.float(), want.float())
    assert want.float().abs().max() == 448.0


SHAPES = [  # heads, kv_heads, head_dim, block_size, context lens
    (4, 4, 64, 16, [1, 17, 40]),
    (8, 2, 64, 32, [5, 100]),
]
if ON_GPU:
    SHAPES += [(32, 8, 128, 256, [1000, 4097, 300]), (32, 8, 128, 256, [32768])]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,ctx", SHAPES)
def test_fp8_decode_matches_attention_over_the_dequantized_cache(
    device, heads, kv_heads, dim, block_size, ctx
):
    torch.manual_seed(1)
    kv_scale, cache, tables, meta = _case(kv_heads, dim, block_size, ctx, device)
    q = torch.randn(len(ctx), heads, dim, dtype=DTYPE, device=device)
    scale = dim**-0.5
    want = paged_attention_reference(q, _dequantized(cache, kv_scale, DTYPE), meta, scale)
    # the torch path reads the fp8 cache itself (the CPU engine's path)
    ref = paged_attention_reference(q, cache, meta, scale, kv_scale=kv_scale)
    torch.testing.assert_close(ref, want, **TOL)
    launches = [
        {},
        {"num_splits": 1},  # the output written directly, no merge
        {"num_splits": 5, "block_n": 16, "min_split": 16},  # short splits, merged
    ]
    if tk.tma_applies(cache, 64):
        launches.append({"tma": True, "block_n": 64, "min_split": 64})
    for launch in launches:
        plan = tk.plan_decode(len(ctx), cache, max(ctx), **launch)
        got = tk.paged_decode_triton(
            q, cache, tables, meta.context_lens, scale, plan, kv_scale=kv_scale
        )
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{launch}: {m}")


@pytest.mark.parametrize("qk_fp8", [False, True], ids=["fp16-dots", "fp8-qk"])
def test_fp8_decode_with_new_tokens_stores_and_attends_them_quantized(device, qk_fp8):
    """The decode kernel's own q/k/v work (a batch-1 step) on an fp8 cache: it stores the new k/v
    as the q/k/v kernel would and gives the output of storing first, then attending (with q
    quantized as kernels.decode_fp8_qk quantizes it, where it is on)."""
    from flashstack.engine.kernels.triton_qkv import rope_and_store_kv_triton
    from flashstack.engine.models.layers import RotaryEmbedding

    torch.manual_seed(2)
    heads, kv_heads, dim, bs, ctx = 8, 2, 64, 16, [37, 100]
    kv_scale = torch.tensor(KV_SCALE, device=device)
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 2
    cache = _fp8_cache(num_blocks, bs, kv_heads, dim, kv_scale, device)
    tables = _tables(ctx, bs, num_blocks, device)
    meta = _meta([1] * len(ctx), ctx, tables, bs, device)
    positions = torch.tensor([c - 1 for c in ctx], device=device)
    slots = torch.stack(
        [tables[i, (c - 1) // bs] * bs + (c - 1) % bs for i, c in enumerate(ctx)]
    ).long()
    q = torch.randn(len(ctx), heads, dim, dtype=DTYPE, device=device)
    k = torch.randn(len(ctx), kv_heads, dim, dtype=DTYPE, device=device) * 2
    v = torch.randn(len(ctx), kv_heads, dim, dtype=DTYPE, device=device) * 0.5
    rope = RotaryEmbedding(dim, {"rope_theta": 1e4, "rope_type": "default"}).to(device)
    cos, sin = rope(positions, DTYPE)
    want_cache = cache.clone()
    q_rot = rope_and_store_kv_triton(
        q.clone(), k, v, cos, sin, want_cache, slots, kv_scale=kv_scale
    )
    scale = dim**-0.5
    if qk_fp8:
        q_rot = _fp8_queries(q_rot, kv_heads, scale, kv_scale[0])
    deq = _dequantized(want_cache, kv_scale, q_rot.dtype)
    want = paged_attention_reference(q_rot, deq, meta, scale).to(DTYPE)
    plan = tk.plan_decode(
        len(ctx), cache, max(ctx), num_splits=3, block_n=16, min_split=16, qk_fp8=qk_fp8
    )
    new = tk.NewTokens(k, v, cos, sin, slots)
    got = tk.paged_decode_triton(
        q, cache, tables, meta.context_lens, scale, plan, new=new, kv_scale=kv_scale
    )
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(cache.float(), want_cache.float())


def test_fp8_qkv_kernel_stores_what_the_torch_store_does(device):
    from flashstack.engine.kernels.triton_qkv import rope_and_store_kv_triton
    from flashstack.engine.models.layers import RotaryEmbedding, apply_rotary

    torch.manual_seed(3)
    n, heads, kv_heads, dim, bs = 20, 4, 2, 32, 16
    kv_scale = torch.tensor(KV_SCALE, device=device)
    q = torch.randn(n, heads, dim, dtype=DTYPE, device=device)
    k = torch.randn(n, kv_heads, dim, dtype=DTYPE, device=device) * 2
    v = torch.randn(n, kv_heads, dim, dtype=DTYPE, device=device) * 0.5
    cos, sin = RotaryEmbedding(dim, {"rope_theta": 1e4, "rope_type": "default"}).to(device)(
        torch.arange(n, device=device), DTYPE
    )
    slots = torch.randperm(3 * bs, device=device)[:n]
    got = torch.zeros(3, 2, bs, kv_heads, dim, dtype=FP8, device=device)
    rope_and_store_kv_triton(q.clone(), k, v, cos, sin, got, slots, kv_scale=kv_scale)
    want = torch.zeros_like(got)
    k_rot = apply_rotary(q.float(), k.float(), cos.float(), sin.float())[1].to(DTYPE)
    store_kvcache_reference(k_rot, v, want, slots, kv_scale)
    # k rotated in fp32 either way; a last-bit difference in k may move one fp8 step
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0.07)


@pytest.mark.parametrize("sdpa", [False, True])
def test_fp8_prefill_matches_attention_over_the_dequantized_cache(device, sdpa):
    """The paged prefill kernel and the long-chunk SDPA path, a cached prefix included."""
    torch.manual_seed(4)
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    query_lens, ctx = [20, 24], [37, 24]
    kv_scale = torch.tensor(KV_SCALE, device=device)
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 2
    cache = _fp8_cache(num_blocks, bs, kv_heads, dim, kv_scale, device)
    tables = _tables(ctx, bs, num_blocks, device)
    meta = _meta(query_lens, ctx, tables, bs, device)
    q = torch.randn(sum(query_lens), heads, dim, dtype=DTYPE, device=device)
    want = paged_attention_reference(q, _dequantized(cache, kv_scale, DTYPE), meta, 0.1)
    ref = paged_attention_reference(q, cache, meta, 0.1, kv_scale=kv_scale)
    torch.testing.assert_close(ref, want, **TOL)
    if sdpa:
        got = paged_prefill_sdpa(q, cache, meta, 0.1, kv_scale)
    else:
        got = tk.paged_prefill_triton(q, cache, meta, 0.1, kv_scale=kv_scale)
    torch.testing.assert_close(got, want, **TOL)


def test_an_fp8_cache_without_scales_is_refused(device):
    cache = torch.zeros(2, 2, 16, 2, 64, dtype=FP8, device=device)
    k = torch.zeros(1, 2, 64, device=device)
    with pytest.raises(AssertionError, match="kv_scale"):
        store_kvcache_reference(k, k, cache, torch.zeros(1, dtype=torch.int64, device=device))


def _fp8_queries(q, kv_heads, scale, k_scale):
    """q as the fp8 q @ K path means it (KernelOptions.decode_fp8_qk): each (sequence, KV head)'s
    query rows times scale * k_scale, quantized to e4m3 with one scale (their largest |value| over
    448), multiplied back and divided again: the queries whose products the kernel takes."""
    n, heads, dim = q.shape
    qs = q.float().view(n, kv_heads, heads // kv_heads, dim) * (scale * k_scale)
    q_scale = qs.abs().amax(dim=(2, 3), keepdim=True).clamp_min(1e-30) / 448.0
    back = quantize_fp8(qs, q_scale).float() * q_scale / (scale * k_scale)
    return back.view(n, heads, dim)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,ctx", SHAPES)
def test_fp8_decode_takes_q_and_k_in_fp8_on_request(device, heads, kv_heads, dim, block_size, ctx):
    """kernels.decode_fp8_qk: q quantized to e4m3 and multiplied by K's tiles as stored; the
    output of attending with those quantized queries over the dequantized cache, split or
    whole."""
    torch.manual_seed(3)
    kv_scale, cache, tables, meta = _case(kv_heads, dim, block_size, ctx, device)
    q = torch.randn(len(ctx), heads, dim, dtype=DTYPE, device=device)
    scale = dim**-0.5
    q8 = _fp8_queries(q, kv_heads, scale, kv_scale[0])
    deq = _dequantized(cache, kv_scale, torch.float32)
    want = paged_attention_reference(q8, deq, meta, scale).to(DTYPE)
    plain = paged_attention_reference(q.float(), deq, meta, scale).to(DTYPE)
    # quantizing q moves the output past the CPU tolerance: there the oracle tells the paths apart
    assert (want.float() - plain.float()).abs().max() > 5 * 2e-4
    launches = [{}, {"num_splits": 1}, {"num_splits": 5, "block_n": 16, "min_split": 16}]
    if tk.tma_applies(cache, 64):
        launches.append({"tma": True, "block_n": 64, "min_split": 64})
    for launch in launches:
        plan = tk.plan_decode(len(ctx), cache, max(ctx), qk_fp8=True, **launch)
        assert plan.qk_fp8
        got = tk.paged_decode_triton(
            q, cache, tables, meta.context_lens, scale, plan, kv_scale=kv_scale
        )
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{launch}: {m}")
    # a 16-bit cache keeps its own path
    assert not tk.plan_decode(1, deq.to(DTYPE), 64, qk_fp8=True).qk_fp8


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("new_tokens", [False, True])
@pytest.mark.parametrize("unmasked_v", [False, True], ids=["v-zeroed", "v-as-fetched"])
def test_fp8_tiles_as_word_pairs_match_attention_over_the_dequantized_cache(
    device, window, new_tokens, unmasked_v
):
    """KernelOptions.decode_fp8_pairs: TMA tiles read as 16-bit words, each split into its even
    and odd columns, against the reference over the dequantized cache. Stale slots past each
    context and a free block hold NaN where V is zeroed, the largest finite e4m3 value where it
    is not (the engine's cache is zeroed at allocation and its stores saturate)."""
    from flashstack.engine.models.layers import RotaryEmbedding, apply_rotary

    torch.manual_seed(6)
    heads, kv_heads, dim, bs, ctx = 8, 2, 64, 32, [1, 45, 100, 33]
    kv_scale = torch.tensor(KV_SCALE, device=device)
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 1
    cache = _fp8_cache(num_blocks, bs, kv_heads, dim, kv_scale, device)
    tables = _tables(ctx, bs, num_blocks - 1, device)
    stale = torch.tensor(448.0 if unmasked_v else float("nan")).to(FP8)
    clean = cache.clone()
    cache[num_blocks - 1] = stale
    clean[num_blocks - 1] = 0.0
    for row, c in zip(tables.tolist(), ctx):
        cache[row[(c - 1) // bs], :, (c - 1) % bs + 1 :] = stale
        clean[row[(c - 1) // bs], :, (c - 1) % bs + 1 :] = 0.0
    meta = _meta([1] * len(ctx), ctx, tables, bs, device)
    scale = dim**-0.5
    launch = dict(tma=True, num_splits=3, block_n=16, min_split=16, unmasked_v=unmasked_v)
    plan = tk.plan_decode(len(ctx), cache, max(ctx), fp8_pairs=True, **launch)
    assert plan.fp8_pairs and plan.unmasked_v == unmasked_v
    q = torch.randn(len(ctx), heads, dim, dtype=DTYPE, device=device)
    new = None
    if new_tokens:  # rotated and stored by the kernel, then attended from registers
        positions = torch.tensor([c - 1 for c in ctx], device=device)
        slots = torch.stack(
            [tables[i, (c - 1) // bs] * bs + (c - 1) % bs for i, c in enumerate(ctx)]
        ).long()
        rope = RotaryEmbedding(dim, {"rope_theta": 1e4, "rope_type": "default"}).to(device)
        cos, sin = rope(positions, DTYPE)
        k = torch.randn(len(ctx), kv_heads, dim, dtype=DTYPE, device=device) * 2
        v = torch.randn(len(ctx), kv_heads, dim, dtype=DTYPE, device=device) * 0.5
        new = tk.NewTokens(k, v, cos, sin, slots)
    got = tk.paged_decode_triton(
        q, cache, tables, meta.context_lens, scale, plan, window, new=new, kv_scale=kv_scale
    )
    if new is not None:  # the reference reads the new tokens where the kernel stored them
        for slot in slots.tolist():
            clean[slot // bs, :, slot % bs] = cache[slot // bs, :, slot % bs]
        q = apply_rotary(q.float(), new.k.float(), cos.float(), sin.float())[0].to(DTYPE)
    want = paged_attention_reference(q, _dequantized(clean, kv_scale, DTYPE), meta, scale, window)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, **TOL)


def test_fp8_word_pairs_are_planned_for_fp8_tma_tiles_only():
    launch = dict(tma=True, block_n=16, min_split=16, fp8_pairs=True)
    fp8 = torch.zeros(4, 2, 16, 2, 64, dtype=FP8)
    assert tk.plan_decode(1, fp8, 64, **launch).fp8_pairs
    assert not tk.plan_decode(1, fp8, 64, **{**launch, "tma": False}).fp8_pairs
    assert not tk.plan_decode(1, fp8, 64, qk_fp8=True, **launch).fp8_pairs
    assert not tk.plan_decode(1, fp8.to(torch.bfloat16), 64, **launch).fp8_pairs
    assert not tk.plan_decode(1, fp8[..., :16], 64, **launch).fp8_pairs  # a head of 16
    # V's tiles as fetched: only where the pairs read them (byte-wide tiles measured slower)
    assert tk.plan_decode(1, fp8, 64, unmasked_v=True, **launch).unmasked_v
    assert not tk.plan_decode(
        1, fp8, 64, unmasked_v=True, **{**launch, "fp8_pairs": False}
    ).unmasked_v
