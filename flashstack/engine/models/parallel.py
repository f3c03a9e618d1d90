"""Tensor-parallel layers: which part of each weight a rank holds, and the layers that communicate.

Megatron split: q/k/v and gate/up are column-parallel (each rank keeps some heads / some of the
intermediate width, no communication: linear.PackedLinear), o_proj and down_proj are row-parallel
(partial sums, one all-reduce each), the embedding and lm_head are split by vocabulary. Every
sharded parameter names the checkpoint rows or columns this rank reads (linear.Source; loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from flashstack.engine.models.layers import Embedding
from flashstack.engine.models.linear import Linear, Source, add_source

if TYPE_CHECKING:
    from flashstack.engine.tp.group import TensorParallel


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


class RowParallelLinear(Linear):
    """y = sum over ranks of x[:, cols] @ W[:, cols].T, plus the bias once after the all-reduce."""

    def __init__(
        self, out_features: int, start: int, stop: int, bias: bool, tp: TensorParallel
    ) -> None:
        super().__init__(stop - start, out_features, bias=bias)
        add_source(self, "weight", Source("weight", 1, start, stop))
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.linear_all_reduce(x, self.weight)
        return y + self.bias if self.bias is not None else y


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, padded part size): equal parts so logits gather without ragged tensors."""
    part = -(-vocab_size // world)
    start = min(rank * part, vocab_size)
    return start, min(start + part, vocab_size), part


class VocabParallelEmbedding(Embedding):
    """Each rank embeds the ids in its vocabulary range, zeros elsewhere; an all-reduce sums
    them."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        self.start, self.stop, part = vocab_range(vocab_size, tp.rank, tp.world_size)
        super().__init__(part, hidden)
        add_source(self, "weight", Source("weight", 0, self.start, self.stop, pads=True))
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


class ParallelLMHead(Linear):
    """Logits for this rank's vocabulary part, gathered on rank 0 (None on the other ranks)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        start, stop, part = vocab_range(vocab_size, tp.rank, tp.world_size)
        super().__init__(hidden, part, bias=False)
        add_source(self, "weight", Source("weight", 0, start, stop, pads=True))
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.gathered(x, gemv=False)

    def gathered(self, x: torch.Tensor, gemv: bool) -> torch.Tensor | None:
        """Every rank's logits side by side on rank 0, None elsewhere; `gemv`: one-row products
        through the Triton batch-1 GEMV."""
        logits = self.tp.linear_gather_to_driver(x, self.weight, gemv=gemv)
        return logits[:, : self.vocab_size] if logits is not None else None
