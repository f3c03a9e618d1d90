"""Projections in the layout the kernels read, and where each of their rows comes from in a
checkpoint.

q/k/v and gate/up are one weight each (one matmul, one contiguous read); under tensor parallelism
every part is this rank's slice. A parameter that is not filled by its own checkpoint tensor, whole,
names its sources (`Source`) on its module; the loader (loader.py) copies each checkpoint tensor, or
the slice of it this rank needs, straight into its place: no model surgery after loading.

A quantized projection (`quantization`, engine/quantization.py) stores its weight as
float8_e4m3fn beside one float32 scale per output row ("fp8"), as int8 beside one float16 scale
per 32 weights of a row ("q8_0"), or as packed 4-bit values beside the words of their scales
("q4_k"), in `weight_scale`, which a packed projection's parts fill row by row as they fill the
weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from flashstack.engine.quantization import (
    FP8,
    Q4K_BLOCK,
    Q8_BLOCK,
    dequantized_linear,
)

if TYPE_CHECKING:
    from flashstack.engine.tp.group import TensorParallel


@dataclass(frozen=True, slots=True)
class Source:
    """Rows (or columns) [start, stop) along `dim` of checkpoint tensor `<module>.<name>` land at
    `offset` along `dim` of the parameter. `pads`: the parameter is longer than the slice (the last
    vocabulary part) and its tail is zeroed. `sibling`: the checkpoint tensor belongs to a sibling
    module (a packed projection's part: `q_proj.weight` beside `qkv_proj`)."""

    name: str  # the checkpoint tensor, relative to the module (or to its parent, for a sibling)
    dim: int
    start: int
    stop: int
    offset: int = 0
    pads: bool = False
    sibling: bool = False


def add_source(module: nn.Module, param: str, source: Source) -> None:
    """Record that `source` fills part of `module.<param>`."""
    # On the module, not the parameter: moving off the meta device replaces parameter objects.
    module.__dict__.setdefault("checkpoint_sources", {}).setdefault(param, []).append(source)


def checkpoint_sources(model: nn.Module) -> dict[str, list[tuple[str, Source]]]:
    """Checkpoint tensor name -> [(parameter name, source)] for every parameter that names its
    sources; any other parameter is its own checkpoint tensor, whole."""
    found: dict[str, list[tuple[str, Source]]] = {}
    for prefix, module in model.named_modules():
        for param, sources in module.__dict__.get("checkpoint_sources", {}).items():
            for s in sources:
                owner = prefix.rsplit(".", 1)[0] if s.sibling else prefix
                found.setdefault(f"{owner}.{s.name}", []).append((f"{prefix}.{param}", s))
    return found


class Linear(nn.Linear):
    """nn.Linear on one device (`tp` is None); RowParallelLinear is the one that sums over ranks.

    `quantization` "fp8": the weight is float8_e4m3fn and `weight_scale` [out_features] float32
    holds each row's scale; "q8_0": the weight is int8 and `weight_scale` [out_features,
    in_features / 32] float16 holds each block's; "q4_k": the weight is uint8 [out_features,
    in_features / 2] (two 4-bit values a byte) and `weight_scale` [out_features, in_features / 64
    + in_features / 256] int32 the words of their scales and mins, or, where in_features is not
    whole 256-weight super-blocks, the projection takes q8_0 (`quantization` says which it holds);
    None: no `weight_scale`. The kernels read both (models/ops.py), `forward` dequantizes."""

    tp: TensorParallel | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        quantization: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if quantization == "q4_k" and in_features % Q4K_BLOCK:
            quantization = "q8_0"  # as llama.cpp's quantizer does for rows of partial super-blocks
        self.quantization = quantization
        if quantization is None:
            self.register_parameter("weight_scale", None)
            return
        device = self.weight.device
        shape = (out_features, in_features)
        if quantization == "fp8":
            dtype, scale_shape, scale_dtype = FP8, (out_features,), torch.float32
        elif quantization == "q4_k":
            dtype, scale_dtype = torch.uint8, torch.int32
            shape = (out_features, in_features // 2)
            scale_shape = (out_features, in_features // 64 + in_features // Q4K_BLOCK)
        elif quantization == "q8_0":
            if in_features % Q8_BLOCK:
                raise ValueError(
                    f"q8_0 needs projections of a multiple of {Q8_BLOCK} inputs, not "
                    f"{in_features}: load this model with quantization=None or 'fp8'"
                )
            dtype, scale_dtype = torch.int8, torch.float16
            scale_shape = (out_features, in_features // Q8_BLOCK)
        else:
            raise ValueError(
                f"unknown quantization {quantization!r}: 'fp8', 'q8_0', 'q4_k' or None"
            )
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=dtype, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(scale_shape, dtype=scale_dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return nn.functional.linear(x, self.weight, self.bias)
        return dequantized_linear(x, self.weight, self.weight_scale, self.bias)


def to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype), except that quantized weights and their scales keep their dtypes."""
    for module in model.modules():
        stored = (
            ("weight", "weight_scale")
            if isinstance(module, Linear) and module.weight_scale is not None
            else ()
        )
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if t.is_floating_point() and name not in stored:
                t.data = t.data.to(dtype)
    return model


@dataclass(frozen=True, slots=True)
class Part:
    """One checkpoint projection inside a packed one: its name and the rows of it this rank
    keeps."""

    name: str  # "q_proj"
    start: int
    stop: int


class PackedLinear(Linear):
    """Several checkpoint projections side by side in one weight (q/k/v, gate/up), each cut to the
    rows this rank keeps (column parallelism: no communication)."""

    def __init__(
        self, in_features: int, parts: list[Part], bias: bool, quantization: str | None = None
    ) -> None:
        out_features = sum(p.stop - p.start for p in parts)
        super().__init__(in_features, out_features, bias=bias, quantization=quantization)
        offset = 0
        for p in parts:
            names = ("weight", "bias") if bias else ("weight",)
            names += ("weight_scale",) if quantization else ()
            for param in names:
                add_source(
                    self,
                    param,
                    Source(f"{p.name}.{param}", 0, p.start, p.stop, offset, sibling=True),
                )
            offset += p.stop - p.start
