"""Paged attention over a block-wise KV cache: torch reference and the backend registry Triton plugs into.

KV cache layout, per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; index 0 is K, 1 is V.
One block of one layer (K and V) is a single contiguous region, so a decode kernel streams it in one go.
Queries are packed varlen: sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` and its
queries are the *last* ``query_len`` positions of its ``context_len`` cached tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, passed explicitly down the model (no module-global context)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset for each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0 (masked by context_lens)
    context_lens: torch.Tensor  # [num_seqs] int32: cached tokens after this step's writes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    block_size: int
    max_query_len: int
    max_context_len: int
    # Host copies so the reference path never syncs with the device to read a length.
    query_lens_host: list[int]
    context_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        """Sequences in this step."""
        return len(self.query_lens_host)

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return self.max_query_len == 1


StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
AttendFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor]


@dataclass(slots=True, frozen=True)
class AttentionBackend:
    """A pair of kernels: write new K/V into their slots, then attend over the paged cache."""

    name: str
    store_kvcache: StoreFn  # (k, v, kv_cache, slot_mapping) -> None
    paged_attention: AttendFn  # (q, kv_cache, meta, scale, sliding_window) -> out


def store_kvcache_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into the cache at `slot_mapping`."""
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)


def _gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = -(-ctx // kv_cache.shape[2])
    kv = kv_cache[block_table[:num_blocks].long()]  # [nb, 2, bs, H, D]
    h, d = kv.shape[-2:]
    return kv[:, 0].reshape(-1, h, d)[:ctx], kv[:, 1].reshape(-1, h, d)[:ctx]


def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    # q [n, Hq, D]; k, v [ctx, Hkv, D]; grouped-query heads share a KV head.
    n, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(n, hkv, hq // hkv, d).float()
    scores = torch.einsum("nhgd,khd->hgnk", qg, k.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hgnk,khd->nhgd", scores.softmax(-1), v.float())
    return out.reshape(n, hq, d).to(q.dtype)


def _decode_batched(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None) -> torch.Tensor:
    # One query per sequence: gather every block table at once and mask past each context length.
    b, hq, d = q.shape
    kv = kv_cache[meta.block_tables.long()]  # [B, nb, 2, bs, H, D]
    hkv = kv.shape[-2]
    k = kv[:, :, 0].reshape(b, -1, hkv, d).float()
    v = kv[:, :, 1].reshape(b, -1, hkv, d).float()
    k_pos = torch.arange(k.shape[1], device=q.device)
    q_pos = meta.context_lens.long()[:, None] - 1
    mask = k_pos[None, :] <= q_pos
    if window is not None:
        mask &= k_pos[None, :] > q_pos - window
    qg = q.reshape(b, hkv, hq // hkv, d).float()
    scores = torch.einsum("bhgd,bkhd->bhgk", qg, k) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgk,bkhd->bhgd", scores.softmax(-1), v)
    return out.reshape(b, hq, d).to(q.dtype)


def paged_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of packed queries q [num_tokens, heads, head_dim] over the paged cache."""
    if meta.is_decode_only:
        return _decode_batched(q, kv_cache, meta, scale, sliding_window)
    out = torch.empty_like(q)
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        k, v = _gather_kv(kv_cache, meta.block_tables[i], ctx)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = _causal_mask(q_pos, torch.arange(ctx, device=q.device), sliding_window)
        out[start:start + n] = _attend_one(q[start:start + n], k, v, mask, scale)
        start += n
    return out


_BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend("reference", store_kvcache_reference, paged_attention_reference),
}


def register_attention_backend(backend: AttentionBackend) -> None:
    """Make a backend (e.g. Triton kernels) selectable by name; 'auto' prefers 'triton' on CUDA."""
    _BACKENDS[backend.name] = backend


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Resolve a backend name ('auto' picks the fastest one registered for this device)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "reference"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]
