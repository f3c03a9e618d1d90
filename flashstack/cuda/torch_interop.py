"""torch interop: our kernels on torch's current stream, torch tensors as borrowed buffers.

Importing this module imports torch; importing flashstack.cuda does not. torch uses each
device's primary context, and so does flashstack.cuda, so no context switching is needed.
"""

from __future__ import annotations

from typing import Any

import torch

from flashstack.cuda.device import Device
from flashstack.cuda.memory import DeviceBuffer
from flashstack.cuda.stream import Stream


def device_of(tensor: torch.Tensor) -> Device:
    """The flashstack Device a CUDA tensor lives on."""
    if not tensor.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got one on {tensor.device}")
    return Device(tensor.device.index or 0)


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
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    view: Any = buffer.view(np_dtype, shape)
    return torch.as_tensor(view, device=f"cuda:{buffer.device.ordinal}")
