"""Paged attention over a block-wise KV cache: torch reference, and the registry Triton plugs into.

KV cache layout, per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; 0 is K, 1 is V.
One block of one layer (K and V) is a single contiguous region: a decode kernel streams it at once.
Queries are packed varlen: sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` and its
queries are the *last* ``query_len`` positions of its ``context_len`` cached tokens.

An fp8 cache (float8_e4m3fn) holds K / k_scale and V / v_scale, saturated at e4m3's largest value;
``kv_scale`` is the layer's ``[k_scale, v_scale]`` (fp32, on the cache's device; engine/kv_cache.py
calibrates them). Readers dequantize to the queries' dtype. Any other cache dtype holds K and V as
they are, and its kv_scale is None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flashstack.engine.config import KernelOptions
from flashstack.engine.quantization import FP8, quantize_fp8


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, passed explicitly down the model (no module-global context)."""

    slot_mapping: (
        torch.Tensor
    )  # [num_tokens] int64: block_id * block_size + offset for each new token
    block_tables: (
        torch.Tensor
    )  # [num_seqs, max_blocks] int32, padded with 0 (masked by context_lens)
    context_lens: torch.Tensor  # [num_seqs] int32: cached tokens after this step's writes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    block_size: int
    max_query_len: int
    max_context_len: int
    # Host copies so the reference path never syncs with the device to read a length.
    query_lens_host: list[int]
    context_lens_host: list[int]
    # The context bound a decode launch's grid is sized for: a captured graph's, so one graph serves
    # every step; None: the step's own longest context.
    grid_context_len: int | None = None
    # A mixed step inside a CUDA graph: the Triton prefill kernel's fixed-grid (sequence, query
    # tile) map, int32 pairs (kernels/triton_attention.prefill_tiles); None: the grid is the step's.
    prefill_tiles: torch.Tensor | None = None
    # With prefill_tiles: the context lengths of the leading one-token rows the decode kernel
    # takes (1 past the step's decodes), int32; None: the prefill kernel takes every row.
    decode_lens: torch.Tensor | None = None
    # The number of leading sequences that query one token each (ModelRunner.prepare puts them
    # first).
    decode_rows: int = 0
    # Per-step values a backend derives once and reuses in every layer (indices, masks).
    scratch: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def whole_prefill(cls, n: int, block_size: int, device: torch.device) -> AttentionMetadata:
        """One sequence's whole prefill of `n` tokens into blocks 0, 1, ... of a fresh cache
        (calibration, benchmarks and warm-up forwards outside the scheduler)."""
        blocks = -(-n // block_size)
        return cls(
            slot_mapping=torch.arange(n, device=device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
            context_lens=torch.tensor([n], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            block_size=block_size,
            max_query_len=n,
            max_context_len=n,
            query_lens_host=[n],
            context_lens_host=[n],
        )

    @property
    def num_seqs(self) -> int:
        """Sequences in this step."""
        return len(self.query_lens_host)

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return self.max_query_len == 1


# (k, v, kv_cache, slot_mapping, kv_scale) -> None
StoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], None
]
# (q, kv_cache, meta, scale, sliding_window, kernels, kv_scale) -> out
AttendFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        float,
        "int | None",
        KernelOptions,
        "torch.Tensor | None",
    ],
    torch.Tensor,
]
GridBoundsFn = Callable[[int, int], list[int]]


def one_grid_bound(batch: int, max_model_len: int) -> list[int]:
    """One decode graph per batch bucket, for contexts up to max_model_len."""
    return [max_model_len]


@dataclass(slots=True, frozen=True)
class AttentionBackend:
    """A pair of kernels: write new K/V into their slots, then attend over the paged cache; with the
    engine's kernel options (`get_attention_backend` binds them)."""

    name: str
    store_kvcache: StoreFn
    paged_attention: AttendFn
    # (batch, max_model_len) -> the grid bounds decode graphs of `batch` sequences are captured for
    decode_grid_bounds: GridBoundsFn = one_grid_bound
    kernels: KernelOptions = KernelOptions()

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q over the paged cache with this backend's kernel options."""
        return self.paged_attention(
            q, kv_cache, meta, scale, sliding_window, self.kernels, kv_scale
        )


