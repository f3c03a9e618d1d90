"""Device and pinned host memory, a pinned pool, async copies, CUDA array interface and DLPack."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashstack.cuda._resource import Resource, ResourceClosedError
from flashstack.cuda.device import Device
from flashstack.cuda.stream import Event, Stream

_KDL_CUDA, _KDL_CUDA_HOST = 2, 3


class ArrayView:
    """A typed, shaped view of a buffer for `__cuda_array_interface__` consumers (torch, cupy)."""

    def __init__(self, buffer: DeviceBuffer, dtype: Any, shape: tuple[int, ...]) -> None:
        self.buffer, self.dtype, self.shape = buffer, np.dtype(dtype), shape
        if int(np.prod(shape)) * self.dtype.itemsize > buffer.nbytes:
            raise ValueError(
                f"shape {shape} of {self.dtype} exceeds the {buffer.nbytes}-byte buffer"
            )

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.buffer.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class DeviceBuffer(Resource):
    """Device memory, freed stream-ordered on the stream it was allocated on."""

    kind = "device_buffer"

    def __init__(
        self, nbytes: int, device: Device | None = None, stream: Stream | None = None
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.device, self.stream, self.nbytes = device or Device(0), stream, nbytes
        backend = self.device.backend
        with self.device:
            self._h, self._ptr = backend.mem_alloc(
                self.device.ordinal, nbytes, _raw_or_none(stream)
            )
        super().__init__(
            self.device.releaser(_free_on, backend, self._h, stream), keep=(self.device, stream)
        )

    @classmethod
    def wrap(cls, ptr: int, nbytes: int, device: Device, owner: object) -> DeviceBuffer:
        """Borrow memory someone else owns (a torch tensor); close() never frees it."""
        self = cls.__new__(cls)
        self.device, self.stream, self.nbytes, self._h, self._ptr = device, None, nbytes, None, ptr
        self.owner = owner  # keeps the owner's memory alive as long as this view
        Resource.__init__(self, _noop, keep=(device, owner))
        return self

    @property
    def ptr(self) -> int:
        """Device address; raises if closed."""
        self._check_open()
        return self._ptr

    def view(self, dtype: Any, shape: tuple[int, ...] | int) -> ArrayView:
        """Typed view for the CUDA array interface; the view keeps this buffer alive."""
        return ArrayView(self, dtype, (shape,) if isinstance(shape, int) else tuple(shape))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def __dlpack__(self, *, stream: int | None = None, **_: Any) -> object:
        self._check_open()
        if self._h is None:
            raise TypeError("a wrapped (borrowed) buffer exports through its owner, not DLPack")
        if stream is not None and self.stream is not None and not self.stream.closed:
            # the consumer's stream knows nothing of ours: finish queued writes before handing over
            self.stream.synchronize()
        return self.device.backend.dlpack(self._h, None)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CUDA, self.device.ordinal)


class PinnedBuffer(Resource):
    """Page-locked host memory; freeing it synchronizes the device, so prefer PinnedPool."""

    kind = "pinned_buffer"

    def __init__(self, nbytes: int, device: Device | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.device, self.nbytes = device or Device(0), nbytes
        backend = self.device.backend
        with self.device:
            self._h, self._ptr = backend.host_alloc(nbytes)
        self._state: dict[str, Any] = {}
        super().__init__(self.device.releaser(backend.host_free, self._h), keep=self.device)

    @property
    def ptr(self) -> int:
        """Host address (also valid on the device under unified addressing); raises if closed."""
        self._check_open()
        return self._ptr

    def numpy(self, dtype: Any = np.uint8) -> np.ndarray:
        """A numpy view; close() raises while any such view (or a view of it) is alive."""
        raw = self.device.backend.host_buffer(self._h, self.ptr, self.nbytes)
        arr = np.frombuffer(raw, dtype=dtype)
        self._pin()
        weakref.finalize(arr, self._unpin)
        return arr

    def used_on(self, stream: Stream) -> None:
        """Note that work queued on `stream` (a copy torch issued, say) reads or writes this memory;
        copy_async notes its own. A lease goes back to its pool ordered behind that work."""
        self._check_open()
        self._state["last_stream"] = stream

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CUDA_HOST, 0)


class PinnedPool(Resource):
    """Reuses pinned blocks by power-of-two size class, so steady state never frees (or syncs).

    A block goes back with an event recorded on the stream that last copied it; `acquire` hands
    out only a block whose event has completed and allocates another while none has, so it never
    blocks the host behind queued copies.
    """

    kind = "pinned_pool"

    def __init__(self, device: Device | None = None, min_block: int = 4096) -> None:
        self.device, self.min_block = device or Device(0), min_block
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = defaultdict(list)
        self.stats = {"hits": 0, "misses": 0, "bytes_held": 0}
        super().__init__(
            self.device.releaser(_drain, self.device.backend, self._free, self._lock),
            keep=self.device,
        )

    def _size_class(self, nbytes: int) -> int:
        size = self.min_block
        while size < nbytes:
            size <<= 1
        return size

    def acquire(self, nbytes: int) -> PinnedLease:
        """A pinned block of at least `nbytes` that no queued copy still uses; close the lease to
        return it to the pool."""
        self._check_open()
        size = self._size_class(nbytes)
        with self._lock:
            block = self._take_idle(size)
            self.stats["hits" if block else "misses"] += 1
        if block is None:
            with self.device:
                h, ptr = self.device.backend.host_alloc(size)
            with self._lock:
                self.stats["bytes_held"] += size
            block = _Block(h, ptr, size)
        return PinnedLease(self, block, nbytes)

    def _take_idle(self, size: int) -> _Block | None:
        # Oldest first: the block returned longest ago is the likeliest to have finished its copy.
        free = self._free[size]
        for i, block in enumerate(free):
            if block.last_copy is None or block.last_copy.query():
                return free.pop(i)
        return None

    def _give_back(self, block: _Block) -> None:
        with self._lock:
            self._free[block.size].append(block)


@dataclass(eq=False, slots=True)
class _Block:
    """One pooled allocation; `last_copy` completes when the last copy that used it has."""

    h: Any
    ptr: int
    size: int
    last_copy: Event | None = None


class PinnedLease(PinnedBuffer):
    """A block borrowed from a PinnedPool; close() returns it (no free, no device sync)."""

    kind = "pinned_lease"

    def __init__(self, pool: PinnedPool, block: _Block, nbytes: int) -> None:
        self.device, self.nbytes, self.pool = pool.device, nbytes, pool
        self._h, self._ptr, self.capacity = block.h, block.ptr, block.size
        self._state = {}
        pool._pin()  # pool.close() raises while leases are out
        Resource.__init__(self, _return_lease(pool, block, self._state), keep=pool)


def _return_lease(pool: PinnedPool, block: _Block, state: dict[str, Any]) -> Any:
    def release() -> None:
        last: Stream | None = state.get("last_stream")
        if last is not None and not last.closed:
            # a copy may still be reading or writing this block: acquire skips it until it is done
            block.last_copy = block.last_copy or Event(pool.device)
            block.last_copy.record(last)
        pool._give_back(block)
        pool._unpin()

    return release


def _drain(backend: Any, free: dict[int, list[_Block]], lock: threading.Lock) -> None:
    with lock:
        blocks = [b for bucket in free.values() for b in bucket]
        free.clear()
    for block in blocks:
        if block.last_copy is not None:
            block.last_copy.synchronize()
            block.last_copy.close()
        backend.host_free(block.h)


def _free_on(backend: Any, h: Any, stream: Stream | None) -> None:
    # stream-ordered free on the allocating stream; if that stream is gone, the legacy stream
    backend.mem_free(h, _raw_or_none(stream))


def _raw_or_none(stream: Stream | None) -> Any:
    return None if stream is None or stream.closed else stream.handle


def _noop() -> None:
    """Release for borrowed memory: the owner frees it."""


Buffer = DeviceBuffer | PinnedBuffer


def copy_async(dst: Buffer, src: Buffer, stream: Stream, nbytes: int | None = None) -> None:
    """Queue a copy of `nbytes` (default: all of src) on `stream`; direction from the pointers."""
    nbytes = src.nbytes if nbytes is None else nbytes
    if nbytes > dst.nbytes or nbytes > src.nbytes:
        raise ValueError(f"copy of {nbytes} bytes exceeds src ({src.nbytes}) or dst ({dst.nbytes})")
    for buf in (dst, src):
        if buf.closed:
            raise ResourceClosedError(f"copy_async: this {buf.kind} is closed")
        if isinstance(buf, PinnedBuffer):
            buf.used_on(stream)
    if stream._capture is not None:
        stream._capture.keep(dst, src)
    with stream.device:
        stream.device.backend.memcpy_async(dst.ptr, src.ptr, nbytes, stream.handle)
