"""Programmatic edges of a captured graph, opened at the source kernel's launch completion.

A kernel launched with programmatic dependent launch (PDL) is captured behind its predecessor by
a programmatic edge on the predecessor's programmatic port: it may launch once every block of the
predecessor has signalled (`griddepcontrol.launch_dependents`) or exited. A predecessor that never
signals, such as a cuBLAS product, so holds its successor back until its last block exits, and the
successor's launch and ramp-up fall on the critical path. CUDA's launch-completion port lets the
successor launch once every block of the predecessor has started instead; its own PDL wait still
holds it before anything the predecessor writes.

That is safe only where the predecessor itself started after everything before it had finished,
i.e. every edge into the predecessor is a full dependency: then the successor's work before its
wait (weights, step inputs written before the graph ran) reads nothing still being written.
`edges_to_open` keeps to exactly those edges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from flashstack.cuda.backend import Backend, get_backend


class EdgePort(IntEnum):
    """A kernel node's outgoing port (CUDA's cudaGraphKernelNodePort values)."""

    DEFAULT = 0  # the kernel has finished and its writes are visible
    PROGRAMMATIC = 1  # every block has signalled launch_dependents or exited
    LAUNCH_COMPLETION = 2  # every block has started


@dataclass(frozen=True, slots=True)
class GraphEdge:
    """One dependency of a graph: `target` runs after `source` as the edge's type and port say."""

    source: Any  # a backend node handle
    target: Any
    programmatic: bool
    port: EdgePort = EdgePort.DEFAULT


def edges_to_open(edges: Sequence[GraphEdge]) -> list[GraphEdge]:
    """The programmatic edges on a programmatic port whose source has only full dependencies into
    it (no programmatic edge in): those may open at the source's launch completion."""
    behind_programmatic = {int(e.target) for e in edges if e.programmatic}
    return [
        e
        for e in edges
        if e.programmatic
        and e.port == EdgePort.PROGRAMMATIC
        and int(e.source) not in behind_programmatic
    ]


def open_at_launch_completion(raw_graph: int, backend: Backend | None = None) -> int:
    """Move every edge `edges_to_open` picks in the captured graph `raw_graph` (a cudaGraph_t
    address, e.g. torch's `CUDAGraph.raw_cuda_graph()`, before instantiation) to the launch-
    completion port. Returns how many moved."""
    backend = backend or get_backend()
    edges = [GraphEdge(s, t, p, EdgePort(port)) for s, t, p, port in backend.graph_edges(raw_graph)]
    chosen = edges_to_open(edges)
    if chosen:
        backend.graph_move_edges(
            raw_graph,
            [(e.source, e.target, e.programmatic, int(e.port)) for e in chosen],
            int(EdgePort.LAUNCH_COMPLETION),
        )
    return len(chosen)