def _flat_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    # Row of each slot's K in a layer viewed as [num_blocks * 2 * block_size, H, D]; its V is
    # block_size further.
    return (slots // block_size) * (2 * block_size) + slots % block_size


def check_kv_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """True for an fp8 cache (which needs its layer's [k_scale, v_scale]); False otherwise."""
    if kv_cache.dtype != FP8:
        return False
    assert kv_scale is not None and kv_scale.numel() == 2, "an fp8 KV cache needs its kv_scale"
    return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # fp8 tensors as uint8: CPU torch has no index_copy_ / index_select for float8 yet.
    return t.view(torch.uint8) if t.dtype == FP8 else t


def store_kvcache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into the cache at `slot_mapping`."""
    bs = kv_cache.shape[2]
    rows = _flat_rows(slot_mapping, bs)
    flat = _bytes(kv_cache).view(-1, *kv_cache.shape[3:])
    if check_kv_scale(kv_cache, kv_scale):
        k, v = quantize_fp8(k, kv_scale[0]), quantize_fp8(v, kv_scale[1])
    flat.index_copy_(0, rows, _bytes(k.to(kv_cache.dtype)))
    flat.index_copy_(0, rows + bs, _bytes(v.to(kv_cache.dtype)))


def _context_rows(block_tables: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """K rows of the first `num_tokens` positions of every table: [num_seqs, num_tokens]."""
    pos = torch.arange(num_tokens, device=block_tables.device)
    return block_tables.long()[:, pos // block_size] * (2 * block_size) + pos % block_size


def _gather(
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Row gathers (index_select) on the flat view: reads only live positions, whatever the block
    # size. An fp8 cache's rows come back dequantized, in `dtype`.
    flat = _bytes(kv_cache).view(-1, *kv_cache.shape[3:])
    bs = kv_cache.shape[2]
    shape = (*rows.shape, *kv_cache.shape[3:])
    k = flat.index_select(0, rows.flatten()).view(shape)
    v = flat.index_select(0, (rows + bs).flatten()).view(shape)
    if check_kv_scale(kv_cache, kv_scale):
        k = (k.view(FP8).float() * kv_scale[0]).to(dtype)
        v = (v.view(FP8).float() * kv_scale[1]).to(dtype)
    return k.transpose(-3, -2), v.transpose(-3, -2)  # [..., H, T, D]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    # q [B, Hq, n, D]; k, v [B, Hkv, T, D]; mask broadcastable to [B, 1, n, T] (True = attend).
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    # q_pos [..., n, 1], k_pos [..., 1, T]: causal, optionally limited to the last `window`
    # positions.
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _decode_batched(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    # One query per sequence: one gather for the whole batch, masked past each context length.
    key = ("decode", window)
    if key not in meta.scratch:
        rows = _context_rows(meta.block_tables, meta.max_context_len, meta.block_size)
        k_pos = torch.arange(meta.max_context_len, device=q.device)[None, None, None, :]
        q_pos = (meta.context_lens.long() - 1)[:, None, None, None]
        meta.scratch[key] = (rows, _window_mask(q_pos, k_pos, window))
    rows, mask = meta.scratch[key]
    k, v = _gather(kv_cache, rows, kv_scale, q.dtype)
    out = _sdpa(q[:, :, None, :].to(k.dtype), k, v, mask, scale)
    return out[:, :, 0].to(q.dtype)


def _prefill_plan(meta: AttentionMetadata, window: int | None, device: torch.device) -> list:
    plan = []
    for i, (n, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        rows = _context_rows(meta.block_tables[i : i + 1], ctx, meta.block_size)
        q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
        plan.append(
            (n, rows, _window_mask(q_pos, torch.arange(ctx, device=device)[None, :], window))
        )
    return plan


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kernels: KernelOptions | None = None,  # torch's kernels take no launch options
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries q [num_tokens, heads, head_dim] over the paged cache."""
    if meta.is_decode_only:
        return _decode_batched(q, kv_cache, meta, scale, sliding_window, kv_scale)
    key = ("prefill", sliding_window)
    if key not in meta.scratch:
        meta.scratch[key] = _prefill_plan(meta, sliding_window, q.device)
    out = torch.empty_like(q)
    start = 0
    for n, rows, mask in meta.scratch[key]:
        k, v = _gather(kv_cache, rows, kv_scale, q.dtype)  # [1, H, ctx, D]
        qi = q[start : start + n].transpose(0, 1)[None].to(k.dtype)  # [1, Hq, n, D]
        out[start : start + n] = _sdpa(qi, k, v, mask, scale)[0].transpose(0, 1).to(q.dtype)
        start += n
    return out


# Query chunks at least this long (every sequence of the step) take torch's fused attention instead
# of the Triton paged-prefill kernel: one layer of an 8192-token chunk of the Llama-3-8B shape on
# the H200 (bench/engine_prefill_attention.py), gather included, takes 1.13 / 5.29 / 12.0 ms at
# context 8K / 16K / 32K against the Triton kernel's 3.28 / 9.74 / 23.1 ms.
SDPA_MIN_QUERY_LEN = 1024


def sdpa_prefill_applies(meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """Whether `paged_prefill_sdpa` takes this step: long chunks only, where the gather's cost is
    small against the attention's, and no sliding window (its bias is not one the fused kernels
    take)."""
    return (
        sliding_window is None
        and not meta.is_decode_only
        and min(meta.query_lens_host) >= SDPA_MIN_QUERY_LEN
    )


def paged_prefill_sdpa(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of long query chunks q [num_tokens, heads, head_dim] through
    scaled_dot_product_attention: each sequence's context is gathered out of its blocks into one
    contiguous K/V, each KV head repeated for its query heads, and the chunk (the context's last
    positions) attends under the lower-right causal bias, which the flash kernels take natively;
    the reference path's boolean mask would force the slow kernels."""
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // kv_cache.shape[3]
    out = torch.empty_like(q)
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        rows = _context_rows(meta.block_tables[i : i + 1], ctx, meta.block_size)
        k, v = _gather(kv_cache, rows, kv_scale, q.dtype)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qi = q[start : start + n].transpose(0, 1)[None].to(k.dtype)  # [1, Hq, n, D]
        attn = torch.nn.functional.scaled_dot_product_attention(
            qi, k, v, attn_mask=causal_lower_right(n, ctx), scale=scale
        )
        out[start : start + n] = attn[0].transpose(0, 1).to(q.dtype)
        start += n
    return out


_BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend("reference", store_kvcache_reference, paged_attention_reference),
}


def register_attention_backend(backend: AttentionBackend) -> None:
    """Make a backend (e.g. Triton kernels) selectable by name; 'auto' prefers 'triton' on CUDA."""
    _BACKENDS[backend.name] = backend


def get_attention_backend(
    name: str, device: torch.device, kernels: KernelOptions = KernelOptions()
) -> AttentionBackend:
    """Resolve a backend name ('auto' picks the fastest one registered for this device), bound to
    the engine's kernel options."""
    if device.type == "cuda" and "triton" not in _BACKENDS:
        _register_triton()
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "reference"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}")
    return replace(_BACKENDS[name], kernels=kernels)


def _register_triton() -> None:
    # Imported lazily: triton is only needed (and only compiles) on CUDA devices.
    try:
        from flashstack.engine.kernels.triton_attention import (
            decode_grid_bounds,
            paged_attention_triton,
            store_kvcache_triton,
        )
    except ImportError:
        return
    register_attention_backend(
        AttentionBackend("triton", store_kvcache_triton, paged_attention_triton, decode_grid_bounds)
    )
