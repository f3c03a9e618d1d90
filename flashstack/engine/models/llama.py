"""Llama-style decoder (Llama 1-3, Mistral; Qwen2/3 reuse it with flags). Module names mirror HF's
so checkpoint keys load without renaming."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flashstack.engine.kernels.attention import AttentionBackend, AttentionMetadata
from flashstack.engine.models.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rope_parameters,
)

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class ModelArgs:
    """The shape of a decoder, read from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_positions: int = 2048  # config.json's max_position_embeddings: the engine never goes past it
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> ModelArgs:
        """Read the common fields of a Llama-family config.json."""
        heads = hf["num_attention_heads"]
        args = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope_parameters(hf),
            max_positions=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=hf.get("attention_bias", False),
            o_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
        )
        args.update(overrides)
        return cls(**args)


class Attention(nn.Module):
    """Grouped-query attention: writes its K/V into the paged cache, reads the context back."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.qk_norm = a.qk_norm
        self.sliding_window = a.sliding_window
        self.scale = a.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        backend.store_kvcache(k, v, kv_cache, meta.slot_mapping)
        out = backend.attend(q, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(a.head_dim, a.rope, a.max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if getattr(self, "fused", False):  # the CUDA fast path (models/fused.py)
            from flashstack.engine.models.fused import fused_forward

            return fused_forward(self, input_ids, positions, meta, kv_caches, backend)
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)  # shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, meta, kv_cache, backend)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Llama 1/2/3 (incl. rope scaling) and Mistral."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def args_from_hf(cls, hf: dict[str, Any]) -> ModelArgs:
        """Llama and Mistral read the common fields; Mistral may set a sliding window."""
        return ModelArgs.from_hf(hf, sliding_window=hf.get("sliding_window"))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states for the packed tokens."""
        return self.model(input_ids, positions, meta, kv_caches, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for the selected hidden states."""
        return self.lm_head(hidden)
