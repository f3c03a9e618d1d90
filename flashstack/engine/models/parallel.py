"""Tensor-parallel layers and the swap that turns a built decoder into this rank's shard.

Megatron split: q/k/v and gate/up are column-parallel (each rank keeps some heads / some of the
intermediate width, no communication), o_proj and down_proj are row-parallel (partial sums, one
all-reduce each), the embedding and lm_head are split by vocabulary. Every sharded parameter carries
an entry in its module's `tp_slices`: the checkpoint rows or columns this rank reads (loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from flashstack.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM, ModelArgs

if TYPE_CHECKING:
    from flashstack.engine.tp.group import TensorParallel


def mark_slice(module: nn.Module, name: str, dim: int, start: int, stop: int) -> None:
    """Record which part of the checkpoint tensor this rank loads into `module.<name>`."""
    # On the module, not the parameter: moving off the meta device replaces parameter objects.
    slices = module.__dict__.setdefault("tp_slices", {})
    slices[name] = (dim, start, stop)


def checkpoint_slices(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> (dim, start, stop) for every sharded parameter of `model`."""
    return {
        f"{prefix}.{name}": where
        for prefix, module in model.named_modules()
        for name, where in module.__dict__.get("tp_slices", {}).items()
    }


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Which query and KV heads one rank owns under grouped-query attention."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadSplit:
        """Split q heads evenly; split KV heads too, or replicate each over world/kv ranks."""
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not split over {world} ranks")
        num_q = num_heads // world
        if num_kv_heads >= world:
            if num_kv_heads % world:
                raise ValueError(f"{num_kv_heads} KV heads do not split over {world} ranks")
            num_kv = num_kv_heads // world
            return cls(rank * num_q, num_q, rank * num_kv, num_kv)
        if world % num_kv_heads:
            raise ValueError(f"{world} ranks do not share {num_kv_heads} KV heads evenly")
        # Fewer KV heads than ranks: this rank's query heads all sit in one group; keep its KV head.
        group = num_heads // num_kv_heads
        return cls(rank * num_q, num_q, rank * num_q // group, 1)


class ColumnParallelLinear(nn.Linear):
    """y[:, rows] = x @ W[rows].T: this rank's slice of the output features; no communication."""

    def __init__(self, in_features: int, start: int, stop: int, bias: bool) -> None:
        super().__init__(in_features, stop - start, bias=bias)
        mark_slice(self, "weight", 0, start, stop)
        if bias:
            mark_slice(self, "bias", 0, start, stop)


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x[:, cols] @ W[:, cols].T, plus the bias once after the all-reduce."""

    def __init__(self, out_features: int, start: int, stop: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(stop - start, out_features, bias=bias)
        mark_slice(self, "weight", 1, start, stop)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.linear_all_reduce(x, self.weight)
        return y + self.bias if self.bias is not None else y


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, padded part size): equal parts so logits gather without ragged tensors."""
    part = -(-vocab_size // world)
    start = min(rank * part, vocab_size)
    return start, min(start + part, vocab_size), part


class VocabParallelEmbedding(nn.Embedding):
    """Each rank embeds the ids in its vocabulary range, zeros elsewhere; an all-reduce sums them."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        self.start, self.stop, part = vocab_range(vocab_size, tp.rank, tp.world_size)
        super().__init__(part, hidden)
        mark_slice(self, "weight", 0, self.start, self.stop)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape = (ids.numel(), self.embedding_dim)
        fast = self.tp.fast
        if ids.is_cuda and fast is not None and fast.fits_shape(shape, self.weight.dtype):
            # One kernel writes this rank's rows straight into the all-reduce's buffer.
            from flashstack.engine.kernels.triton_embedding import shard_embedding_triton

            staged = fast.stage(shape)
            shard_embedding_triton(ids, self.weight, self.start, self.stop, out=staged)
            return fast.reduce(staged)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        x = nn.functional.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Linear):
    """Logits for this rank's vocabulary part, gathered on rank 0 (None on the other ranks)."""

    one_row_gemv = False  # set by the fused path (models/fused.py): one-row logits through the Triton GEMV

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        start, stop, part = vocab_range(vocab_size, tp.rank, tp.world_size)
        super().__init__(hidden, part, bias=False)
        mark_slice(self, "weight", 0, start, stop)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self.tp.linear_gather_to_driver(x, self.weight, gemv=self.one_row_gemv)
        return logits[:, : self.vocab_size] if logits is not None else None


def _shard_attention(attn: Attention, a: ModelArgs, split: HeadSplit, tp: TensorParallel) -> None:
    d, h = a.head_dim, a.hidden_size
    q0, k0 = split.q_start * d, split.kv_start * d
    attn.q_proj = ColumnParallelLinear(h, q0, q0 + split.num_q * d, a.qkv_bias)
    attn.k_proj = ColumnParallelLinear(h, k0, k0 + split.num_kv * d, a.qkv_bias)
    attn.v_proj = ColumnParallelLinear(h, k0, k0 + split.num_kv * d, a.qkv_bias)
    attn.o_proj = RowParallelLinear(h, q0, q0 + split.num_q * d, a.o_bias, tp)
    attn.num_heads, attn.num_kv_heads = split.num_q, split.num_kv


def _shard_mlp(layer: DecoderLayer, a: ModelArgs, tp: TensorParallel) -> None:
    if a.intermediate_size % tp.world_size:
        raise ValueError(
            f"intermediate_size {a.intermediate_size} does not split over {tp.world_size} ranks"
        )
    part = a.intermediate_size // tp.world_size
    i0, i1 = tp.rank * part, (tp.rank + 1) * part
    mlp = layer.mlp
    mlp.gate_proj = ColumnParallelLinear(a.hidden_size, i0, i1, a.mlp_bias)
    mlp.up_proj = ColumnParallelLinear(a.hidden_size, i0, i1, a.mlp_bias)
    mlp.down_proj = RowParallelLinear(a.hidden_size, i0, i1, a.mlp_bias, tp)


def shard_model(model: LlamaForCausalLM, tp: TensorParallel) -> LlamaForCausalLM:
    """Swap in this rank's parallel layers (call on the meta device, before weights exist)."""
    a = model.args
    split = HeadSplit.of(a.num_heads, a.num_kv_heads, tp.rank, tp.world_size)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, a, split, tp)
        _shard_mlp(layer, a, tp)
    model.model.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp)
    model.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, tp)
    # The KV cache and its sizing read these: each rank caches only its own KV heads.
    model.args = replace(a, num_heads=split.num_q, num_kv_heads=split.num_kv)
    return model
