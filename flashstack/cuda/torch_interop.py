"""torch interop: our kernels on torch's current stream, torch tensors as borrowed buffers, and
pinned staging for torch's host <-> device copies through a PinnedPool.

Importing this module imports torch; importing flashstack.cuda does not. torch uses each
device's primary context, and so does flashstack.cuda, so no context switching is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashstack.cuda.device import Device, shared_device
from flashstack.cuda.memory import DeviceBuffer, PinnedBuffer, PinnedLease, PinnedPool
from flashstack.cuda.stream import Event, Stream


def device_of(tensor: torch.Tensor) -> Device:
    """The flashstack Device a CUDA tensor lives on."""
    if not tensor.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got one on {tensor.device}")
    return Device(tensor.device.index or 0)


def device_for(device: torch.device) -> Device:
    """The process's shared Device (properties read once) behind a torch CUDA device; "cuda"
    without an index is torch's current device."""
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return shared_device(device.index if device.index is not None else torch.cuda.current_device())


def current_stream(device: Device | None = None) -> Stream:
    """torch.cuda.current_stream() as a borrowed Stream: launches order with torch's work."""
    device = device or Device(torch.cuda.current_device())
    ts = torch.cuda.current_stream(device.ordinal)
    return Stream.borrow(device, ts.cuda_stream, ts)


def wrap_tensor(tensor: torch.Tensor) -> DeviceBuffer:
    """A borrowed DeviceBuffer over a contiguous CUDA tensor; it never frees torch's memory."""
    if not tensor.is_contiguous():
        raise ValueError("wrap_tensor needs a contiguous tensor; call .contiguous() first")
    nbytes = tensor.numel() * tensor.element_size()
    return DeviceBuffer.wrap(tensor.data_ptr(), nbytes, device_of(tensor), owner=tensor)


