"""Llama-style decoder (Llama 1-3, Mistral; Qwen2/3 reuse it with flags). Module names mirror HF's
so checkpoint keys load without renaming."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flashstack.engine.kernels.attention import AttentionMetadata
from flashstack.engine.models.layers import (
    Embedding,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
)
from flashstack.engine.models.linear import Linear, PackedLinear, Part
from flashstack.engine.models.parallel import (
    HeadSplit,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from flashstack.engine.models.ops import Ops
    from flashstack.engine.tp.group import TensorParallel

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
    # config.json's max_position_embeddings: the engine never goes past it
    max_positions: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # "fp8" or "q8_0": how the decoder layers' projections store their weights
    # (engine/quantization.py); None: in the compute dtype
    quantization: str | None = None

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
    """Grouped-query attention's weights: q/k/v packed in one projection, o after the heads.
    Under tensor parallelism this rank's heads (`split`); what runs is the Ops' (models/ops.py)."""

    def __init__(self, a: ModelArgs, split: HeadSplit, tp: TensorParallel | None) -> None:
        super().__init__()
        d, h = a.head_dim, a.hidden_size
        q0, k0, nq, nkv = split.q_start * d, split.kv_start * d, split.num_q * d, split.num_kv * d
        parts = [
            Part("q_proj", q0, q0 + nq),
            Part("k_proj", k0, k0 + nkv),
            Part("v_proj", k0, k0 + nkv),
        ]
        self.qkv_proj = PackedLinear(h, parts, bias=a.qkv_bias, quantization=a.quantization)
        self.o_proj = (
            RowParallelLinear(h, q0, q0 + nq, a.o_bias, tp)
            if tp
            else Linear(nq, h, bias=a.o_bias, quantization=a.quantization)
        )
        if a.qk_norm:
            self.q_norm = RMSNorm(d, a.rms_norm_eps)
            self.k_norm = RMSNorm(d, a.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = split.num_q, split.num_kv, d
        self.qk_norm = a.qk_norm
        self.sliding_window = a.sliding_window
        self.scale = d**-0.5
        # An fp8 KV cache's [k_scale, v_scale] for this layer (engine/kv_cache.py); None otherwise.
        self.kv_scale: torch.Tensor | None = None

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of q [n, heads, d], k and v [n, kv_heads, d] in the packed projection's output."""
        n, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q = qkv[:, :q_size].view(n, self.num_heads, d)
        k = qkv[:, q_size : q_size + kv_size].view(n, self.num_kv_heads, d)
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, d)
        return q, k, v


class GatedMLP(nn.Module):
    """SwiGLU feed-forward's weights: down(silu(gate(x)) * up(x)), gate and up packed in one."""

    def __init__(self, a: ModelArgs, tp: TensorParallel | None) -> None:
        super().__init__()
        world, rank = (tp.world_size, tp.rank) if tp else (1, 0)
        if a.intermediate_size % world:
            raise ValueError(
                f"intermediate_size {a.intermediate_size} does not split over {world} ranks"
            )
        part = a.intermediate_size // world
        i0, i1 = rank * part, (rank + 1) * part
        self.gate_up_proj = PackedLinear(
            a.hidden_size,
            [Part("gate_proj", i0, i1), Part("up_proj", i0, i1)],
            bias=a.mlp_bias,
            quantization=a.quantization,
        )
        self.down_proj = (
            RowParallelLinear(a.hidden_size, i0, i1, a.mlp_bias, tp)
            if tp
            else Linear(part, a.hidden_size, bias=a.mlp_bias, quantization=a.quantization)
        )


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, a: ModelArgs, split: HeadSplit, tp: TensorParallel | None) -> None:
        super().__init__()
        self.self_attn = Attention(a, split, tp)
        self.mlp = GatedMLP(a, tp)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor | None,
        residual: torch.Tensor | None,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        ops: Ops,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(h, residual) -> the next layer's: the residual stream plus this block's pending output
        (which the next norm adds in; Ops that add in place leave h None)."""
        qkv, residual = self.attention_input(h, residual, ops)
        heads = ops.attend(self.self_attn, qkv, rope, meta, kv_cache)
        return self.after_attention(heads, residual, ops)

    # The halves on either side of attention: all of a layer that depends on the number of tokens
    # only, which engine/mixed_graphs.py captures as CUDA graphs.
    def attention_input(
        self, h: torch.Tensor | None, residual: torch.Tensor | None, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed q/k/v projection of norm(residual + h), and the new residual."""
        return ops.norm_project(self.input_layernorm, self.self_attn.qkv_proj, h, residual)

    def after_attention(
        self, heads: torch.Tensor, residual: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """o_proj of the heads' outputs, then the MLP: (h, residual) for the next layer."""
        mlp = self.mlp
        h, residual = ops.project_add(self.self_attn.o_proj, heads, residual)
        return ops.feed_forward(self.post_attention_layernorm, mlp, h, residual)


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, a: ModelArgs, split: HeadSplit, tp: TensorParallel | None) -> None:
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp)
            if tp
            else Embedding(a.vocab_size, a.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(a, split, tp) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(a.head_dim, a.rope, a.max_positions)
        self.args = replace(a, num_heads=split.num_q, num_kv_heads=split.num_kv)  # this rank's

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        ops: Ops,
    ) -> torch.Tensor:
        ops = ops.for_tokens(input_ids.shape[0])
        h: torch.Tensor | None
        h, rope = self.embed(input_ids, positions)
        residual = ops.all_layers(self, h, rope, meta, kv_caches)
        if residual is not None:  # one kernel ran every layer (Batch1Ops)
            return ops.final_norm(self.norm, None, residual)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, rope, meta, kv_cache, ops)
        return ops.final_norm(self.norm, h, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """The tokens' embeddings and the rotary cos/sin every layer shares."""
        h = self.embed_tokens(input_ids)
        return h, self.rotary_emb(positions, h.dtype)


class LlamaForCausalLM(nn.Module):
    """Llama 1/2/3 (incl. rope scaling) and Mistral; `tp`: this rank's shard of it."""

    def __init__(self, args: ModelArgs, tp: TensorParallel | None = None) -> None:
        super().__init__()
        world, rank = (tp.world_size, tp.rank) if tp else (1, 0)
        split = HeadSplit.of(args.num_heads, args.num_kv_heads, rank, world)
        self.model = DecoderModel(args, split, tp)
        if tp:
            self.lm_head: Linear = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
        else:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The KV cache and its sizing read these: each rank caches only its own KV heads.
        self.args = replace(args, num_heads=split.num_q, num_kv_heads=split.num_kv)

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
        ops: Ops,
    ) -> torch.Tensor:
        """Hidden states for the packed tokens."""
        return self.model(input_ids, positions, meta, kv_caches, ops)

    def compute_logits(self, hidden: torch.Tensor, ops: Ops) -> torch.Tensor | None:
        """Vocabulary logits for the selected hidden states (None on a tensor-parallel rank > 0)."""
        return ops.logits(self.lm_head, hidden)
