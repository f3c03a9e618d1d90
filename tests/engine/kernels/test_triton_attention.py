"""Each Triton attention kernel against its plain-torch reference (the oracle)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from flashstack.engine.kernels.attention import (
    AttentionMetadata,
    paged_attention_reference,
    store_kvcache_reference,
)

tk = pytest.importorskip("flashstack.engine.kernels.triton_attention")

ON_GPU = torch.cuda.is_available()
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]


def _cache(num_blocks, block_size, kv_heads, dim, dtype, device):
    return torch.randn(num_blocks, 2, block_size, kv_heads, dim, dtype=dtype, device=device)


def _tables(context_lens, block_size, num_blocks, device):
    """Random, disjoint block tables, padded with 0."""
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = []
    for ctx in context_lens:
        n = math.ceil(ctx / block_size)
        tables.append([free.pop() for _ in range(n)])
    width = max(len(t) for t in tables)
    return torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )


def _meta(query_lens, context_lens, tables, block_size, device):
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens_host=list(query_lens),
        context_lens_host=list(context_lens),
    )


def _decode(q, cache, tables, context_lens, scale, grid_context, window=None, new=None, **launch):
    """The decode kernel for these queries, launched as plan_decode says for `grid_context` (with
    `launch` overriding its choices)."""
    plan = tk.plan_decode(q.shape[0], cache, grid_context, **launch)
    return tk.paged_decode_triton(q, cache, tables, context_lens, scale, plan, window, new=new)


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=2e-4, rtol=2e-4)


SHAPES = [  # heads, kv_heads, head_dim, block_size, context lens
    (4, 4, 64, 16, [1, 17, 40]),
    (8, 2, 64, 32, [5, 100]),
    (16, 2, 128, 16, [33, 64]),
]
if ON_GPU:
    SHAPES += [
        (32, 8, 128, 256, [1000, 4097, 300]),
        (32, 4, 128, 512, [32768]),
        (28, 4, 128, 64, [513, 7]),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,ctx", SHAPES)
def test_decode_matches_reference(device, dtype, heads, kv_heads, dim, block_size, ctx):
    torch.manual_seed(0)
    num_blocks = sum(math.ceil(c / block_size) for c in ctx) + 3
    cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, device)
    tables = _tables(ctx, block_size, num_blocks, device)
    meta = _meta([1] * len(ctx), ctx, tables, block_size, device)
    q = torch.randn(len(ctx), heads, dim, dtype=dtype, device=device)
    scale = dim**-0.5
    want = paged_attention_reference(q, cache, meta, scale)
    got = _decode(q, cache, tables, meta.context_lens, scale, max(ctx))
    torch.testing.assert_close(got, want, **_tol(dtype))
    # A graph-sized grid (more splits than the context needs) gives the same answer, and so do
    # short splits, which the merge kernel combines.
    got = _decode(q, cache, tables, meta.context_lens, scale, max(ctx) * 4, num_splits=5)
    torch.testing.assert_close(got, want, **_tol(dtype))
    got = _decode(
        q, cache, tables, meta.context_lens, scale, max(ctx), num_splits=5, block_n=16, min_split=16
    )
    torch.testing.assert_close(got, want, **_tol(dtype))
    # One split: the kernel writes the output directly, no merge.
    got = _decode(q, cache, tables, meta.context_lens, scale, max(ctx), num_splits=1)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("ctx", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("grid_context", [1024, 4096])
def test_decode_one_sequence_short_and_long_grids(device, ctx, grid_context):
    """A lone sequence takes the short-context launch under a short grid bound and the default one
    under a long bound (as bucket 1's two CUDA graphs do); both match the reference."""
    torch.manual_seed(3)
    dtype, bs, heads, kv_heads, dim = DTYPES[0], 16, 8, 2, 64
    num_blocks = math.ceil(ctx / bs) + 2
    cache = _cache(num_blocks, bs, kv_heads, dim, dtype, device)
    tables = _tables([ctx], bs, num_blocks, device)
    meta = _meta([1], [ctx], tables, bs, device)
    q = torch.randn(1, heads, dim, dtype=dtype, device=device)
    assert tk.short_decode(1, grid_context) == (grid_context <= tk.SHORT_DECODE_CONTEXT)
    assert not tk.short_decode(2, grid_context)
    # Bucket 1's graphs: one per launch configuration it can take.
    assert tk.decode_grid_bounds(1, grid_context) == sorted(
        {min(grid_context, tk.SHORT_DECODE_CONTEXT), grid_context}
    )
    assert tk.decode_grid_bounds(2, grid_context) == [grid_context]
    want = paged_attention_reference(q, cache, meta, 0.125)
    got = _decode(q, cache, tables, meta.context_lens, 0.125, grid_context)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("attention_pdl", [False, True])
def test_decode_with_the_engines_kernel_options_matches_reference(device, attention_pdl):
    """The step's launch (plan_step_decode) takes programmatic dependent launch exactly where
    KernelOptions.attention_pdl applies on the device (Hopper, compiled Triton), and the split and
    merge kernels give the reference's output either way."""
    from flashstack.engine.config import KernelOptions
    from flashstack.engine.kernels.pdl import pdl_applies

    torch.manual_seed(4)
    dtype, bs, heads, kv_heads, dim, ctx = DTYPES[0], 16, 8, 2, 64, [300]
    cache = _cache(math.ceil(ctx[0] / bs) + 2, bs, kv_heads, dim, dtype, device)
    tables = _tables(ctx, bs, cache.shape[0], device)
    meta = _meta([1], ctx, tables, bs, device)
    kernels = KernelOptions(attention_pdl=attention_pdl).resolved(device)
    assert kernels.attention_pdl == (attention_pdl and pdl_applies(device))
    plan = tk.plan_step_decode(meta, cache, kernels)
    assert plan.pdl == kernels.attention_pdl and plan.num_splits > 1  # the merge kernel runs too
    q = torch.randn(1, heads, dim, dtype=dtype, device=device)
    got = tk.paged_decode_triton(q, cache, tables, meta.context_lens, 0.125, plan)
    torch.testing.assert_close(got, paged_attention_reference(q, cache, meta, 0.125), **_tol(dtype))


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_fixed_splits_matches_reference(device, splits):
    """KernelOptions.decode_splits fixes the launch's splits per sequence (one: no merge kernel),
    whatever the heuristic would take."""
    from flashstack.engine.config import KernelOptions

    torch.manual_seed(5)
    dtype, bs, heads, kv_heads, dim, ctx = DTYPES[0], 16, 8, 2, 64, [300, 41]
    cache = _cache(sum(math.ceil(c / bs) for c in ctx) + 2, bs, kv_heads, dim, dtype, device)
    tables = _tables(ctx, bs, cache.shape[0], device)
    meta = _meta([1, 1], ctx, tables, bs, device)
    plan = tk.plan_step_decode(meta, cache, KernelOptions(decode_splits=splits).resolved(device))
    assert plan.num_splits == splits
    q = torch.randn(2, heads, dim, dtype=dtype, device=device)
    got = tk.paged_decode_triton(q, cache, tables, meta.context_lens, 0.125, plan)
    torch.testing.assert_close(got, paged_attention_reference(q, cache, meta, 0.125), **_tol(dtype))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("new_tokens", [False, True])
@pytest.mark.parametrize("block_size,block_n,splits", [(32, 16, 3), (16, 16, 1), (64, 32, None)])
def test_decode_through_tma_matches_reference(
    device, window, new_tokens, block_size, block_n, splits
):
    """The tensor-memory-accelerator path (whole tiles per block, the split's block-table entries
    read before the loop) gives the reference's answer. Slots past each context and a free block
    hold NaN, as never-written cache memory may: a tile reading them must not let them in."""
    _check_tma_decode(device, window, new_tokens, block_size, block_n, splits, float("nan"))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("new_tokens", [False, True])
@pytest.mark.parametrize("block_size,block_n,splits", [(32, 16, 3), (64, 32, None)])
def test_unmasked_v_tiles_match_reference_over_a_finite_cache(
    device, window, new_tokens, block_size, block_n, splits
):
    """KernelOptions.decode_unmasked_v: V's tiles feed P @ V without their rows past the context
    zeroed. Over a cache whose stale slots hold large finite values (the engine's is zeroed at
    allocation and every store is finite), those rows weigh exactly 0: the reference's answer."""
    _check_tma_decode(device, window, new_tokens, block_size, block_n, splits, 1.0e4, True)


def test_unmasked_v_is_taken_only_for_caches_that_cannot_hold_an_inf():
    """float16 stores can overflow to an inf that a freed block carries into another sequence's
    tiles (0 * inf is NaN), and byte-wide fp8 or the deep launch's tiles measured slower
    unzeroed: those launches keep zeroing V's rows past the context (fp8 tiles read as word pairs
    take it: test_fp8_word_pairs_are_planned_for_fp8_tma_tiles_only)."""
    assert tk.unmasked_v_applies(torch.bfloat16, deep=False)
    assert not tk.unmasked_v_applies(torch.float16, deep=False)
    assert not tk.unmasked_v_applies(torch.float8_e4m3fn, deep=False)
    assert not tk.unmasked_v_applies(torch.bfloat16, deep=True)
    launch = {"tma": True, "block_n": 16, "min_split": 16, "unmasked_v": True}
    for dtype, taken in ((torch.float16, False), (torch.bfloat16, True)):
        cache = torch.zeros(4, 2, 16, 2, 64, dtype=dtype)
        assert tk.plan_decode(1, cache, 64, **launch).unmasked_v == taken


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("new_tokens", [False, True])
def test_idle_splits_leaving_first_change_nothing(device, window, new_tokens):
    """KernelOptions.decode_idle_exit: splits past a sequence's context (contexts of 1 to 100
    tokens over 4 splits of 16-token tiles) return before the wait; the others attend, store the
    new token and leave their partials as before: the reference's answer, through TMA tiles."""
    _check_tma_decode(device, window, new_tokens, 32, 16, 4, float("nan"), idle_exit=True)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("new_tokens", [False, True])
@pytest.mark.parametrize("block_size,block_n,splits", [(32, 16, 3), (16, 16, 1), (64, 32, None)])
def test_first_tile_fetched_before_the_wait_changes_nothing(
    device, window, new_tokens, block_size, block_n, splits
):
    """KernelOptions.decode_preload_rows: each split's first K and V tiles fetched before the wait
    (taken where the new token comes from registers), then attended ahead of the loop; contexts
    of 1 to 100 tokens, splits with nothing to read, NaN in the stale slots: the reference's
    answer."""
    _check_tma_decode(
        device, window, new_tokens, block_size, block_n, splits, float("nan"), preload=True
    )


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("new_tokens", [False, True])
def test_heads_first_grid_changes_nothing(device, window, new_tokens):
    """KernelOptions.decode_heads_first: the grid (kv_heads, batch, splits) reads and writes every
    (sequence, KV head) pair's own rows, stores the new tokens and merges the splits as the
    sequence-first grid does: the reference's answer, through TMA tiles."""
    _check_tma_decode(device, window, new_tokens, 32, 16, 3, float("nan"), heads_first=True)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_heads_first_grid_longest_first_and_plain_loads(device, num_splits, monkeypatch):
    """The heads-first grid over plain loads, its sequences started longest context first: the
    order indexes the grid's second axis."""
    monkeypatch.setattr(tk, "_sm_count", lambda device: 4)  # several waves of programs
    torch.manual_seed(4)
    dtype, bs, heads, kv_heads, dim, ctx = DTYPES[0], 16, 8, 4, 64, [7, 90, 33, 150, 1]
    cache = _cache(sum(math.ceil(c / bs) for c in ctx) + 1, bs, kv_heads, dim, dtype, device)
    tables = _tables(ctx, bs, cache.shape[0], device)
    meta = _meta([1] * len(ctx), ctx, tables, bs, device)
    q = torch.randn(len(ctx), heads, dim, dtype=dtype, device=device)
    launch = {"tma": False, "num_splits": num_splits, "longest_first": True, "heads_first": True}
    plan = tk.plan_decode(len(ctx), cache, max(ctx), **launch)
    assert plan.heads_first and plan.longest_first
    got = tk.paged_decode_triton(q, cache, tables, meta.context_lens, 0.125, plan)
    torch.testing.assert_close(got, paged_attention_reference(q, cache, meta, 0.125), **_tol(dtype))
    # more sequences than a grid's second axis holds stay on its first
    assert not tk.plan_decode(tk.GRID_Y_MAX + 1, cache, max(ctx), **launch).heads_first


def test_idle_splits_leaving_first_through_plain_loads(device):
    torch.manual_seed(3)
    dtype, bs, heads, kv_heads, dim, ctx = DTYPES[0], 16, 8, 2, 64, [3, 90, 20]
    cache = _cache(sum(math.ceil(c / bs) for c in ctx) + 1, bs, kv_heads, dim, dtype, device)
    tables = _tables(ctx, bs, cache.shape[0], device)
    meta = _meta([1] * len(ctx), ctx, tables, bs, device)
    q = torch.randn(len(ctx), heads, dim, dtype=dtype, device=device)
    launch = {"tma": False, "num_splits": 4, "block_n": 16, "min_split": 16, "idle_exit": True}
    assert tk.plan_decode(len(ctx), cache, max(ctx), **launch).idle_exit
    got = _decode(q, cache, tables, meta.context_lens, 0.125, max(ctx), **launch)
    torch.testing.assert_close(got, paged_attention_reference(q, cache, meta, 0.125), **_tol(dtype))


def _check_tma_decode(
    device,
    window,
    new_tokens,
    block_size,
    block_n,
    splits,
    stale,
    unmasked_v=False,
    idle_exit=False,
    preload=False,
    heads_first=False,
):
    torch.manual_seed(5)
    dtype, heads, kv_heads, dim = DTYPES[0], 8, 2, 64
    ctx = [1, 45, 100, 33]
    num_blocks = sum(math.ceil(c / block_size) for c in ctx) + 1
    cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, device)
    tables = _tables(ctx, block_size, num_blocks - 1, device)
    cache[num_blocks - 1] = stale
    for row, c in zip(tables.tolist(), ctx):
        cache[row[(c - 1) // block_size], :, (c - 1) % block_size + 1 :] = stale
    meta = _meta([1] * len(ctx), ctx, tables, block_size, device)
    scale = dim**-0.5
    launch = {"num_splits": splits, "block_n": block_n, "min_split": block_n, "tma": True}
    launch.update(
        unmasked_v=unmasked_v, idle_exit=idle_exit, preload=preload, heads_first=heads_first
    )
    plan = tk.plan_decode(len(ctx), cache, max(ctx), **launch)
    assert (plan.unmasked_v, plan.idle_exit, plan.preload, plan.heads_first) == (
        unmasked_v,
        idle_exit,
        preload,
        heads_first,
    )
    if new_tokens:  # the new token comes from registers; its slot is stored by the kernel
        from flashstack.engine.models.layers import RotaryEmbedding, apply_rotary

        positions = torch.tensor([c - 1 for c in ctx], device=device)
        slots = torch.stack(
            [
                tables[i, (c - 1) // block_size] * block_size + (c - 1) % block_size
                for i, c in enumerate(ctx)
            ]
        ).long()
        cos, sin = RotaryEmbedding(dim, {"rope_theta": 1e4, "rope_type": "default"}).to(device)(
            positions, dtype
        )
        k = torch.randn(len(ctx), kv_heads, dim, dtype=dtype, device=device)
        v = torch.randn(len(ctx), kv_heads, dim, dtype=dtype, device=device)
        q = torch.randn(len(ctx), heads, dim, dtype=dtype, device=device)
        new = tk.NewTokens(k, v, cos, sin, slots)
        got = _decode(
            q, cache, tables, meta.context_lens, scale, max(ctx), window, new=new, **launch
        )
        # The reference attends with q rotated in fp32, as the kernel does, over the cache the
        # kernel stored into.
        q = apply_rotary(q.float(), k.float(), cos.float(), sin.float())[0].to(dtype)
    else:
        q = torch.randn(len(ctx), heads, dim, dtype=dtype, device=device)
        got = _decode(q, cache, tables, meta.context_lens, scale, max(ctx), window, **launch)
    # The reference reads whole blocks, so it gets the same cache with the stale slots zeroed.
    clean = cache.clone()
    clean[num_blocks - 1] = 0.0
    for row, c in zip(tables.tolist(), ctx):
        clean[row[(c - 1) // block_size], :, (c - 1) % block_size + 1 :] = 0.0
    want = paged_attention_reference(q, clean, meta, scale, window)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("window", [None, 7])
def test_decode_sliding_window(device, window):
    torch.manual_seed(1)
    dtype = DTYPES[0]
    ctx, bs = [30, 9], 8
    cache = _cache(12, bs, 2, 64, dtype, device)
    tables = _tables(ctx, bs, 12, device)
    meta = _meta([1, 1], ctx, tables, bs, device)
    q = torch.randn(2, 4, 64, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, 0.125, window)
    got = _decode(q, cache, tables, meta.context_lens, 0.125, 30, window)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size", [(4, 4, 64, 16), (8, 2, 64, 32), (16, 2, 128, 16)]
)
def test_prefill_with_cached_prefix_matches_reference(
    device, dtype, heads, kv_heads, dim, block_size
):
    torch.manual_seed(2)
    query_lens, ctx = [5, 20, 1], [5, 37, 18]  # second and third have cached prefixes
    num_blocks = sum(math.ceil(c / block_size) for c in ctx) + 2
    cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, device)
    tables = _tables(ctx, block_size, num_blocks, device)
    meta = _meta(query_lens, ctx, tables, block_size, device)
    q = torch.randn(sum(query_lens), heads, dim, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, dim**-0.5)
    got = tk.paged_prefill_triton(q, cache, meta, dim**-0.5, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("per_program,tma", [(1, False), (2, False), (4, False), (2, True)])
@pytest.mark.parametrize(
    "dim,window", [(64, None), (80, None), (64, 9)], ids=["64", "80", "window"]
)
def test_prefill_launch_matches_reference(device, per_program, tma, dim, window):
    """Every launch paged_prefill_triton may take: query heads of one group together in a program,
    a head size that is no power of two (padded columns in the unmasked tiles too; the TMA then
    falls back to plain loads), key tiles wholly before the queries (unmasked) and along the
    diagonal, a window that cuts both; through the TMA, the slots past a context hold NaN, which
    must not reach the output."""
    torch.manual_seed(5)
    dtype = DTYPES[0]
    query_lens, ctx, bs = [5, 40, 1], [5, 77, 18], 16
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 2
    cache = _cache(num_blocks, bs, 2, dim, dtype, device)
    tables = _tables(ctx, bs, num_blocks, device)
    meta = _meta(query_lens, ctx, tables, bs, device)
    q = torch.randn(sum(query_lens), 8, dim, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, dim**-0.5, window)
    if tma:  # never-written slots after each context's last token
        for row, c in zip(tables.tolist(), ctx):
            cache[row[(c - 1) // bs], :, (c - 1) % bs + 1 :] = float("nan")
    launch = tk.PrefillLaunch(per_program, block_n=16, num_warps=4, tma=tma)
    got = tk.paged_prefill_triton(q, cache, meta, dim**-0.5, window, block_m=16, launch=launch)
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_prefill_refuses_heads_a_program_that_split_a_group(device):
    dtype = DTYPES[0]
    cache = _cache(4, 16, 2, 64, dtype, device)
    tables = _tables([8], 16, 4, device)
    meta = _meta([8], [8], tables, 16, device)
    q = torch.randn(8, 6, 64, dtype=dtype, device=device)  # a group of 3
    with pytest.raises(ValueError, match="do not divide the group of 3"):
        tk.paged_prefill_triton(q, cache, meta, 0.125, launch=tk.PrefillLaunch(2))


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("decode_kernel", [False, True], ids=["prefill-only", "decodes-split"])
def test_mixed_step_on_fixed_grids_matches_reference(device, window, decode_kernel):
    """The launches a CUDA graph bakes in for a mixed step: more prefill programs than the step
    has tiles (the rest exit), decode rows and a chunk longer than one tile, cached prefixes; with
    `decode_kernel`, the leading one-token rows on the split-KV decode kernel, sized for more rows
    than the step has decodes."""
    from flashstack.engine.config import KernelOptions

    torch.manual_seed(4)
    dtype = DTYPES[0]
    query_lens, ctx, bs = [1, 1, 70, 3], [40, 17, 90, 3], 16
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 2
    cache = _cache(num_blocks, bs, 2, 64, dtype, device)
    tables = _tables(ctx, bs, num_blocks, device)
    meta = _meta(query_lens, ctx, tables, bs, device)
    q = torch.randn(sum(query_lens), 4, 64, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, 0.125, window)
    num_tiles = tk.max_prefill_tiles(sum(query_lens), 8)
    skip = 2 if decode_kernel else 0
    tiles = tk.prefill_tiles(query_lens, num_tiles, skip=skip)
    expected = [0, 0, 1, 0] if not decode_kernel else []
    assert tiles[: len(expected) + 6] == expected + [2, 0, 2, 1, 3, 0]
    assert set(tiles[len(expected) + 6 :]) == {-1}
    meta.prefill_tiles = torch.tensor(tiles, dtype=torch.int32, device=device)
    if decode_kernel:
        meta.decode_lens = torch.tensor([40, 17, 1], dtype=torch.int32, device=device)
        meta.grid_context_len = 128
    got = tk.paged_attention_triton(q, cache, meta, 0.125, window, KernelOptions())
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_prefill_sliding_window(device):
    torch.manual_seed(3)
    dtype = DTYPES[0]
    query_lens, ctx, bs = [12, 30], [20, 30], 8
    cache = _cache(10, bs, 2, 64, dtype, device)
    tables = _tables(ctx, bs, 10, device)
    meta = _meta(query_lens, ctx, tables, bs, device)
    q = torch.randn(sum(query_lens), 4, 64, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, 0.125, 5)
    got = tk.paged_prefill_triton(q, cache, meta, 0.125, 5, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("block_size", [16, 64])
def test_store_matches_reference_and_skips_padding(device, block_size):
    torch.manual_seed(4)
    dtype = DTYPES[0]
    heads, dim, tokens = 2, 64, 9
    cache_a = torch.zeros(6, 2, block_size, heads, dim, dtype=dtype, device=device)
    cache_b = cache_a.clone()
    qkv = torch.randn(
        tokens, (4 + 2 * heads) * dim, dtype=dtype, device=device
    )  # a strided view, as in a model
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (4 + heads) * dim :].view(tokens, heads, dim)
    slots = torch.randperm(6 * block_size, device=device)[:tokens]
    store_kvcache_reference(k, v, cache_a, slots)
    padded = torch.cat([slots, torch.full((3,), -1, device=device)])
    kp = torch.cat([k, torch.randn(3, heads, dim, dtype=dtype, device=device)])
    vp = torch.cat([v, torch.randn(3, heads, dim, dtype=dtype, device=device)])
    tk.store_kvcache_triton(kp, vp, cache_b, padded)
    torch.testing.assert_close(cache_b, cache_a, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size,ctx,splits",
    [
        (4, 4, 64, 16, [1, 17, 40], None),  # a context of just the new token
        (8, 2, 64, 16, [37, 100], 3),  # the new token in a later split than the first
        (8, 2, 128, 32, [5, 70], 1),  # one split: the output written directly
        (4, 1, 16, 16, [20, 3], 2),  # head_dim 16, as the tiny test models have
    ],
)
@pytest.mark.parametrize("window", [None, 9])
def test_decode_with_new_tokens_matches_qkv_kernel_then_decode(
    device, dtype, qk_norm, heads, kv_heads, dim, block_size, ctx, splits, window
):
    """Rotating q/k and storing the new k/v inside the decode kernel equals the q/k/v kernel
    followed by the plain decode kernel: same output, same cache. A padded row (slot -1) stores
    nothing, yet attends with its new k/v: they come from registers, not from reading the cache
    back."""
    from flashstack.engine.kernels.triton_qkv import rope_and_store_kv_triton
    from flashstack.engine.models.layers import RotaryEmbedding

    torch.manual_seed(0)
    num_blocks = sum(math.ceil(c / block_size) for c in ctx) + 3
    cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, device)
    tables = _tables(ctx, block_size, num_blocks, device)
    meta = _meta([1] * len(ctx), ctx, tables, block_size, device)
    positions = torch.tensor([c - 1 for c in ctx], device=device)
    real_slots = torch.stack(
        [
            tables[i, (c - 1) // block_size] * block_size + (c - 1) % block_size
            for i, c in enumerate(ctx)
        ]
    ).long()
    slots = real_slots.clone()
    slots[0] = -1  # graph padding
    width = (heads + 2 * kv_heads) * dim
    # views, as the fused projection gives them
    qkv = torch.randn(len(ctx), width, dtype=dtype, device=device)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    cos, sin = RotaryEmbedding(dim, {"rope_theta": 1e4, "rope_type": "default"}).to(device)(
        positions, dtype
    )
    qw = torch.randn(dim, dtype=dtype, device=device) if qk_norm else None
    kw = torch.randn(dim, dtype=dtype, device=device) if qk_norm else None
    scale = dim**-0.5

    want_cache = cache.clone()  # what the cache must hold after the step: row 0 not stored
    rope_and_store_kv_triton(q.clone(), k, v, cos, sin, want_cache, slots, qw, kw, 1e-6)
    full_cache = cache.clone()  # what every row must attend over: its own new k/v included
    q_rot = rope_and_store_kv_triton(
        q.clone(), k, v, cos, sin, full_cache, real_slots, qw, kw, 1e-6
    )
    launch = dict(num_splits=splits, block_n=16, min_split=16)  # short splits: the merge runs too
    want = _decode(q_rot, full_cache, tables, meta.context_lens, scale, max(ctx), window, **launch)
    new = tk.NewTokens(k, v, cos, sin, slots, qw, kw, 1e-6)
    got = _decode(q, cache, tables, meta.context_lens, scale, max(ctx), window, new=new, **launch)
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(cache, want_cache, **_tol(dtype))
    assert torch.equal(q, qkv[:, : heads * dim].view(-1, heads, dim))  # q itself is left unrotated


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_long_prefill_chunks_take_sdpa_and_match_reference(device, monkeypatch, heads, kv_heads):
    """Chunks past SDPA_MIN_QUERY_LEN go through torch's fused attention, cached prefixes
    included."""
    from flashstack.engine.kernels import attention

    torch.manual_seed(6)
    dtype, dim, bs = DTYPES[0], 64, 16
    query_lens, ctx = [20, 24], [37, 24]  # the first with a cached prefix
    monkeypatch.setattr(attention, "SDPA_MIN_QUERY_LEN", 20)
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 2
    cache = _cache(num_blocks, bs, kv_heads, dim, dtype, device)
    tables = _tables(ctx, bs, num_blocks, device)
    meta = _meta(query_lens, ctx, tables, bs, device)
    assert attention.sdpa_prefill_applies(meta, None) and not attention.sdpa_prefill_applies(
        meta, 8
    )
    q = torch.randn(sum(query_lens), heads, dim, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, 0.1)
    torch.testing.assert_close(tk.paged_attention_triton(q, cache, meta, 0.1), want, **_tol(dtype))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_longest_first_matches_reference(device, num_splits, monkeypatch):
    """Programs started longest context first (kernels.decode_longest_first) write every sequence's
    own rows: the same answer, the step's order computed once and shared by its layers."""
    import dataclasses

    from flashstack.engine.config import KernelOptions

    # The interpreter's 4 SMs on any device: these few programs are then more than one wave.
    monkeypatch.setattr(tk, "_sm_count", lambda device: 4)
    torch.manual_seed(5)
    dtype, bs, heads, kv_heads, dim = DTYPES[0], 16, 8, 4, 64
    ctx = [7, 90, 33, 150, 1]
    num_blocks = sum(math.ceil(c / bs) for c in ctx) + 3
    cache = _cache(num_blocks, bs, kv_heads, dim, dtype, device)
    tables = _tables(ctx, bs, num_blocks, device)
    meta = _meta([1] * len(ctx), ctx, tables, bs, device)
    q = torch.randn(len(ctx), heads, dim, dtype=dtype, device=device)
    want = paged_attention_reference(q, cache, meta, 0.125)
    plan = tk.plan_decode(len(ctx), cache, max(ctx), num_splits=num_splits, longest_first=True)
    assert plan.longest_first  # 5 x 4 x splits programs: more than one wave here
    assert tk.decode_order(meta.context_lens).tolist() == [3, 1, 2, 0, 4]
    got = tk.paged_decode_triton(q, cache, tables, meta.context_lens, 0.125, plan)
    torch.testing.assert_close(got, want, **_tol(dtype))
    # The engine's path: the option on, one order in the step's scratch for every layer, made by
    # the first layer's launch and read before the PDL wait by the later ones' (order_ready).
    kernels = dataclasses.replace(KernelOptions(), decode_longest_first=True)
    ready, decode = [], tk.paged_decode_triton
    monkeypatch.setattr(
        tk,
        "paged_decode_triton",
        lambda *a, **kw: ready.append(kw["order_ready"]) or decode(*a, **kw),
    )
    got = tk.paged_attention_triton(q, cache, meta, 0.125, kernels=kernels)
    torch.testing.assert_close(got, want, **_tol(dtype))
    order = meta.scratch["decode_order"]
    got = tk.paged_attention_triton(q, cache, meta, 0.125, kernels=kernels)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert meta.scratch["decode_order"] is order and ready == [False, True]
    # One sequence, or one wave of programs, keeps the grid's own order.
    assert not tk.plan_decode(1, cache, 64, num_splits=8, longest_first=True).longest_first
    assert not tk.plan_decode(2, cache, 64, num_splits=1, longest_first=True).longest_first


@pytest.mark.parametrize("n", [1, 5, 64, 65, 200])
def test_decode_order_is_a_stable_sort_longest_first(device, n):
    """The launch order ranks every sequence in one kernel: longest context first, equal lengths
    in batch order, as torch's stable sort gives it, across several programs."""
    rng = random.Random(n)
    lens = torch.tensor([rng.randint(1, 20) for _ in range(n)], dtype=torch.int32, device=device)
    want = torch.sort(lens, descending=True, stable=True).indices.to(torch.int32)
    got = tk.decode_order(lens)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)


def test_deep_tma_launches_only_for_many_pairs_of_a_16_bit_cache():
    """From DEEP_TMA_PAIRS (sequence, KV head) pairs a 16-bit TMA launch reads 64-token tiles three
    stages deep, two programs per SM; one sequence's launch and an fp8 cache keep their own."""
    assert tk.deep_tma_launch(16, 8, short=False, fp8=False)
    assert not tk.deep_tma_launch(8, 8, short=False, fp8=False)  # the 8B's batch 8
    assert not tk.deep_tma_launch(1, 128, short=True, fp8=False)
    assert not tk.deep_tma_launch(64, 8, short=False, fp8=True)
    assert tk.tma_launch(32, 8, 132, short=False, deep=True) == (3, 2)
    assert tk.tma_launch(32, 8, 132, short=False) == (2, 2)
    assert tk.tma_launch(32, 8, 132, short=False, fp8=True) == (3, 2)
    # fp8 word pairs: two stages, three from one (sequence, KV head) pair per SM
    assert tk.tma_launch(16, 8, 132, short=False, fp8=True, fp8_pairs=True) == (2, 2)
    assert tk.tma_launch(32, 8, 132, short=False, fp8=True, fp8_pairs=True) == (3, 2)
    # decode_wave_tma: up to one (sequence, KV head) pair per SM, three stages, one program per SM
    assert tk.tma_launch(8, 8, 132, short=False, wave=True) == (3, 1)
    assert tk.tma_launch(8, 8, 132, short=False) == (2, 2)
    assert tk.tma_launch(32, 8, 132, short=False, wave=True) == (2, 2)  # past one pair per SM
    assert tk.tma_launch(1, 8, 132, short=True, wave=True) == (2, 2)  # the short launch: its own


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_decode_longest_first_replays_in_a_cuda_graph():
    """The step's sort is captured with the launch: a replay over new context lengths starts the
    new longest first and still matches the reference."""
    import dataclasses

    from flashstack.engine.config import KernelOptions

    torch.manual_seed(6)
    dtype, bs, heads, kv_heads, dim, batch = torch.bfloat16, 256, 32, 8, 128, 64
    rng = random.Random(6)
    ctx = [rng.randint(100, 2000) for _ in range(batch)]
    num_blocks = batch * 8 + 3
    cache = _cache(num_blocks, bs, kv_heads, dim, dtype, "cuda")
    tables = _tables([2048] * batch, bs, num_blocks, "cuda")
    meta = _meta([1] * batch, ctx, tables, bs, "cuda")
    meta.grid_context_len = 2048
    q = torch.randn(batch, heads, dim, dtype=dtype, device="cuda")
    kernels = dataclasses.replace(KernelOptions(), decode_longest_first=True)
    assert tk.plan_step_decode(meta, cache, kernels).longest_first
    tk.paged_attention_triton(q, cache, meta, 0.1, kernels=kernels)  # compile outside the capture
    meta.scratch.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.paged_attention_triton(q, cache, meta, 0.1, kernels=kernels)
    new = [rng.randint(100, 2000) for _ in range(batch)]
    meta.context_lens.copy_(torch.tensor(new, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = paged_attention_reference(q, cache, _meta([1] * batch, new, tables, bs, "cuda"), 0.1)
    torch.testing.assert_close(out, want, **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_wave_launch_reads_three_stages_deep_and_matches_the_reference():
    """decode_wave_tma: 8 sequences x 8 KV heads (at most one pair per SM) over a grid of up to
    WAVE_TMA_MAX_CONTEXT tokens read three stages deep, one program per SM, and agree with the
    reference; a longer grid, or the option off, keeps two stages."""
    from flashstack.engine.config import KernelOptions

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA launch needs Hopper or later")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(7)
    dtype, bs, heads, kv_heads, dim, batch = torch.bfloat16, 256, 32, 8, 128, 8
    if batch * kv_heads > sm_count:
        pytest.skip("fewer SMs than (sequence, KV head) pairs")
    ctx = [544, 100, 2000, 4096, 1, 700, 3000, 256]
    num_blocks = batch * 16 + 3
    cache = _cache(num_blocks, bs, kv_heads, dim, dtype, "cuda")
    plan = tk.plan_decode(batch, cache, 4096)
    assert plan.tma and plan.num_stages == 3 and plan.num_splits == sm_count // (batch * kv_heads)
    assert tk.plan_decode(batch, cache, 4096, wave=False).num_stages == 2
    assert tk.plan_decode(batch, cache, 4 * tk.WAVE_TMA_MAX_CONTEXT).num_stages == 2
    tables = _tables([4096] * batch, bs, num_blocks, "cuda")
    meta = _meta([1] * batch, ctx, tables, bs, "cuda")
    meta.grid_context_len = 4096
    q = torch.randn(batch, heads, dim, dtype=dtype, device="cuda")
    out = tk.paged_attention_triton(q, cache, meta, 0.1, kernels=KernelOptions())
    want = paged_attention_reference(q, cache, _meta([1] * batch, ctx, tables, bs, "cuda"), 0.1)
    torch.testing.assert_close(out, want, **_tol(dtype))
