"""Graph capture and executable graphs that keep alive every buffer and module they reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from flashstack.cuda._resource import Resource, unpin_all
from flashstack.cuda.device import Device
from flashstack.cuda.stream import Stream


class Graph(Resource):
    """A captured graph definition plus the resources its nodes reference."""

    kind = "graph"

    def __init__(self, device: Device, handle: Any, refs: list[Resource]) -> None:
        self.device, self._h, self.refs = device, handle, refs
        super().__init__(device.releaser(device.backend.graph_destroy, handle), keep=(device, refs))

    @staticmethod
    @contextlib.contextmanager
    def capture(stream: Stream) -> Iterator[GraphCapture]:
        """Capture the work queued on `stream` inside the block; `.graph` holds the result."""
        cap = GraphCapture(stream)
        backend = stream.device.backend
        if stream._capture is not None:
            raise RuntimeError("this stream is already being captured")
        with stream.device:
            backend.capture_begin(stream.handle)
        stream._capture = cap
        try:
            yield cap
        except BaseException:
            stream._capture = None
            with stream.device:  # end the capture so the stream stays usable, drop the graph
                stream.device.backend.graph_destroy(backend.capture_end(stream.handle))
            raise
        stream._capture = None
        with stream.device:
            handle = backend.capture_end(stream.handle)
        cap.graph = Graph(stream.device, handle, cap.refs)

    @staticmethod
    def build(device: Device) -> GraphBuilder:
        """Start a graph made of explicit nodes instead of a stream capture."""
        return GraphBuilder(device)

    @property
    def handle(self) -> Any:
        """The backend handle; raises if closed."""
        self._check_open()
        return self._h

    def instantiate(self) -> GraphExec:
        """Make an executable graph; it pins this graph's referenced resources, not the graph."""
        with self.device:
            exe = self.device.backend.graph_instantiate(self.handle)
        return GraphExec(self.device, exe, list(self.refs))


class GraphCapture:
    """What a capture in progress records; `graph` is set when the capture block exits."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.refs: list[Resource] = []
        self.graph: Graph | None = None

    def keep(self, *resources: Any) -> None:
        """Record resources the captured work reads or writes (done by launch and copy_async)."""
        seen = {id(r) for r in self.refs}
        for res in resources:
            if isinstance(res, Resource) and id(res) not in seen:
                res._check_open()
                self.refs.append(res)
                seen.add(id(res))


class GraphBuilder:
    """Adds kernel and copy nodes; each node runs after `after` (None: an entry node)."""

    def __init__(self, device: Device) -> None:
        self.device, self.refs = device, []
        with device:
            self._h: Any = device.backend.graph_define()
        self._recorder = GraphCapture.__new__(GraphCapture)
        self._recorder.refs = self.refs

    def launch(
        self,
        kernel: Any,
        grid: Any,
        block: Any,
        args: Sequence[Any],
        shared_mem: int = 0,
        after: Any = None,
    ) -> Any:
        """Add a kernel node; returns the node for use as a later node's `after`."""
        from flashstack.cuda.module import _arg, _dim3, _owner

        self._recorder.keep(kernel.module, *[_owner(a) for a in args])
        with self.device:
            return self.device.backend.graph_add_kernel(
                self._h,
                kernel._h,
                _dim3(grid),
                _dim3(block),
                [_arg(a) for a in args],
                shared_mem,
                after,
            )

    def copy(self, dst: Any, src: Any, nbytes: int | None = None, after: Any = None) -> Any:
        """Add a memcpy node between two buffers; returns the node."""
        nbytes = src.nbytes if nbytes is None else nbytes
        if nbytes > dst.nbytes or nbytes > src.nbytes:
            raise ValueError(
                f"copy of {nbytes} bytes exceeds src ({src.nbytes}) or dst ({dst.nbytes})"
            )
        self._recorder.keep(dst, src)
        with self.device:
            return self.device.backend.graph_add_memcpy(self._h, dst.ptr, src.ptr, nbytes, after)

    def finish(self) -> Graph:
        """The built graph (a Graph resource); the builder must not be used afterwards."""
        if self._h is None:
            raise RuntimeError("this builder already finished; start a new one with Graph.build")
        handle, self._h = self._h, None
        return Graph(self.device, handle, self.refs)


class GraphExec(Resource):
    """An executable graph: launch, update; pins its referenced resources until closed."""

    kind = "graph_exec"

    def __init__(self, device: Device, handle: Any, refs: list[Resource]) -> None:
        self.device, self._h = device, handle
        for res in refs:
            res._pin()
        self._refs = refs  # mutated in place by update(), so the release closure sees the change
        super().__init__(_exec_release(device, handle, refs), keep=(device, refs))

    @property
    def refs(self) -> list[Resource]:
        """Resources this executable graph keeps alive and open."""
        return list(self._refs)

    def launch(self, stream: Stream) -> None:
        """Replay the graph on `stream`."""
        self._check_open()
        with self.device:
            self.device.backend.graph_launch(self._h, stream.handle)

    def update(self, graph: Graph) -> None:
        """Take `graph`'s node parameters (same topology); the pins move to its resources."""
        self._check_open()
        with self.device:
            self.device.backend.graph_exec_update(self._h, graph.handle)
        new = list(graph.refs)
        for res in new:
            res._pin()
        old = list(self._refs)
        self._refs[:] = new
        unpin_all(old)


def _exec_release(device: Device, handle: Any, refs: list[Resource]) -> Any:
    def release() -> None:
        # destroy first: the referenced memory and modules must outlive the executable graph
        try:
            with device:
                device.backend.graph_exec_destroy(handle)
        finally:
            unpin_all(refs)

    return release
