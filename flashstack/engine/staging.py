"""Host values onto the device and sampled tokens back, without the host waiting: on CUDA through
pooled pinned blocks of flashstack.cuda (torch_interop.staging), on the CPU as plain tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashstack.cuda.torch_interop import HostCopy, staging


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


def to_host(tensor: torch.Tensor) -> HostCopy | None:
    """Queue a CUDA tensor's copy into pinned host memory (read it with `.wait()`); None on the
    CPU, where the tensor is already on the host."""
    return staging(tensor.device).to_host(tensor) if tensor.is_cuda else None
