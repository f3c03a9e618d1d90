"""The GPU fast path of the Llama-family decoder: fused projections and fused Triton elementwise kernels.

At batch 1 a decode step is a few hundred small kernels between the weight reads, and their launch
gaps, not the arithmetic, are what separates a step from the bandwidth floor. Concatenating the
q/k/v and gate/up weights halves the matmul launches and lets each read one contiguous weight; the
Triton kernels collapse RMSNorm + residual add and SiLU-and-mul into one launch each, and q/k-norm,
rotary and the KV store into one. A one-token step goes further: the norms, SiLU-and-mul and
residual adds run inside the batch-1 GEMVs (kernels/triton_gemv.py), and the decode attention
kernel does the q/k/v kernel's work: six kernels a layer (four GEMVs, attention and its merge).
The plain modules stay the CPU path and the oracle; this path is taken only on CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flashstack.engine.config import KernelOptions
from flashstack.engine.kernels.attention import AttentionBackend, AttentionMetadata


def _concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


class GemvLinear(nn.Module):
    """An nn.Linear (same weight, same bias) whose one-row products run through the Triton batch-1
    GEMV (kernels/triton_gemv.py); every other shape stays with cuBLAS."""

    def __init__(self, linear: nn.Linear, pdl: bool = True) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pdl = pdl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from flashstack.engine.kernels.triton_gemv import linear

        return linear(x, self.weight, self.bias, pdl=self.pdl)


def use_triton_gemv(model: nn.Module, pdl: bool = True) -> None:
    """Route the plain projections' batch-1 products through the Triton GEMV (tensor-parallel
    row-parallel layers keep their own forward, which reduces across ranks)."""
    owners = [model] + [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    for owner in owners:
        for name, child in list(owner.named_children()):
            if type(child) is nn.Linear:
                setattr(owner, name, GemvLinear(child, pdl))
    if hasattr(model.lm_head, "one_row_gemv"):  # the vocabulary-parallel head
        model.lm_head.one_row_gemv = True


def fuse_model(model: nn.Module, kernels: KernelOptions = KernelOptions()) -> bool:
    """Switch a loaded decoder to the fused path; returns False (and changes nothing) off CUDA."""
    decoder = model.model
    if decoder.embed_tokens.weight.device.type != "cuda":
        return False
    head_dim = model.args.head_dim
    if head_dim & (head_dim - 1):  # the rotary kernel works on power-of-two halves
        return False
    fuse_weights(model, one_row_gemv=kernels.triton_gemv, pdl=kernels.pdl)
    torch.cuda.empty_cache()
    return True


def fuse_weights(model: nn.Module, one_row_gemv: bool = True, pdl: bool = True) -> None:
    """Concatenate q/k/v and gate/up and mark the decoder fused (fuse_model without its device
    check: the kernel tests drive the fused path on CPU under Triton's interpreter)."""
    decoder = model.model
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = _concat_linear([mlp.gate_proj, mlp.up_proj])
        # The unfused weights would double the memory the model holds; drop them.
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    decoder.fused = True
    if one_row_gemv:
        # One-row steps fold the norms, SiLU-and-mul and residual adds into the GEMVs; under tensor
        # parallelism the row-parallel o and down GEMVs write partial sums for the all-reduce.
        decoder.one_row_gemv = True
        use_triton_gemv(model, pdl)


def fused_forward(decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> torch.Tensor:
    """DecoderModel.forward on the fused path: same math, a fraction of the launches."""
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton

    hidden = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(positions, hidden.dtype)
    if hidden.shape[0] == 1 and backend.name == "triton" and getattr(decoder, "one_row_gemv", False):
        return _one_row_forward(decoder, hidden, cos, sin, meta, kv_caches, backend)
    residual: torch.Tensor | None = None
    for layer, kv_cache in zip(decoder.layers, kv_caches):
        x, residual = _norm(layer.input_layernorm, hidden, residual)
        hidden = _attention(layer.self_attn, x, cos, sin, meta, kv_cache, backend)
        x, residual = _norm(layer.post_attention_layernorm, hidden, residual)
        hidden = _mlp(layer.mlp, x)
    out, _ = rmsnorm_triton(hidden, decoder.norm.weight, decoder.norm.eps, residual)
    return out


def _one_row_forward(decoder: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> torch.Tensor:
    """One token (a batch-1 decode step): four GEMVs and attention per layer.

    The residual stream is one row that every layer adds into (in place on one GPU, through the
    all-reduce under tensor parallelism: `_add_projection`); the RMSNorms run in the prologues of the
    q/k/v and gate/up GEMVs, SiLU-and-mul in the down GEMV's, the residual adds in the epilogues of o
    and down. Same rounding as the unfused kernels on one GPU (kernels/triton_gemv.py)."""
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton
    from flashstack.engine.kernels.triton_gemv import gemv_triton

    pdl = backend.kernels.pdl
    residual = hidden  # the embedding row, fresh from the lookup: ours to add into
    for layer, kv_cache in zip(decoder.layers, kv_caches):
        attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        qkv = gemv_triton(attn.qkv_proj.weight, residual, attn.qkv_proj.bias, norm=(norm1.weight, norm1.eps), pdl=pdl)
        out = _qkv_attention(attn, qkv, cos, sin, meta, kv_cache, backend)
        residual = _add_projection(attn.o_proj, out, residual, pdl=pdl)
        gate_up = gemv_triton(mlp.gate_up_proj.weight, residual, mlp.gate_up_proj.bias, norm=(norm2.weight, norm2.eps),
                              pdl=pdl)
        residual = _add_projection(mlp.down_proj, gate_up, residual, silu=True, pdl=pdl)
    return rmsnorm_triton(residual, decoder.norm.weight, decoder.norm.eps)[0]


def _add_projection(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor, silu: bool = False,
                    pdl: bool = True) -> torch.Tensor:
    """residual + proj(x) for the o and down projections of a one-row step; returns the new residual.

    On one GPU the GEMV adds into the residual in place. A row-parallel projection (tensor
    parallelism) holds a slice of the input features, so each rank's GEMV gives a partial sum: the
    driver's also carries the residual (and the bias), so the all-reduce of the partials is the new
    residual, with no separate add. The partials go straight into peer-visible memory where the
    one-shot all-reduce can read them."""
    from flashstack.engine.kernels.triton_gemv import gemv_triton

    tp = getattr(proj, "tp", None)
    if tp is None:
        return gemv_triton(proj.weight, x, proj.bias, silu=silu, residual=residual, pdl=pdl)
    driver = tp.is_driver
    fast = tp.fast is not None and tp.fast.fits_shape(tuple(residual.shape), residual.dtype)
    staged = tp.fast.stage(tuple(residual.shape)) if fast else torch.empty_like(residual)
    gemv_triton(proj.weight, x, proj.bias if driver else None, silu=silu, residual=residual if driver else None,
                out=staged, pdl=pdl)
    if fast:
        return tp.fast.reduce(staged)
    dist.all_reduce(staged, group=tp.group)
    return staged


def _norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton

    out, new_residual = rmsnorm_triton(hidden, norm.weight, norm.eps, residual)
    return out, (hidden if residual is None else new_residual)


def _attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
               kv_cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    return attn.o_proj(_qkv_attention(attn, attn.qkv_proj(x), cos, sin, meta, kv_cache, backend))


def _qkv_attention(attn: nn.Module, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   kv_cache: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """Attention from the fused q/k/v projection's output: norms, rotary, KV store, attention;
    returns the heads' outputs [tokens, heads * head_dim], before o_proj."""
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton, rope_triton

    n, d = qkv.shape[0], attn.head_dim
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
    q = qkv[:, :q_size].view(n, attn.num_heads, d)
    k = qkv[:, q_size:q_size + kv_size].view(n, attn.num_kv_heads, d)
    v = qkv[:, q_size + kv_size:].view(n, attn.num_kv_heads, d)
    norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm else ()
    if backend.name == "triton" and meta.is_decode_only and n == 1 and backend.kernels.decode_qkv:
        # The decode kernel rotates q/k and stores the new k/v itself: one launch for it all. Only
        # at batch 1, where it measured faster (8B step 4.30 -> 4.24 ms on the H200); at batch 32
        # and 128 it measured ~1 % slower than the separate kernel.
        from flashstack.engine.kernels.triton_attention import NewTokens, paged_decode_triton, plan_step_decode

        plan = plan_step_decode(meta, kv_cache, backend.kernels)
        out = paged_decode_triton(q, kv_cache, meta.block_tables, meta.context_lens, attn.scale, plan,
                                  attn.sliding_window, new=NewTokens(k, v, cos, sin, meta.slot_mapping, *norms))
        return out.reshape(n, -1)
    if backend.name == "triton":  # one launch for q/k-norm, rotary and the KV store
        from flashstack.engine.kernels.triton_qkv import rope_and_store_kv_triton

        q = rope_and_store_kv_triton(q, k, v, cos, sin, kv_cache, meta.slot_mapping, *norms)
    else:
        if attn.qk_norm:
            q = rmsnorm_triton(q, attn.q_norm.weight, attn.q_norm.eps)[0]
            k = rmsnorm_triton(k, attn.k_norm.weight, attn.k_norm.eps)[0]
        q, k = rope_triton(q, k, cos, sin)
        backend.store_kvcache(k, v, kv_cache, meta.slot_mapping)
    out = backend.attend(q, kv_cache, meta, attn.scale, attn.sliding_window)
    return out.reshape(n, -1)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from flashstack.engine.kernels.triton_elementwise import silu_and_mul_triton

    return mlp.down_proj(silu_and_mul_triton(mlp.gate_up_proj(x)))
