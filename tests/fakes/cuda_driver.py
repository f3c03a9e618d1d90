"""A CPU stand-in for the CUDA driver that records every call and catches lifetime bugs.

It keeps a per-thread current context, gives out handles, and records (instead of crashing on)
double frees, use-after-destroy and releases made under the wrong context, so tests can assert
the ordering and threading of flashstack.cuda's lifetime logic without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_BASE = 0x7F00_0000_0000


class FakeDriverError(RuntimeError):
    """What the fake driver raises where the real one would return an error code."""


@dataclass(eq=False)
class FakeHandle:
    """One driver object; `ctx` is the context it belongs to (None for context-free objects)."""

    kind: str
    serial: int
    ctx: str | None
    data: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"{self.kind}#{self.serial}"


class FakeBackend:
    """Records handles, the per-thread context, double frees and use-after-destroy."""

    name = "fake"

    def __init__(self, devices: int = 1, cc: tuple[int, int] = (9, 0)) -> None:
        self.devices, self.cc = devices, cc
        self.log: list[tuple[str, str, str]] = []
        self.violations: list[str] = []
        self.fail_next: set[str] = set()
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._serial = 0
        self._next_addr = _BASE
        self._live: set[FakeHandle] = set()
        self._dead: set[FakeHandle] = set()
        self._allocs: dict[int, FakeHandle] = {}
        # name -> python function(backend, *args) run when a kernel of that name launches
        self.kernels: dict[str, Any] = {}
        self.peers: set[tuple[int, int]] = set()  # (device, peer) pairs with access enabled
        self.work_pending = False  # True: recorded events report their work as not yet done

    # -- bookkeeping -------------------------------------------------------------------------
    def _call(self, op: str, what: object = "") -> None:
        with self._lock:
            self.log.append((op, str(what), threading.current_thread().name))
        if op in self.fail_next:
            self.fail_next.discard(op)
            raise FakeDriverError(f"{op}: injected failure")

    def _new(self, kind: str, ctx: str | None, **data: Any) -> FakeHandle:
        with self._lock:
            self._serial += 1
            h = FakeHandle(kind, self._serial, ctx, data)
            self._live.add(h)
        return h

    def _use(self, h: FakeHandle, op: str) -> None:
        if h in self._dead or h not in self._live:
            self.violations.append(f"use-after-destroy: {op} on {h}")
            raise FakeDriverError(f"{op}: CUDA_ERROR_INVALID_HANDLE ({h} was destroyed)")

    def _destroy(self, h: FakeHandle, op: str) -> None:
        self._call(op, h)
        with self._lock:
            if h in self._dead:
                self.violations.append(f"double-free: {op} on {h}")
                raise FakeDriverError(f"{op}: CUDA_ERROR_INVALID_HANDLE ({h} freed twice)")
            if h.ctx is not None and self.ctx_get_current() != h.ctx:
                self.violations.append(
                    f"wrong-context: {op} on {h} with {self.ctx_get_current()} current"
                )
            self._live.discard(h)
            self._dead.add(h)

    def ops(self, prefix: str = "") -> list[str]:
        """The recorded operation names (optionally only those starting with `prefix`)."""
        return [op for op, _, _ in self.log if op.startswith(prefix)]

    def live_handles(self, kind: str | None = None) -> list[FakeHandle]:
        """Handles created and not yet destroyed."""
        return [h for h in self._live if kind is None or h.kind == kind]

    # -- device and context ------------------------------------------------------------------
    def device_count(self) -> int:
        return self.devices

    def device_properties(self, ordinal: int) -> dict[str, Any]:
        self._call("device_properties", ordinal)
        return {
            "name": f"Fake GPU {ordinal}",
            "compute_capability": self.cc,
            "total_memory": 80 << 30,
            "sm_count": 132,
            "l2_cache_size": 50 << 20,
            "registers_per_sm": 65536,
            "shared_memory_per_sm": 228 << 10,
            "threads_per_sm": 2048,
            "blocks_per_sm": 32,
        }

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        used = sum(h.data["nbytes"] for h in self._live if h.kind == "devmem")
        return (80 << 30) - used, 80 << 30

    def ctx_get_current(self) -> str | None:
        return getattr(self._tls, "ctx", None)

    def ctx_set_current(self, ctx: str | None) -> None:
        self._call("ctx_set_current", ctx)
        self._tls.ctx = ctx

    def ctx_activate(self, ordinal: int) -> str:
        ctx = f"ctx{ordinal}"
        self._tls.ctx = ctx
        return ctx

    def device_synchronize(self, ordinal: int) -> None:
        self._call("device_synchronize", ordinal)

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        return ordinal != peer and max(ordinal, peer) < self.devices

    def enable_peer_access(self, ordinal: int, peer: int) -> None:
        self._call("enable_peer_access", (ordinal, peer))
        if self._require_ctx("enable_peer_access") != f"ctx{ordinal}":
            self.violations.append(f"wrong-context: enable_peer_access {ordinal}->{peer}")
        self.peers.add((ordinal, peer))

    def _require_ctx(self, op: str) -> str:
        ctx = self.ctx_get_current()
        if ctx is None:
            self.violations.append(f"no-context: {op}")
            raise FakeDriverError(f"{op}: CUDA_ERROR_INVALID_CONTEXT")
        return ctx

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self, ordinal: int, nonblocking: bool, priority: int) -> FakeHandle:
        self._call("stream_create")
        return self._new(
            "stream", self._require_ctx("stream_create"), capture=None, priority=priority
        )

    def stream_wrap(self, ordinal: int, raw: int, owner: object) -> FakeHandle:
        return self._new("stream", None, capture=None, raw=raw, owner=owner)

    def stream_raw(self, stream: FakeHandle) -> int:
        return stream.data.get("raw", stream.serial)

    def stream_destroy(self, stream: FakeHandle) -> None:
        self._destroy(stream, "stream_destroy")

    def stream_synchronize(self, stream: FakeHandle) -> None:
        self._call("stream_synchronize", stream)
        self._use(stream, "stream_synchronize")

    def stream_wait_event(self, stream: FakeHandle, event: FakeHandle) -> None:
        self._call("stream_wait_event", stream)
        self._use(stream, "stream_wait_event")
        self._use(event, "stream_wait_event")

    def event_create(self, ordinal: int, timing: bool, blocking: bool) -> FakeHandle:
        self._call("event_create")
        return self._new("event", self._require_ctx("event_create"), t=None, timing=timing)

    def event_destroy(self, event: FakeHandle) -> None:
        self._destroy(event, "event_destroy")

    def event_record(self, event: FakeHandle, stream: FakeHandle) -> None:
        self._call("event_record", event)
        self._use(event, "event_record")
        self._use(stream, "event_record")
        with self._lock:
            self._serial += 1
            event.data["t"] = float(self._serial)

    def event_synchronize(self, event: FakeHandle) -> None:
        self._call("event_synchronize", event)
        self._use(event, "event_synchronize")

    def event_query(self, event: FakeHandle) -> bool:
        self._use(event, "event_query")
        return not (self.work_pending and event.data["t"] is not None)

    def event_elapsed_ms(self, start: FakeHandle, end: FakeHandle) -> float:
        self._use(start, "event_elapsed")
        self._use(end, "event_elapsed")
        if not (start.data["timing"] and end.data["timing"]):
            raise FakeDriverError("event_elapsed: CUDA_ERROR_INVALID_HANDLE (timing disabled)")
        if start.data["t"] is None or end.data["t"] is None:
            raise FakeDriverError("event_elapsed: CUDA_ERROR_NOT_READY (event not recorded)")
        return end.data["t"] - start.data["t"]

    # -- memory ------------------------------------------------------------------------------
    def _alloc(self, kind: str, ctx: str | None, nbytes: int) -> tuple[FakeHandle, int]:
        with self._lock:
            addr = self._next_addr
            self._next_addr += (nbytes + 0xFFF) & ~0xFFF or 0x1000
        h = self._new(kind, ctx, nbytes=nbytes, addr=addr, bytes=bytearray(nbytes))
        self._allocs[addr] = h
        return h, addr

    def mem_alloc(self, ordinal: int, nbytes: int, stream: FakeHandle) -> tuple[FakeHandle, int]:
        self._call("mem_alloc", nbytes)
        if stream is not None:
            self._use(stream, "mem_alloc")
        return self._alloc("devmem", self._require_ctx("mem_alloc"), nbytes)

    def mem_free(self, mem: FakeHandle, stream: FakeHandle) -> None:
        if stream is not None:
            self._use(stream, "mem_free")
        self._destroy(mem, "mem_free")

    def host_alloc(self, nbytes: int) -> tuple[FakeHandle, int]:
        self._call("host_alloc", nbytes)
        return self._alloc("hostmem", self._require_ctx("host_alloc"), nbytes)

    def host_free(self, mem: FakeHandle) -> None:
        self._destroy(mem, "host_free")

    def _locate(self, addr: int, nbytes: int, op: str) -> tuple[bytearray, int]:
        for base, h in self._allocs.items():
            if base <= addr and addr + nbytes <= base + h.data["nbytes"]:
                self._use(h, op)
                return h.data["bytes"], addr - base
        self.violations.append(f"bad-address: {op} at {addr:#x}")
        raise FakeDriverError(f"{op}: CUDA_ERROR_INVALID_VALUE (address {addr:#x})")

    def host_buffer(self, mem: FakeHandle, ptr: int, nbytes: int) -> memoryview:
        self._use(mem, "host_buffer")
        return memoryview(mem.data["bytes"])[:nbytes]

    def host_view(self, addr: int, nbytes: int) -> memoryview:
        """The bytes behind a fake address, so host-side code can read and write them."""
        data, off = self._locate(addr, nbytes, "host_view")
        return memoryview(data)[off : off + nbytes]

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: FakeHandle) -> None:
        self._call("memcpy_async", nbytes)
        if stream is not None:
            self._use(stream, "memcpy_async")
        op = ("memcpy", dst, src, nbytes)
        if stream is not None and stream.data["capture"] is not None:
            stream.data["capture"].append(op)
        else:
            self._run(op)

    def _run(self, op: tuple[Any, ...]) -> None:
        if op[0] == "memcpy":
            _, dst, src, n = op
            d, doff = self._locate(dst, n, "memcpy")
            s, soff = self._locate(src, n, "memcpy")
            d[doff : doff + n] = s[soff : soff + n]
        else:
            _, kernel, args = op
            kernel.data["fn"](self, *args)

    def dlpack(self, mem: FakeHandle, stream: int | None) -> object:
        self._use(mem, "dlpack")
        return np.frombuffer(mem.data["bytes"], dtype=np.uint8).__dlpack__()

    # -- modules and kernels -----------------------------------------------------------------
    def compile(
        self, source: str, arch: str, options: Sequence[str], names: Sequence[str]
    ) -> bytes:
        self._call("compile", arch)
        if "#error" in source:
            raise FakeDriverError("compile: NVRTC_ERROR_COMPILATION (#error)")
        return b"FAKECUBIN:" + arch.encode() + b":" + source.encode()

    def module_load(self, image: bytes, kind: str) -> FakeHandle:
        self._call("module_load", kind)
        return self._new("module", self._require_ctx("module_load"), image=image)

    def module_unload(self, module: FakeHandle) -> None:
        self._destroy(module, "module_unload")

    def kernel_get(self, module: FakeHandle, name: str) -> FakeHandle:
        self._use(module, "kernel_get")
        if name.encode() not in module.data["image"]:
            raise FakeDriverError(f"kernel_get: CUDA_ERROR_NOT_FOUND ({name})")
        fn = self.kernels.get(name, lambda *_: None)
        return FakeHandle("kernel", 0, None, {"module": module, "fn": fn, "name": name})

    def launch(
        self,
        kernel: FakeHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[object],
        stream: FakeHandle,
        shared_mem: int,
    ) -> None:
        self._call("launch", kernel.data["name"])
        self._use(kernel.data["module"], "launch")
        if stream is not None:
            self._use(stream, "launch")
        for a in args:
            if isinstance(a, int) and a >= _BASE:
                self._locate(a, 1, "launch")
        op = ("kernel", kernel, tuple(args))
        if stream is not None and stream.data["capture"] is not None:
            stream.data["capture"].append(op)
        else:
            self._run(op)

    # -- graphs ------------------------------------------------------------------------------
    def capture_begin(self, stream: FakeHandle) -> None:
        self._call("capture_begin", stream)
        self._use(stream, "capture_begin")
        if stream.data["capture"] is not None:
            raise FakeDriverError("capture_begin: CUDA_ERROR_ILLEGAL_STATE (already capturing)")
        stream.data["capture"] = []

    def capture_end(self, stream: FakeHandle) -> FakeHandle:
        self._call("capture_end", stream)
        self._use(stream, "capture_end")
        ops, stream.data["capture"] = stream.data["capture"], None
        return self._new("graph", None, ops=ops)

    def graph_define(self) -> FakeHandle:
        self._call("graph_define")
        return self._new("graph", None, ops=[])

    def graph_add_kernel(
        self,
        graph: FakeHandle,
        kernel: FakeHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[object],
        shared_mem: int,
        after: Any,
    ) -> int:
        self._call("graph_add_kernel", kernel.data["name"])
        self._use(graph, "graph_add_kernel")
        graph.data["ops"].append(("kernel", kernel, tuple(args)))
        return len(graph.data["ops"]) - 1  # ops replay in insertion order, which respects `after`

    def graph_add_memcpy(
        self, graph: FakeHandle, dst: int, src: int, nbytes: int, after: Any
    ) -> int:
        self._call("graph_add_memcpy", nbytes)
        self._use(graph, "graph_add_memcpy")
        graph.data["ops"].append(("memcpy", dst, src, nbytes))
        return len(graph.data["ops"]) - 1

    def graph_destroy(self, graph: FakeHandle) -> None:
        self._destroy(graph, "graph_destroy")

    def graph_instantiate(self, graph: FakeHandle) -> FakeHandle:
        self._call("graph_instantiate", graph)
        self._use(graph, "graph_instantiate")
        return self._new("graph_exec", None, ops=list(graph.data["ops"]))

    def graph_exec_update(self, exe: FakeHandle, graph: FakeHandle) -> None:
        self._call("graph_exec_update", exe)
        self._use(exe, "graph_exec_update")
        self._use(graph, "graph_exec_update")
        if [o[0] for o in exe.data["ops"]] != [o[0] for o in graph.data["ops"]]:
            raise FakeDriverError("graph_exec_update: CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE")
        exe.data["ops"] = list(graph.data["ops"])

    def graph_exec_destroy(self, exe: FakeHandle) -> None:
        self._destroy(exe, "graph_exec_destroy")

    def graph_launch(self, exe: FakeHandle, stream: FakeHandle) -> None:
        self._call("graph_launch", exe)
        self._use(exe, "graph_launch")
        self._use(stream, "graph_launch")
        for op in exe.data["ops"]:
            self._run(op)
