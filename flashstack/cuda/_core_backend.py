"""The real backend: cuda.core objects for what it does well, cuda.bindings.driver for the rest.

cuda.core gives streams, events, stream-ordered buffers, NVRTC and kernel launch. It lacks
save/restore of the caller's context, raw-pointer async copies, stream-capture graphs over
arbitrary work and an explicit module unload, which are made here with the driver API.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from flashstack.cuda.backend import CudaUnavailableError

try:  # cuda.pathfinder raises (not returns) when libcuda is missing: both become one error
    import cuda.core as cc
    import cuda.core.graph  # noqa: F401  (GraphDefinition)
    from cuda.bindings import driver
except Exception as exc:  # pragma: no cover - depends on the machine
    cc = driver = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None


class CudaDriverError(RuntimeError):
    """A driver call returned an error code."""


def _check(result: tuple[Any, ...]) -> Any:
    err, *values = result
    if int(err) != 0:
        _, name = driver.cuGetErrorName(err)
        raise CudaDriverError(name.decode() if isinstance(name, bytes) else str(err))
    return values[0] if len(values) == 1 else (values or None)


def _cugraph(graph: Any) -> Any:
    """The driver CUgraph of a captured graph, a cuda.core GraphDefinition or a raw cudaGraph_t
    address (torch's `CUDAGraph.raw_cuda_graph()`)."""
    if isinstance(graph, int):
        return driver.CUgraph(graph)
    return graph.handle if isinstance(graph, cc.graph.GraphDefinition) else graph


def _edge_data(programmatic: bool, from_port: int) -> Any:
    data = driver.CUgraphEdgeData()
    kinds = driver.CUgraphDependencyType
    data.type = (
        kinds.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        if programmatic
        else kinds.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT
    )
    data.from_port = from_port
    return data


_KINDS = ("cubin", "ptx", "fatbin")


class _Library:
    """A loaded CUlibrary and the image it was loaded from (kept for the library's life)."""

    __slots__ = ("image", "library")

    def __init__(self, library: Any, image: bytes) -> None:
        self.library, self.image = library, image


class CoreBackend:
    """Backend over cuda.core 1.x and cuda.bindings 12/13."""

    name = "cuda.core"

    def __init__(self) -> None:
        if _IMPORT_ERROR is not None:
            raise CudaUnavailableError(f"cuda.core / cuda.bindings unusable: {_IMPORT_ERROR}")
        try:
            _check(driver.cuInit(0))
        except Exception as exc:
            raise CudaUnavailableError(f"no usable CUDA driver: {exc}") from exc
        self._tls = threading.local()
        self._primary: dict[int, Any] = {}
        self._pinned_mr = cc.LegacyPinnedMemoryResource()

    # -- device and context ------------------------------------------------------------------
    def device_count(self) -> int:
        return int(_check(driver.cuDeviceGetCount()))

    def device_properties(self, ordinal: int) -> dict[str, Any]:
        dev = cc.Device(ordinal)
        major, minor = dev.compute_capability
        return {
            "name": dev.name,
            "compute_capability": (int(major), int(minor)),
            "total_memory": int(_check(driver.cuDeviceTotalMem(ordinal))),
            "sm_count": int(dev.properties.multiprocessor_count),
            "l2_cache_size": int(dev.properties.l2_cache_size),
            "registers_per_sm": int(dev.properties.max_registers_per_multiprocessor),
            "shared_memory_per_sm": int(dev.properties.max_shared_memory_per_multiprocessor),
            "threads_per_sm": int(dev.properties.max_threads_per_multiprocessor),
            "blocks_per_sm": int(dev.properties.max_blocks_per_multiprocessor),
        }

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        free, total = _check(driver.cuMemGetInfo())
        return int(free), int(total)

    def ctx_get_current(self) -> Any:
        return _check(driver.cuCtxGetCurrent())

    def ctx_set_current(self, ctx: Any) -> None:
        _check(driver.cuCtxSetCurrent(ctx if ctx is not None else driver.CUcontext(0)))

    def ctx_activate(self, ordinal: int) -> Any:
        inited = self._tls.__dict__.setdefault("inited", set())
        if ordinal not in inited:
            # cuda.core's Device is per-thread and must be set_current once in each thread
            cc.Device(ordinal).set_current()
            inited.add(ordinal)
            self._primary[ordinal] = _check(driver.cuCtxGetCurrent())
        else:
            _check(driver.cuCtxSetCurrent(self._primary[ordinal]))
        return self._primary[ordinal]

    def device_synchronize(self, ordinal: int) -> None:
        _check(driver.cuCtxSynchronize())

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self, ordinal: int, nonblocking: bool, priority: int) -> Any:
        opts = cc.StreamOptions(nonblocking=nonblocking, priority=priority)
        return cc.Device(ordinal).create_stream(options=opts)

    def stream_wrap(self, ordinal: int, raw: int, owner: object) -> Any:
        return cc.Stream.from_handle(int(raw))

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        return bool(_check(driver.cuDeviceCanAccessPeer(ordinal, peer)))

    def enable_peer_access(self, ordinal: int, peer: int) -> None:
        # Called with `ordinal`'s primary context current; the peer's must have been activated.
        (err,) = driver.cuCtxEnablePeerAccess(self._primary[peer], 0)
        if err not in (
            driver.CUresult.CUDA_SUCCESS,
            driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
        ):
            _check((err,))
        # Context peer access covers cuMemAlloc memory only; DeviceBuffers come from the peer's
        # stream-ordered pool, which grants access per device (cuMemPoolSetAccess).
        pool = cc.Device(peer).memory_resource
        if isinstance(pool, cc.DeviceMemoryResource) and ordinal not in pool.peer_accessible_by:
            pool.peer_accessible_by.add(ordinal)

    def stream_raw(self, stream: Any) -> int:
        return int(stream.handle)

    def stream_destroy(self, stream: Any) -> None:
        stream.close()

    def stream_synchronize(self, stream: Any) -> None:
        stream.sync()

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        stream.wait(event)

    def event_create(self, ordinal: int, timing: bool, blocking: bool) -> Any:
        opts = cc.EventOptions(timing_enabled=timing, blocking_sync=blocking)
        return cc.Device(ordinal).create_event(options=opts)

    def event_destroy(self, event: Any) -> None:
        event.close()

    def event_record(self, event: Any, stream: Any) -> None:
        stream.record(event)

    def event_synchronize(self, event: Any) -> None:
        event.sync()

    def event_query(self, event: Any) -> bool:
        return bool(event.is_done)

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return float(end - start)

    # -- memory ------------------------------------------------------------------------------
    def mem_alloc(self, ordinal: int, nbytes: int, stream: Any) -> tuple[Any, int]:
        buf = cc.Device(ordinal).allocate(nbytes, stream=stream or cc.LEGACY_DEFAULT_STREAM)
        return buf, int(buf.handle)

    def mem_free(self, mem: Any, stream: Any) -> None:
        mem.close(stream or cc.LEGACY_DEFAULT_STREAM)

    def host_alloc(self, nbytes: int) -> tuple[Any, int]:
        buf = self._pinned_mr.allocate(nbytes)
        return buf, int(buf.handle)

    def host_free(self, mem: Any) -> None:
        mem.close()

    def host_buffer(self, mem: Any, ptr: int, nbytes: int) -> Any:
        raw = (ctypes.c_char * nbytes).from_address(ptr)
        raw._keep = mem  # the ctypes view must not outlive the allocation
        return raw

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        hstream = stream.handle if stream is not None else driver.CUstream(0)
        _check(driver.cuMemcpyAsync(dst, src, nbytes, hstream))

    def dlpack(self, mem: Any, stream: int | None) -> object:
        return mem.__dlpack__(stream=stream)

    # -- modules and kernels -----------------------------------------------------------------
    def compile(
        self, source: str, arch: str, options: Sequence[str], names: Sequence[str]
    ) -> bytes:
        prog = cc.Program(source, "c++", cc.ProgramOptions(arch=arch, std="c++17"))
        try:
            return bytes(prog.compile("cubin", name_expressions=tuple(names)).code)
        finally:
            prog.close()

    def module_load(self, image: bytes, kind: str) -> Any:
        # cuda.core's ObjectCode has no close(): its library goes only when the last kernel made
        # from it is collected. Loaded here, cuLibraryUnload can run when Module.close() says so.
        if kind not in _KINDS:
            raise ValueError(f"unknown module kind {kind!r}; use one of {sorted(_KINDS)}")
        if kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"  # the driver reads PTX as a NUL-terminated string
        library = _check(driver.cuLibraryLoadData(image, [], [], 0, [], [], 0))
        return _Library(library, image)

    def module_unload(self, module: Any) -> None:
        _check(driver.cuLibraryUnload(module.library))

    def kernel_get(self, module: Any, name: str) -> Any:
        kernel = _check(driver.cuLibraryGetKernel(module.library, name.encode()))
        # a kernel handle borrowed by cuda.core for launch; it does not hold the library loaded
        return cc.Kernel.from_handle(int(kernel))

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[object],
        stream: Any,
        shared_mem: int,
    ) -> None:
        cfg = cc.LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
        # a bare Python int is a pointer here; pass numpy scalars for int/float parameters
        conv = [np.uint64(a) if type(a) is int else a for a in args]
        cc.launch(stream or cc.LEGACY_DEFAULT_STREAM, cfg, kernel, *conv)

    # -- graphs ------------------------------------------------------------------------------
    def capture_begin(self, stream: Any) -> None:
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(driver.cuStreamBeginCapture(stream.handle, mode))

    def capture_end(self, stream: Any) -> Any:
        return _check(driver.cuStreamEndCapture(stream.handle))

    def graph_define(self) -> Any:
        return cc.graph.GraphDefinition()

    def graph_add_kernel(
        self,
        graph: Any,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[object],
        shared_mem: int,
        after: Any,
    ) -> Any:
        cfg = cc.LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
        conv = [np.uint64(a) if type(a) is int else a for a in args]
        return (after if after is not None else graph).launch(cfg, kernel, *conv)

    def graph_add_memcpy(self, graph: Any, dst: int, src: int, nbytes: int, after: Any) -> Any:
        return (after if after is not None else graph).memcpy(dst, src, nbytes)

    def graph_destroy(self, graph: Any) -> None:
        if isinstance(graph, cc.graph.GraphDefinition):
            return  # cuda.core owns a built graph's CUgraph and destroys it with the object
        _check(driver.cuGraphDestroy(graph))

    def graph_instantiate(self, graph: Any) -> Any:
        return _check(driver.cuGraphInstantiate(_cugraph(graph), 0))

    def graph_exec_update(self, exe: Any, graph: Any) -> None:
        _check(driver.cuGraphExecUpdate(exe, _cugraph(graph)))

    def graph_exec_destroy(self, exe: Any) -> None:
        _check(driver.cuGraphExecDestroy(exe))

    def graph_launch(self, exe: Any, stream: Any) -> None:
        _check(driver.cuGraphLaunch(exe, stream.handle))

    def graph_edges(self, graph: Any) -> list[tuple[Any, Any, bool, int]]:
        g = _cugraph(graph)
        *_, count = _check(driver.cuGraphGetEdges(g, 0))
        if not count:
            return []
        sources, targets, data, count = _check(driver.cuGraphGetEdges(g, count))
        programmatic = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        return [
            (s, t, d.type == programmatic, int(d.from_port))
            for s, t, d in zip(sources[:count], targets[:count], data[:count], strict=True)
        ]

    def graph_move_edges(
        self, graph: Any, edges: Sequence[tuple[Any, Any, bool, int]], port: int
    ) -> None:
        g = _cugraph(graph)
        sources, targets = [e[0] for e in edges], [e[1] for e in edges]
        old = [_edge_data(programmatic, from_port) for _, _, programmatic, from_port in edges]
        new = [_edge_data(programmatic, port) for _, _, programmatic, _ in edges]
        _check(driver.cuGraphRemoveDependencies(g, sources, targets, old, len(edges)))
        _check(driver.cuGraphAddDependencies(g, sources, targets, new, len(edges)))
