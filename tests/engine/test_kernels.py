"""Paged attention reference equals dense causal attention, for any block layout."""

from __future__ import annotations

import pytest
import torch

from flashstack.engine.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
    paged_attention_reference,
    register_attention_backend,
    store_kvcache_reference,
)


def dense_attention(q, k, v, window=None):
    """Plain causal attention for one sequence: q [n, Hq, D] are the last n of ctx positions."""
    n, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(ctx - n, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def build(ctx_lens, query_lens, block_size=4, hq=4, hkv=2, d=8, num_blocks=64, seed=0):
    """Random per-sequence K/V scattered over shuffled blocks, plus the matching metadata."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(num_blocks, 2, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, ks, vs, slots = [], [], [], []
    for ctx in ctx_lens:
        nb = -(-ctx // block_size)
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        k, v = torch.randn(ctx, hkv, d, generator=g), torch.randn(ctx, hkv, d, generator=g)
        ks.append(k)
        vs.append(v)
        slots.append(
            torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        )
    for k, v, s in zip(ks, vs, slots):
        store_kvcache_reference(k, v, cache, s)
    width = max(len(t) for t in tables)
    qs = [torch.randn(n, hq, d, generator=g) for n in query_lens]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_context_len=max(ctx_lens),
        query_lens_host=list(query_lens),
        context_lens_host=list(ctx_lens),
    )
    return cache, meta, qs, ks, vs


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "ctx_lens,query_lens",
    [
        ([9, 3, 17], [9, 1, 4]),  # a prefill, a decode, a chunk
        ([5, 12, 1, 8], [1, 1, 1, 1]),  # decode-only batch takes the vectorised path
    ],
)
def test_paged_matches_dense(ctx_lens, query_lens, window) -> None:
    cache, meta, qs, ks, vs = build(ctx_lens, query_lens)
    out = paged_attention_reference(torch.cat(qs), cache, meta, 8**-0.5, window)
    ref = torch.cat([dense_attention(q, k, v, window) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_store_writes_only_its_slots() -> None:
    cache = torch.zeros(4, 2, 2, 1, 1)
    store_kvcache_reference(
        torch.ones(2, 1, 1), 2 * torch.ones(2, 1, 1), cache, torch.tensor([5, 2])
    )
    assert cache[2, 0, 1].item() == 1 and cache[1, 0, 0].item() == 1 and cache[2, 1, 1].item() == 2
    assert cache.sum().item() == 6


def test_backend_registry() -> None:
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope", cpu)
    register_attention_backend(
        AttentionBackend("test-double", store_kvcache_reference, paged_attention_reference)
    )
    assert get_attention_backend("test-double", cpu).paged_attention is paged_attention_reference
