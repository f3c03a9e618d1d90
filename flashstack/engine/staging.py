"""Host values onto the device and sampled tokens back, without the host waiting: on CUDA through
pooled pinned blocks of flashstack.cuda (torch_interop.staging), on the CPU as plain tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashstack.cuda.torch_interop import (
    HostCopy,
    numpy_dtype,
    pack_offsets,
    staging,
    write_parts,
)


def to_device(
    values: Sequence[Any], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A host list as a 1-D tensor on `device` (`out[:len(values)]` when given). On CUDA the copy
    is asynchronous from pinned memory: a plain torch.tensor(..., device="cuda") waits for the
    whole stream, which would stall the host behind the very step it wants to queue work after."""
    if device.type == "cuda":
        return staging(device).to_device(values, dtype, out)
    host = torch.tensor(values, dtype=dtype)
    return host if out is None else out[: len(values)].copy_(host)


def to_device_parts(
    parts: Sequence[tuple[Sequence[Any], torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Host lists (a list, or a list of equal-length lists, each with its dtype) as tensors on
    `device`, through one copy: a step's inputs and metadata travel together, where a copy each
    cost the host ~70 µs apiece on CUDA (docs/benchmarks.md, "Mixed steps")."""
    arrays = [np.asarray(values, dtype=numpy_dtype(dtype)) for values, dtype in parts]
    offsets = pack_offsets(arrays)
    if device.type == "cuda":
        packed = staging(device).to_device_parts(arrays, offsets)
    else:
        packed = torch.empty(offsets[-1], dtype=torch.uint8)
        write_parts(packed.numpy(), arrays, offsets)
    return [
        packed[offset : offset + array.nbytes].view(dtype).view(array.shape)
        for array, offset, (_, dtype) in zip(arrays, offsets, parts)
    ]


def to_host(tensor: torch.Tensor) -> HostCopy | None:
    """Queue a CUDA tensor's copy into pinned host memory (read it with `.wait()`); None on the
    CPU, where the tensor is already on the host."""
    return staging(tensor.device).to_host(tensor) if tensor.is_cuda else None
