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
    view: Any = buffer.view(_numpy_dtype(dtype), shape)
    return torch.as_tensor(view, device=f"cuda:{buffer.device.ordinal}")


def host_tensor(buffer: PinnedBuffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over pinned memory; while it (or a view of it) lives, `buffer` cannot close."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes > buffer.nbytes:
        raise ValueError(f"shape {shape} of {dtype} exceeds the {buffer.nbytes}-byte buffer")
    # bytes first, then torch's view: numpy has no bfloat16
    return torch.from_numpy(buffer.numpy()[:nbytes]).view(dtype).view(shape)


class HostCopy:
    """A device tensor's copy into a pooled pinned block, queued on torch's stream; `wait()`
    reads it once it has landed and gives the block back to its pool."""

    def __init__(self, lease: PinnedLease, host: torch.Tensor, landed: Event) -> None:
        self._lease, self._host, self._landed = lease, host, landed
        self._values: list[Any] | None = None

    def wait(self) -> list[Any]:
        """The copied values as a list (blocks until the copy is done; later calls return them)."""
        if self._values is None:
            self._landed.synchronize()
            self._values = self._host.tolist()
            self._host = None  # the numpy view must be gone before the lease can close
            self._lease.close()
            self._landed.close()
        return self._values


class HostStaging:
    """Host <-> device copies for torch through a PinnedPool: each copy is queued on torch's
    current stream, and its block goes back to the pool ordered behind that copy, so the host
    never waits and no block is rewritten while a copy still reads it."""

    def __init__(self, device: Device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.pool = pool or PinnedPool(device)
        self._streams: dict[int, Stream] = {}  # torch stream handle -> borrowed Stream

    def torch_stream(self) -> Stream:
        """torch's current stream on this device, borrowed once per distinct stream."""
        ts = torch.cuda.current_stream(self.device.ordinal)
        stream = self._streams.get(ts.cuda_stream)
        if stream is None:
            stream = self._streams[ts.cuda_stream] = Stream.borrow(self.device, ts.cuda_stream, ts)
        return stream

    def to_device(self, values: Sequence[Any], dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """`values` (a list, or a list of equal-length lists) as a tensor on this device, copied
        asynchronously from a pooled pinned block; into `out`'s first elements when given."""
        array = np.asarray(values, dtype=_numpy_dtype(dtype))
        if out is None:
            dst = torch.empty(array.shape, dtype=dtype, device=f"cuda:{self.device.ordinal}")
        else:
            dst = out.view(-1)[: array.size].view(array.shape)
        lease = self.pool.acquire(max(array.nbytes, 1))
        _fill_and_upload(lease, array, dst)
        lease.used_on(self.torch_stream())
        lease.close()
        return dst

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Queue a copy of a contiguous device tensor into a pooled pinned block."""
        lease = self.pool.acquire(max(tensor.numel() * tensor.element_size(), 1))
        host = host_tensor(lease, tensor.dtype, tuple(tensor.shape))
        host.copy_(tensor, non_blocking=True)
        stream = self.torch_stream()
        lease.used_on(stream)
        return HostCopy(lease, host, stream.record())


def _fill_and_upload(lease: PinnedLease, array: np.ndarray, out: torch.Tensor) -> None:
    # The views made here die with this frame, so the lease can close right after.
    host = host_tensor(lease, out.dtype, array.shape)
    host.numpy()[...] = array
    out.copy_(host, non_blocking=True)


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


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype
