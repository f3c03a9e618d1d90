"""Which captured edges may open at their source's launch completion (cuda/graph_edges.py)."""

from __future__ import annotations

from flashstack.cuda.graph_edges import (
    EdgePort,
    GraphEdge,
    edges_to_open,
    open_at_launch_completion,
)


def _chain() -> list[GraphEdge]:
    # copy(1) -> cuBLAS(2) =p=> norm(3) =p=> gemv(4) -> cuBLAS(5) =p=> silu(6); the kernel(7)
    # after the copy launched with PDL; a programmatic edge already on the launch-completion port
    # from 5 to 8
    return [
        GraphEdge(1, 2, False),
        GraphEdge(2, 3, True, EdgePort.PROGRAMMATIC),
        GraphEdge(3, 4, True, EdgePort.PROGRAMMATIC),
        GraphEdge(4, 5, False),
        GraphEdge(5, 6, True, EdgePort.PROGRAMMATIC),
        GraphEdge(1, 7, True, EdgePort.PROGRAMMATIC),
        GraphEdge(5, 8, True, EdgePort.LAUNCH_COMPLETION),
    ]


def test_only_edges_out_of_kernels_with_full_dependencies_open() -> None:
    chosen = edges_to_open(_chain())
    # 3 -> 4 stays: 3 itself may start before 2 has finished, so 4's early work could race 2
    assert [(e.source, e.target) for e in chosen] == [(2, 3), (5, 6), (1, 7)]


def test_a_source_behind_any_programmatic_edge_keeps_its_edges() -> None:
    edges = [
        GraphEdge(1, 3, False),
        GraphEdge(2, 3, True, EdgePort.PROGRAMMATIC),
        GraphEdge(3, 4, True, EdgePort.PROGRAMMATIC),
    ]
    assert [(e.source, e.target) for e in edges_to_open(edges)] == [(2, 3)]


class _Recorder:
    """The two backend calls open_at_launch_completion makes."""

    def __init__(self, edges: list[GraphEdge]) -> None:
        self.edges = [(e.source, e.target, e.programmatic, int(e.port)) for e in edges]
        self.moved: list[tuple] = []

    def graph_edges(self, graph: int) -> list[tuple[int, int, bool, int]]:
        assert graph == 0xABC
        return list(self.edges)

    def graph_move_edges(self, graph: int, edges: list[tuple], port: int) -> None:
        self.moved.append((graph, list(edges), port))


def test_the_chosen_edges_move_to_the_launch_completion_port_in_one_call() -> None:
    backend = _Recorder(_chain())
    assert open_at_launch_completion(0xABC, backend) == 3
    assert backend.moved == [
        (
            0xABC,
            [(2, 3, True, 1), (5, 6, True, 1), (1, 7, True, 1)],
            int(EdgePort.LAUNCH_COMPLETION),
        )
    ]
    nothing = _Recorder([GraphEdge(1, 2, False)])
    assert open_at_launch_completion(0xABC, nothing) == 0 and nothing.moved == []