def as_tensor(buffer: DeviceBuffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor viewing our buffer; the tensor keeps the buffer alive (not open)."""
    view: Any = buffer.view(numpy_dtype(dtype), shape)
    return torch.as_tensor(view, device=f"cuda:{buffer.device.ordinal}")


def host_tensor(buffer: PinnedBuffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over pinned memory; while it (or a view of it) lives, `buffer` cannot close."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes > buffer.nbytes:
        raise ValueError(f"shape {shape} of {dtype} exceeds the {buffer.nbytes}-byte buffer")
    # bytes first, then torch's view: numpy has no bfloat16
    return torch.from_numpy(buffer.numpy()[:nbytes]).view(dtype).view(shape)


class _Slot:
    """A pinned block HostStaging holds (leased from its pool for the staging's life), a torch
    view of it, and the event of the last copy that used it."""

    __slots__ = ("copied", "host", "lease", "reader")

    def __init__(self, lease: PinnedLease, device: Device) -> None:
        self.lease = lease
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            self.host = host_tensor(lease, torch.uint8, (lease.nbytes,))
        self.copied = Event(device)  # never recorded yet: complete
        self.reader: object | None = None  # the token of a HostCopy whose values are unread

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.host[: int(np.prod(shape)) * dtype.itemsize].view(dtype).view(shape)


class HostCopy:
    """A device tensor's copy into a staging block, queued on torch's stream; `wait()` reads it
    once it has landed. The block is reused only after that (or after this object is gone)."""

    def __init__(self, slot: _Slot, host: torch.Tensor) -> None:
        self._slot, self._host = slot, host
        self._token = slot.reader = object()
        self._values: list[Any] | None = None

    def wait(self) -> list[Any]:
        """The copied values as a list (blocks until the copy is done; later calls return them)."""
        if self._values is None:
            self._slot.copied.synchronize()
            self._values = self._host.tolist()
            self._release()
        return self._values

    def _release(self) -> None:
        if self._slot.reader is self._token:  # not a later copy's claim on the same block
            self._slot.reader = None

    def __del__(self) -> None:
        # never read: the block may go back (its event still guards a copy in flight)
        self._release()


class HostStaging:
    """Host <-> device copies for torch through pinned blocks leased from a PinnedPool: each copy
    is queued on torch's current stream with an event recorded behind it, and a block is reused
    only once its event has completed (and its values have been read), so the host never waits
    and no block is rewritten while a copy still uses it. Blocks stay leased for the staging's
    life: a lease per copy measured 3-5x torch's own pinned copy in host time (docs/cuda.md)."""

    def __init__(self, device: Device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.pool = pool or PinnedPool(device)
        self._slots: dict[int, list[_Slot]] = {}  # size class -> blocks, least recently used first
        self._streams: dict[int, Stream] = {}  # torch stream handle -> borrowed Stream
        self.copies = 0  # copies staged so far, both ways

    def torch_stream(self) -> Stream:
        """torch's current stream on this device, borrowed once per distinct stream."""
        ts = torch.cuda.current_stream(self.device.ordinal)
        stream = self._streams.get(ts.cuda_stream)
        if stream is None:
            stream = self._streams[ts.cuda_stream] = Stream.borrow(self.device, ts.cuda_stream, ts)
        return stream

    def _free_slot(self, nbytes: int) -> _Slot:
        size = self.pool.min_block
        while size < nbytes:
            size <<= 1
        slots = self._slots.setdefault(size, [])
        for i, slot in enumerate(slots):
            if slot.reader is None and slot.copied.query():
                slots.append(slots.pop(i))
                return slot
        slot = _Slot(self.pool.acquire(size), self.device)
        slots.append(slot)
        return slot

    def to_device(
        self, values: Sequence[Any], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`values` (a list, or a list of equal-length lists) as a tensor on this device, copied
        asynchronously from a pinned block; into `out`'s first elements when given."""
        array = np.asarray(values, dtype=numpy_dtype(dtype))
        if out is None:
            dst = torch.empty(array.shape, dtype=dtype, device=f"cuda:{self.device.ordinal}")
        else:
            dst = out.view(-1)[: array.size].view(array.shape)
        slot = self._free_slot(array.nbytes)
        host = slot.view(dtype, array.shape)
        host.numpy()[...] = array
        dst.copy_(host, non_blocking=True)
        slot.copied.record(self.torch_stream())
        self.copies += 1
        return dst

    def to_device_parts(self, parts: Sequence[np.ndarray], offsets: Sequence[int]) -> torch.Tensor:
        """Several host arrays in one copy: each written into one pinned block at its byte
        offset (`offsets`, from `pack_offsets`, ending with the total), the block copied to a
        fresh device byte tensor whose views the caller takes. One copy costs about what one
        `to_device` does, whatever the number of parts."""
        nbytes = offsets[-1]
        slot = self._free_slot(nbytes)
        write_parts(slot.host.numpy(), parts, offsets)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device.ordinal}")
        dst.copy_(slot.host[:nbytes], non_blocking=True)
        slot.copied.record(self.torch_stream())
        self.copies += 1
        return dst

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Queue a copy of a device tensor into a pinned block; read it with `wait()`."""
        slot = self._free_slot(tensor.numel() * tensor.element_size())
        host = slot.view(tensor.dtype, tuple(tensor.shape))
        host.copy_(tensor, non_blocking=True)
        slot.copied.record(self.torch_stream())
        self.copies += 1
        return HostCopy(slot, host)


PART_ALIGN = 16  # bytes: every part's view starts aligned for any dtype


def pack_offsets(parts: Sequence[np.ndarray]) -> list[int]:
    """Byte offsets of `parts` packed one after another, each aligned to PART_ALIGN, and the end."""
    offsets, end = [], 0
    for array in parts:
        offsets.append(end)
        end += -(-array.nbytes // PART_ALIGN) * PART_ALIGN
    return offsets + [end]


def write_parts(host: np.ndarray, parts: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    """Write each array's bytes into the byte array `host` at its offset (from `pack_offsets`)."""
    for array, offset in zip(parts, offsets):
        host[offset : offset + array.nbytes].view(array.dtype)[:] = array.reshape(-1)


_staging: dict[int, HostStaging] = {}
_staging_lock = threading.Lock()


def staging(device: torch.device) -> HostStaging:
    """The process's staging for a CUDA device (one pool per device, as torch has one caching
    host allocator)."""
    dev = device_for(device)
    with _staging_lock:
        if dev.ordinal not in _staging:
            _staging[dev.ordinal] = HostStaging(dev)
        return _staging[dev.ordinal]


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for a torch dtype numpy has (not bfloat16)."""
    if dtype not in _NUMPY_DTYPES:
        _NUMPY_DTYPES[dtype] = torch.empty((), dtype=dtype).numpy().dtype
    return _NUMPY_DTYPES[dtype]
