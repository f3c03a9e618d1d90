"""Projections in the layout the kernels read, and where each of their rows comes from in a
checkpoint.

q/k/v and gate/up are one weight each (one matmul, one contiguous read); under tensor parallelism
every part is this rank's slice. A parameter that is not filled by its own checkpoint tensor, whole,
names its sources (`Source`) on its module; the loader (loader.py) copies each checkpoint tensor, or
the slice of it this rank needs, straight into its place: no model surgery after loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

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
    """nn.Linear on one device (`tp` is None); RowParallelLinear is the one that sums over ranks."""

    tp: TensorParallel | None = None


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

    def __init__(self, in_features: int, parts: list[Part], bias: bool) -> None:
        super().__init__(in_features, sum(p.stop - p.start for p in parts), bias=bias)
        offset = 0
        for p in parts:
            names = ("weight", "bias") if bias else ("weight",)
            for param in names:
                add_source(
                    self,
                    param,
                    Source(f"{p.name}.{param}", 0, p.start, p.stop, offset, sibling=True),
                )
            offset += p.stop - p.start
